package idem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// renewalStore counts the lease extensions of each record, and answers them
// with fail while it is set.
type renewalStore struct {
	recordStore
	mu   sync.Mutex
	n    map[string]int
	fail error
}

func (s *renewalStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	s.mu.Lock()
	s.n[id]++
	fail := s.fail
	s.mu.Unlock()
	if fail != nil {
		return fail
	}
	return s.recordStore.Extend(ctx, id, token, lease, keep)
}

func (s *renewalStore) renewals(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n[id]
}

func (s *renewalStore) failWith(err error) {
	s.mu.Lock()
	s.fail = err
	s.mu.Unlock()
}

// renewalKeeper returns a Keeper with a short lease on b, through a
// renewalStore, with opts.
func renewalKeeper(t *testing.T, b *redistest.Backend, lease time.Duration, opts ...Option) (*Keeper, *renewalStore) {
	t.Helper()
	rs, err := openRedisStore(b.Client)
	require.NoError(t, err)
	s := &renewalStore{recordStore: rs, n: map[string]int{}}
	k, err := keeperOn(s, append([]Option{WithLease(lease), WithRetention(time.Minute)}, opts...)...)
	require.NoError(t, err)
	return k, s
}

// awaitDone waits, for as long as a busy machine may need, for ctx to end.
func awaitDone(t *testing.T, ctx context.Context, what string) bool {
	t.Helper()
	select {
	case <-ctx.Done():
		return true
	case <-time.After(10 * time.Second):
		assert.Fail(t, "timed out", "waiting until %s", what)
		return false
	}
}

// TestKeepAliveRenewsEachClaimUntilItsStop: the renewals of many claims of
// one Keeper share one queue; each claim is renewed while it runs, whatever
// the others do, and not after its stop returned.
func TestKeepAliveRenewsEachClaimUntilItsStop(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		// The Keeper's clock stands still: a renewal slowed down by a busy
		// machine never lets the lease run out by this process's clock (the
		// renewals run on real timers all the same).
		k, s := renewalKeeper(t, b, 300*time.Millisecond, WithClock(newTestClock().Now))
		ctx := context.Background()
		type held struct {
			c    *Claim
			stop func() error
		}
		var claims []held
		for i := range 6 {
			out, err := k.Begin(ctx, "s", fmt.Sprint("k", i))
			require.NoError(t, err)
			_, stop := out.Claim.KeepAlive(ctx)
			claims = append(claims, held{out.Claim, stop})
		}
		for _, h := range claims {
			eventually(t, "three renewals of "+h.c.id, func() bool { return s.renewals(h.c.id) >= 3 })
		}
		// Stop every other claim; the rest go on being renewed.
		stopped := map[string]int{}
		for i, h := range claims {
			if i%2 == 0 {
				require.NoError(t, h.stop())
				stopped[h.c.id] = s.renewals(h.c.id)
			}
		}
		for i, h := range claims {
			if i%2 == 1 {
				n := s.renewals(h.c.id)
				eventually(t, "three more renewals of "+h.c.id, func() bool { return s.renewals(h.c.id) >= n+3 })
			}
		}
		for id, n := range stopped {
			assert.Equal(t, n, s.renewals(id), "a renewal after stop")
		}
		for i, h := range claims {
			if i%2 == 1 {
				require.NoError(t, h.stop())
				_, err := k.Begin(ctx, "s", fmt.Sprint("k", i))
				assert.ErrorIs(t, err, ErrInProgress, "the renewed lease is held")
			}
		}
	})
}

// TestKeepAliveContext: the operation's context carries the claim and the
// caller's values, and it, and every context derived from it, ends with a
// cause wrapping ErrLeaseLost when the store says the lease is lost.
func TestKeepAliveContext(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, s := renewalKeeper(t, b, 30*time.Millisecond)
		type userKey struct{}
		ctx := context.WithValue(context.Background(), userKey{}, "user value")
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		opCtx, stop := out.Claim.KeepAlive(ctx)
		got, ok := ClaimFromContext(opCtx)
		require.True(t, ok)
		assert.Same(t, out.Claim, got)
		assert.Equal(t, "user value", opCtx.Value(userKey{}))
		assert.Contains(t, fmt.Sprint(opCtx), "idem.Claim")
		child, cancelChild := context.WithCancel(opCtx)
		defer cancelChild()

		s.failWith(ErrLeaseLost)
		if awaitDone(t, child, "the lease loss ends a derived context") {
			assert.ErrorIs(t, context.Cause(opCtx), ErrLeaseLost)
			assert.ErrorIs(t, context.Cause(child), ErrLeaseLost)
		}
		err = stop()
		assert.ErrorIs(t, err, ErrLeaseLost)
		assert.Equal(t, err, stop(), "stop again answers the same")
	})
}

// TestKeepAliveRunsOutAfterFailedRenewals: renewals that keep failing (not
// a lost lease: the store cannot be reached) are tried again, each within
// what is left of the lease, until the lease has run out by the process's
// clock; then the operation's context ends with ErrLeaseLost.
func TestKeepAliveRunsOutAfterFailedRenewals(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, s := renewalKeeper(t, b, 60*time.Millisecond)
		ctx := context.Background()
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		s.failWith(errors.New("dial tcp 127.0.0.1: connection refused"))
		opCtx, stop := out.Claim.KeepAlive(ctx)
		if awaitDone(t, opCtx, "the lease runs out") {
			assert.ErrorIs(t, context.Cause(opCtx), ErrLeaseLost)
			assert.GreaterOrEqual(t, s.renewals(out.Claim.id), 2, "tried again after the first failure")
		}
		assert.ErrorIs(t, stop(), ErrLeaseLost)
	})
}

