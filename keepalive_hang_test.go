package idem

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A renewal that does not come back (a connection to a partitioned Redis, a
// client without a read timeout, or one whose timeouts and retries add up
// past the lease) must not hold back the cancellation of the operation's
// context: the lease end is known locally, and when it passes, the
// operation is told, whatever the renewal is doing.

// hangingStore is a redisStore whose renewals (Extend, ExtendBatch) hang
// while hang is set, until release is closed or their context ends (unless
// deaf is set: as go-redis without ContextTimeoutEnabled, which waits out
// its own timeouts), then fail as a timeout would.
type hangingStore struct {
	*redisStore
	mu      sync.Mutex
	hang    bool
	deaf    bool
	release chan struct{}
	entered chan struct{}
	once    sync.Once
}

func newHangingStore(t *testing.T, b *redistest.Backend) *hangingStore {
	rs, err := openRedisStore(b.Client)
	require.NoError(t, err)
	h := &hangingStore{redisStore: rs, release: make(chan struct{}), entered: make(chan struct{})}
	t.Cleanup(func() { h.unblock() })
	return h
}

func (h *hangingStore) unblock() {
	h.mu.Lock()
	defer h.mu.Unlock()
	select {
	case <-h.release:
	default:
		close(h.release)
	}
}

func (h *hangingStore) setHang(v bool) {
	h.mu.Lock()
	h.hang = v
	h.mu.Unlock()
}

// stuck blocks a renewal while hang is set; it reports whether it did.
func (h *hangingStore) stuck(ctx context.Context) (bool, error) {
	h.mu.Lock()
	hang, deaf := h.hang, h.deaf
	h.mu.Unlock()
	if !hang {
		return false, nil
	}
	h.once.Do(func() { close(h.entered) })
	if deaf {
		ctx = context.Background()
	}
	select {
	case <-ctx.Done():
		return true, ctx.Err()
	case <-h.release:
		return true, errors.New("read tcp 127.0.0.1: i/o timeout")
	}
}

func (h *hangingStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	if hung, err := h.stuck(ctx); hung {
		return err
	}
	return h.redisStore.Extend(ctx, id, token, lease, keep)
}

func (h *hangingStore) ExtendBatch(ctx context.Context, claims []claimFence, lease, keep time.Duration) []error {
	if hung, err := h.stuck(ctx); hung {
		errs := make([]error, len(claims))
		for i := range errs {
			errs[i] = err
		}
		return errs
	}
	return h.redisStore.ExtendBatch(ctx, claims, lease, keep)
}

// takeOver claims key with another Keeper once the first holder's lease has
// run out in Redis, and returns that claim.
func takeOver(t *testing.T, b *redistest.Backend, scope, key string) *Claim {
	t.Helper()
	other := newKeeper(t, b, WithLease(time.Minute))
	deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
	for {
		out, err := other.Begin(context.Background(), scope, key)
		if err == nil {
			require.NotNil(t, out.Claim)
			require.True(t, out.Claim.Recovered())
			return out.Claim
		}
		require.ErrorIs(t, err, ErrInProgress)
		require.True(t, time.Now().Before(deadline), "the first lease never ran out")
		time.Sleep(20 * time.Millisecond)
	}
}

// TestKeepAliveCancelsWhenTheLeaseRunsOutDuringAHungRenewal: with a renewal
// that hangs, the lease runs out, another attempt takes the key over, and
// the first function's context must be cancelled (ErrLeaseLost) by then.
func TestKeepAliveCancelsWhenTheLeaseRunsOutDuringAHungRenewal(t *testing.T) {
	b := redistest.Real(t)
	h := newHangingStore(t, b)
	const lease = 600 * time.Millisecond
	k, err := keeperOn(h, WithLease(lease), WithRetention(time.Minute))
	require.NoError(t, err)
	h.setHang(true)

	started := make(chan context.Context, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		_, _ = Do(context.Background(), k, "s", "hung", func(ctx context.Context) (int, error) {
			started <- ctx
			select {
			case <-ctx.Done():
			case <-time.After(30 * time.Second):
			}
			return 1, nil
		})
	}()
	opCtx := <-started
	<-h.entered // the first renewal is under way, and hangs

	second := takeOver(t, b, "s", "hung")
	t.Logf("taken over by token %d while the first holder runs", second.Token())
	select {
	case <-opCtx.Done():
		assert.ErrorIs(t, context.Cause(opCtx), ErrLeaseLost)
	case <-time.After(3 * time.Second):
		assert.Fail(t, "the first holder's context is still live after its lease ran out and another attempt took the key over")
	}
	h.unblock()
	<-finished
}

// TestKeepAliveStalledRedisWithDefaultClient: the same with no fake store: a
// go-redis client with its default timeouts and retries, through a proxy
// that stops answering (a partition between this process and Redis) once
// the function runs. The lease is 1.5 s; the first renewal, due at 0.5 s,
// takes the client's timeouts and retries (over 12 s) to fail; the
// function's context must end by the time another attempt took over.
func TestKeepAliveStalledRedisWithDefaultClient(t *testing.T) {
	srv := redistest.Start(t)
	p, err := faultproxy.New(srv.Addr, 1)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	client := redis.NewClient(&redis.Options{Addr: p.Addr()}) // go-redis defaults
	t.Cleanup(func() { client.Close() })
	const lease = 1500 * time.Millisecond
	k, err := NewRedis(client, WithLease(lease), WithRetention(time.Minute))
	require.NoError(t, err)
	direct := &redistest.Backend{Client: redistest.NewClient(t, srv.Addr)}

	started := make(chan context.Context, 1)
	finished := make(chan time.Duration, 1)
	t0 := time.Now()
	go func() {
		_, _ = Do(context.Background(), k, "s", "stalled", func(ctx context.Context) (int, error) {
			p.Set(faultproxy.Faults{Delay: time.Minute}) // Redis stops answering this process
			started <- ctx
			<-ctx.Done()
			finished <- time.Since(t0)
			return 1, nil
		})
	}()
	opCtx := <-started
	second := takeOver(t, direct, "s", "stalled")
	t.Logf("taken over after %s (token %d)", time.Since(t0).Round(time.Millisecond), second.Token())
	select {
	case <-opCtx.Done():
	case <-time.After(3 * time.Second):
		assert.Fail(t, "the first holder's context is still live 3 s after another attempt took the key over")
	}
	select {
	case d := <-finished:
		t.Logf("the first holder's context ended after %s (lease %s)", d.Round(time.Millisecond), lease)
	case <-time.After(60 * time.Second):
	}
	p.Close()
}

// TestKeepAliveStopDoesNotWaitForAHungRenewalOfALostLease: once the lease
// ran out during a renewal that hangs past its deadline (a client that does
// not honour it), the operation's stop, and so Do, returns ErrLeaseLost at
// once instead of waiting for the renewal to come back.
func TestKeepAliveStopDoesNotWaitForAHungRenewalOfALostLease(t *testing.T) {
	b := redistest.Real(t)
	h := newHangingStore(t, b)
	h.deaf = true
	k, err := keeperOn(h, WithLease(300*time.Millisecond), WithRetention(time.Minute))
	require.NoError(t, err)
	h.setHang(true)
	done := make(chan error, 1)
	go func() {
		_, err := Do(context.Background(), k, "s", "k", func(ctx context.Context) (int, error) {
			<-ctx.Done()
			return 1, nil
		})
		done <- err
	}()
	select {
	case err := <-done:
		assert.ErrorIs(t, err, ErrLeaseLost)
		assert.ErrorContains(t, err, "while its renewal was under way")
	case <-time.After(20 * time.Second): // the renewal hangs until the test ends
		assert.Fail(t, "Do waits for a renewal that hangs although its lease is lost")
	}
}

// deadlineStore records the deadline of each renewal's context, and how much
// of the lease was left by the Keeper's clock when it was sent.
type deadlineStore struct {
	recordStore
	mu        sync.Mutex
	deadlines []time.Duration // deadline - time of the call; -1: none
}

func (s *deadlineStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	d := time.Duration(-1)
	if dl, ok := ctx.Deadline(); ok {
		d = time.Until(dl)
	}
	s.mu.Lock()
	s.deadlines = append(s.deadlines, d)
	s.mu.Unlock()
	return s.recordStore.Extend(ctx, id, token, lease, keep)
}

func (s *deadlineStore) seen() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Duration(nil), s.deadlines...)
}

