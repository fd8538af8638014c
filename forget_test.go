package idem

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestForgetCompletedRunsTheKeyAgain(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		var runs atomic.Int32
		fn := func(ctx context.Context) (int32, error) {
			c, _ := ClaimFromContext(ctx)
			assert.Equal(t, 1, c.Attempt(), "a forgotten key starts again at attempt 1")
			assert.False(t, c.Recovered())
			return runs.Add(1), nil
		}
		_, err := Do(ctx, k, "s", "k", fn)
		require.NoError(t, err)
		before := inspectOK(t, k, "s", "k")

		r, err := k.Forget(ctx, "s", "k", false)
		require.NoError(t, err)
		assert.Equal(t, before.State, r.State, "Forget returns the record it removed")
		assert.Equal(t, before.Token, r.Token)
		assert.Equal(t, StoredValue, r.Stored)
		assert.Equal(t, StateAbsent, inspectOK(t, k, "s", "k").State)

		b.Advance(time.Millisecond) // miniredis's clock stands still otherwise
		v, err := Do(ctx, k, "s", "k", fn)
		require.NoError(t, err)
		assert.EqualValues(t, 2, v, "the operation runs again")
		assert.Greater(t, inspectOK(t, k, "s", "k").Token, before.Token, "tokens still increase: the next one is Redis's clock")

		r, err = k.Forget(ctx, "s", "never-seen", false)
		require.NoError(t, err)
		assert.Equal(t, StateAbsent, r.State, "forgetting nothing is not an error")
	})
}

func TestForgetRefusesALiveLease(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(time.Hour))
		ctx := context.Background()
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)

		r, err := k.Forget(ctx, "s", "k", false)
		require.ErrorIs(t, err, ErrInProgress)
		var ip *InProgressError
		require.ErrorAs(t, err, &ip)
		assert.Positive(t, ip.RetryAfter)
		assert.LessOrEqual(t, ip.RetryAfter, time.Hour)
		assert.Equal(t, StatePending, r.State, "the record found is returned")
		assert.Equal(t, out.Claim.Token(), r.Token)

		assert.Equal(t, out.Claim.Token(), inspectOK(t, k, "s", "k").Token, "nothing removed")
		require.NoError(t, out.Claim.Complete(ctx, []byte("done"), 0), "the holder is undisturbed")
	})
}

func TestForgetRemovesAnAbandonedOrReleasedClaim(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		const lease = 50 * time.Millisecond
		k := newKeeper(t, b, WithLease(lease), WithRetention(time.Hour))
		ctx := context.Background()
		_, err := k.Begin(ctx, "s", "abandoned")
		require.NoError(t, err)
		b.Advance(lease + time.Millisecond)
		long := newKeeper(t, b, WithLease(time.Hour)) // a released record is kept for a lease
		out, err := long.Begin(ctx, "s", "released")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Release(ctx))

		for key, state := range map[string]RecordState{"abandoned": StatePending, "released": StateReleased} {
			r, err := k.Forget(ctx, "s", key, false)
			require.NoError(t, err, "no force needed for %s", key)
			assert.Equal(t, state, r.State)
			assert.Equal(t, StateAbsent, inspectOK(t, k, "s", key).State)
		}
	})
}

// TestForcedForgetFencesTheHolder: a forced Forget removes a live claim; the
// holder's later Complete, Release and Extend get ErrLeaseLost and write
// nothing, before and after the next claim.
func TestForcedForgetFencesTheHolder(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(time.Hour))
		ctx := context.Background()
		old, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)

		r, err := k.Forget(ctx, "s", "k", true)
		require.NoError(t, err)
		assert.Equal(t, StatePending, r.State)
		assert.Equal(t, old.Claim.Token(), r.Token)

		assert.ErrorIs(t, old.Claim.Extend(ctx), ErrLeaseLost)
		assert.ErrorIs(t, old.Claim.Complete(ctx, []byte("stale"), 0), ErrLeaseLost)
		assert.ErrorIs(t, old.Claim.Release(ctx), ErrLeaseLost)
		assert.Equal(t, StateAbsent, inspectOK(t, k, "s", "k").State, "the holder wrote nothing")

		b.Advance(time.Millisecond)
		next, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.NotNil(t, next.Claim, "the next claim runs the operation")
		assert.Equal(t, 1, next.Claim.Attempt())
		assert.False(t, next.Claim.Recovered(), "the forgotten claim is not reported")
		assert.Greater(t, next.Claim.Token(), old.Claim.Token())
		assert.ErrorIs(t, old.Claim.Complete(ctx, []byte("stale"), 0), ErrLeaseLost)
		require.NoError(t, next.Claim.Complete(ctx, []byte("fresh"), 0))

		again, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		assert.Equal(t, "fresh", string(again.Value))
	})
}