// TestKeepAliveStopsWhileARetryWaits: stop ends the renewals also when the
// next one is a retry after a failed renewal, on a timer of its own.
func TestKeepAliveStopsWhileARetryWaits(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, s := renewalKeeper(t, b, 3*time.Second)
		ctx := context.Background()
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		s.failWith(errors.New("i/o timeout"))
		ka := out.Claim.keepAlive(ctx)
		eventually(t, "a retry waits on its own timer", func() bool {
			k.renewals.mu.Lock()
			defer k.renewals.mu.Unlock()
			return ka.retry != nil
		})
		require.NoError(t, ka.stop(), "the lease is not lost yet")
		n := s.renewals(out.Claim.id)
		// The retry was due within a third of what was left of the lease,
		// sooner than a claim made now is first renewed.
		s.failWith(nil)
		other, err := k.Begin(ctx, "s", "other")
		require.NoError(t, err)
		otherKA := other.Claim.keepAlive(ctx)
		eventually(t, "the other claim renewed", func() bool { return s.renewals(other.Claim.id) >= 1 })
		require.NoError(t, otherKA.stop())
		assert.Equal(t, n, s.renewals(out.Claim.id), "a renewal after stop")
	})
}

// extendCounter counts a store's lease extensions.
type extendCounter struct {
	recordStore
	n atomic.Int32
}

func (s *extendCounter) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	s.n.Add(1)
	return s.recordStore.Extend(ctx, id, token, lease, keep)
}

// TestKeepAliveRenewsUntilStopped guards Do's lease renewal, which runs on a
// timer so that short operations cost no goroutine: a long operation's lease
// is renewed, the result is stored, and renewals end with the operation.
func TestKeepAliveRenewsUntilStopped(t *testing.T) {
	b := redistest.Miniredis(t)
	s, err := openRedisStore(b.Client)
	require.NoError(t, err)
	ext := &extendCounter{recordStore: s}
	// The Keeper's clock stands still, so that a renewal slowed down by a busy
	// machine never lets the lease run out by this process's clock.
	k, err := keeperOn(ext, WithLease(300*time.Millisecond), WithRetention(time.Minute), WithClock(newTestClock().Now))
	require.NoError(t, err)
	ctx := context.Background()
	v, err := Do(ctx, k, "s", "long", func(ctx context.Context) (string, error) {
		eventually(t, "three renewals", func() bool { return ext.n.Load() >= 3 })
		_, err := k.Begin(ctx, "s", "long")
		require.ErrorIs(t, err, ErrInProgress, "the renewed lease is held")
		return "done", ctx.Err()
	})
	require.NoError(t, err)
	assert.Equal(t, "done", v)
	after := ext.n.Load()
	time.Sleep(300 * time.Millisecond) // several renewal periods
	assert.Equal(t, after, ext.n.Load(), "no renewal after the operation")

	// stop waits for a renewal under way.
	out, err := k.Begin(ctx, "s", "stop")
	require.NoError(t, err)
	_, stop := out.Claim.KeepAlive(ctx)
	eventually(t, "a renewal", func() bool { return ext.n.Load() > after })
	require.NoError(t, stop())
	n := ext.n.Load()
	require.NoError(t, stop(), "stop may be called again")
	time.Sleep(150 * time.Millisecond)
	assert.Equal(t, n, ext.n.Load())
}

// An operation resumed past its lease (its process was paused: here, the
// Keeper's clock jumps) finds its context done at its first check, before
// the lease watch's timer has fired, with a cause wrapping ErrLeaseLost;
// contexts derived from it are done from then on. Do and Consume alike.
func TestResumedPastTheLeaseFindsItsContextDone(t *testing.T) {
	b := redistest.Miniredis(t)
	var mu sync.Mutex
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	pause := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	const lease = 30 * time.Second
	k := newKeeper(t, b, WithLease(lease), WithClock(clock))
	ctx := context.Background()

	check := func(ctx context.Context) error {
		require.NoError(t, ctx.Err(), "within the lease")
		pause(lease + time.Second)
		err := ctx.Err()
		assert.ErrorIs(t, err, context.Canceled, "done at the first check after the pause")
		assert.ErrorIs(t, context.Cause(ctx), ErrLeaseLost)
		derived, cancel := context.WithTimeout(ctx, time.Hour)
		defer cancel()
		assert.Error(t, derived.Err(), "a context derived from it is done too")
		return err
	}
	_, err := Do(ctx, k, "s", "do", func(ctx context.Context) (int, error) { return 0, check(ctx) })
	require.Error(t, err)

	res, err := Consume(ctx, k, "s", []string{"m"}, func(s string) string { return s }, func(ctx context.Context, _ string) error {
		return check(ctx)
	})
	require.NoError(t, err)
	assert.False(t, res[0].Status == MessageHandled, "its outcome is not stored as handled: %v", res[0].Status)
}