// TestKeepAliveBoundsEachRenewalByTheLeaseLeft: every renewal's context has
// a deadline, no later than the lease left, by the Keeper's clock, when it
// was sent. The Keeper's clock moves only when the test says: half the lease
// has gone by it when the first renewal is sent, and nothing more after.
func TestKeepAliveBoundsEachRenewalByTheLeaseLeft(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		rs, err := openRedisStore(b.Client)
		require.NoError(t, err)
		s := &deadlineStore{recordStore: rs}
		const lease = 900 * time.Millisecond
		clock := newTestClock()
		k, err := keeperOn(s, WithLease(lease), WithRetention(time.Minute), WithClock(clock.Now))
		require.NoError(t, err)
		out, err := k.Begin(context.Background(), "s", "k")
		require.NoError(t, err)
		clock.Advance(lease / 2)
		_, stop := out.Claim.KeepAlive(context.Background())
		eventually(t, "three renewals", func() bool { return len(s.seen()) >= 3 })
		require.NoError(t, stop())
		for i, d := range s.seen() {
			assert.Positive(t, d, "renewal %d: no deadline, or one already past", i)
			bound := lease // renewed at a standing clock: a whole lease left
			if i == 0 {
				bound = lease / 2
			}
			assert.LessOrEqual(t, d, bound, "renewal %d: a deadline later than the lease left", i)
		}
	})
}