// TestForcedForgetDuringDo: Do's lease renewal finds the record gone, cancels
// fn's context with ErrLeaseLost, and stores nothing.
func TestForcedForgetDuringDo(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(300*time.Millisecond))
		ctx := context.Background()
		started := make(chan struct{})
		var cause error
		done := make(chan error, 1)
		go func() {
			_, err := Do(ctx, k, "s", "k", func(ctx context.Context) (string, error) {
				close(started)
				<-ctx.Done() // until the renewal finds the lease lost
				cause = context.Cause(ctx)
				return "charged", nil
			})
			done <- err
		}()
		<-started
		r, err := k.Forget(ctx, "s", "k", true)
		require.NoError(t, err)
		assert.Equal(t, StatePending, r.State)
		err = <-done
		assert.ErrorIs(t, err, ErrLeaseLost)
		assert.ErrorIs(t, cause, ErrLeaseLost, "fn's context ends with ErrLeaseLost")
		assert.Equal(t, StateAbsent, inspectOK(t, k, "s", "k").State, "nothing stored")
	})
}

func TestForgetNeverRemovesWhatIsNotARecord(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		rk := k.store.(*RedisStore).RecordKey("s", "k")
		require.NoError(t, b.Client.Set(ctx, rk, "someone else's value", 0).Err())
		for _, force := range []bool{false, true} {
			r, err := k.Forget(ctx, "s", "k", force)
			require.ErrorIs(t, err, ErrCorrupt)
			assert.Equal(t, rk, r.Key)
		}
		v, err := b.Client.Get(ctx, rk).Result()
		require.NoError(t, err)
		assert.Equal(t, "someone else's value", v)
	})
}

// resendScripter runs every script twice and answers the second reply, as
// when go-redis sends a command again because the first reply was lost.
type resendScripter struct{ redis.Scripter }

func (r resendScripter) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	r.Scripter.EvalSha(ctx, sha, keys, args...)
	return r.Scripter.EvalSha(ctx, sha, keys, args...)
}

func (r resendScripter) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	r.Scripter.Eval(ctx, script, keys, args...)
	return r.Scripter.Eval(ctx, script, keys, args...)
}

func TestForgetIsSafeToResend(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Hour))
		s, err := NewRedisStore(resendScripter{b.Client})
		require.NoError(t, err)
		resending, err := New(s, WithLease(time.Hour))
		require.NoError(t, err)

		_, err = Do(ctx, k, "s", "done", func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
		r, err := resending.Forget(ctx, "s", "done", false)
		require.NoError(t, err, "the resent Forget finds the record gone")
		assert.Equal(t, StateAbsent, r.State)
		assert.Equal(t, StateAbsent, inspectOK(t, k, "s", "done").State)

		out, err := k.Begin(ctx, "s", "running")
		require.NoError(t, err)
		_, err = resending.Forget(ctx, "s", "running", false)
		require.ErrorIs(t, err, ErrInProgress, "refused both times")
		assert.Equal(t, out.Claim.Token(), inspectOK(t, k, "s", "running").Token)
	})
}

// TestForgetRoundTrips: ForgetToken is one round trip; Forget reads the
// record first (one more), to name it by its token.
func TestForgetRoundTrips(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var n redistest.Counter
		b.Client.AddHook(&n)
		k := newKeeper(t, b)
		ctx := context.Background()
		require.NoError(t, k.store.(*RedisStore).LoadScripts(ctx))
		for _, key := range []string{"a", "b"} {
			_, err := Do(ctx, k, "s", key, func(context.Context) (int, error) { return 1, nil })
			require.NoError(t, err)
		}
		assert.EqualValues(t, 2, n.Count(func() {
			r, err := k.Forget(ctx, "s", "a", false)
			assert.NoError(t, err)
			assert.Equal(t, StateCompleted, r.State)
		}))
		tok := inspectOK(t, k, "s", "b").Token
		assert.EqualValues(t, 1, n.Count(func() {
			r, err := k.ForgetToken(ctx, "s", "b", tok, false)
			assert.NoError(t, err)
			assert.Equal(t, StateCompleted, r.State)
		}))
		assert.EqualValues(t, 1, n.Count(func() {
			r, err := k.Forget(ctx, "s", "b", false)
			assert.NoError(t, err)
			assert.Equal(t, StateAbsent, r.State, "nothing to forget: one read")
		}))
	})
}

func TestForgetRefusesBeforeTheStore(t *testing.T) {
	b := redistest.Miniredis(t)
	var n redistest.Counter
	b.Client.AddHook(&n)
	k := newKeeper(t, b)
	ctx := context.Background()
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	assert.Zero(t, n.Count(func() {
		_, err := k.Forget(ctx, "s", string(make([]byte, MaxKeyLen+1)), true)
		assert.ErrorIs(t, err, ErrInvalidKey)
		_, err = k.store.(*RedisStore).Forget(ctx, "idem:{x}", 1, true)
		assert.ErrorIs(t, err, ErrInvalidKey, "a Redis key is not a record id")
		for _, tok := range []int64{0, -1, 1 << 53} {
			_, err = k.ForgetToken(ctx, "s", "k", tok, true)
			assert.ErrorIs(t, err, ErrInvalidConfig, "token %d", tok)
			_, err = k.store.(*RedisStore).Forget(ctx, recordID("s", "k"), tok, true)
			assert.ErrorIs(t, err, ErrInvalidConfig, "token %d", tok)
		}
		_, err = k.Forget(canceled, "s", "k", true)
		assert.ErrorIs(t, err, context.Canceled)
		assert.False(t, errors.Is(err, ErrUnavailable))
	}))
}