// TestKeepAliveLateClaimPastItsLeaseDoesNotRun: a claim answered after its
// lease ran out by this process's clock is lost before the operation starts:
// Do does not run fn, and KeepAlive's context is cancelled when it returns,
// without a renewal being sent.
func TestKeepAliveLateClaimPastItsLeaseDoesNotRun(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		rs, err := openRedisStore(b.Client)
		require.NoError(t, err)
		const lease = 50 * time.Millisecond
		s := &renewalStore{recordStore: &lateStore{recordStore: rs, lag: lease + 10*time.Millisecond}, n: map[string]int{}}
		k, err := keeperOn(s, WithLease(lease), WithRetention(time.Minute))
		require.NoError(t, err)
		ran := false
		_, err = Do(context.Background(), k, "s", "do", func(context.Context) (int, error) { ran = true; return 1, nil })
		assert.ErrorIs(t, err, ErrLeaseLost)
		assert.False(t, ran, "fn ran on a claim whose lease had run out")

		out, err := k.Begin(context.Background(), "s", "begin")
		require.NoError(t, err)
		opCtx, stop := out.Claim.KeepAlive(context.Background())
		require.Error(t, opCtx.Err(), "the operation's context is live on a lease that has run out")
		assert.ErrorIs(t, context.Cause(opCtx), ErrLeaseLost)
		assert.ErrorIs(t, stop(), ErrLeaseLost)
		assert.Zero(t, s.renewals(out.Claim.id), "a renewal was sent for a lease that had run out")
	})
}

// TestKeepAliveLeaseEndIsByTheKeepersClock: the lease end is the Keeper's
// clock's (WithClock): a renewal that hangs while that clock stands still
// does not end the operation, however long it hangs in real time; once the
// clock passes the lease end, the operation's context is cancelled, the
// renewal still hanging.
func TestKeepAliveLeaseEndIsByTheKeepersClock(t *testing.T) {
	b := redistest.Real(t)
	h := newHangingStore(t, b)
	h.deaf = true
	clock := newTestClock()
	const lease = 150 * time.Millisecond
	k, err := keeperOn(h, WithLease(lease), WithRetention(time.Minute), WithClock(clock.Now))
	require.NoError(t, err)
	out, err := k.Begin(context.Background(), "s", "k")
	require.NoError(t, err)
	h.setHang(true)
	opCtx, stop := out.Claim.KeepAlive(context.Background())
	<-h.entered
	// Real time runs past the lease several times over; the Keeper's clock
	// does not move, so the lease is live by it.
	time.Sleep(4 * lease)
	assert.NoError(t, opCtx.Err(), "the operation was cancelled although the Keeper's clock says its lease is live")
	clock.Advance(lease)
	if awaitDone(t, opCtx, "the lease runs out by the Keeper's clock") {
		assert.ErrorIs(t, context.Cause(opCtx), ErrLeaseLost)
	}
	assert.ErrorIs(t, stop(), ErrLeaseLost)
}
