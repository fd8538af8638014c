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
		rk := k.store.(*redisStore).RecordKey("s", "k")
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
		s, err := openRedisStore(resendScripter{b.Client})
		require.NoError(t, err)
		resending, err := keeperOn(s, WithLease(time.Hour))
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
		require.NoError(t, k.store.(*redisStore).LoadScripts(ctx))
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
			r, err := k.forgetToken(ctx, "s", "b", tok, false)
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
		_, err = k.store.(*redisStore).Forget(ctx, "idem:{x}", 1, true)
		assert.ErrorIs(t, err, ErrInvalidKey, "a Redis key is not a record id")
		for _, tok := range []int64{0, -1, 1 << 53} {
			_, err = k.forgetToken(ctx, "s", "k", tok, true)
			assert.ErrorIs(t, err, ErrInvalidConfig, "token %d", tok)
			_, err = k.store.(*redisStore).Forget(ctx, recordID("s", "k"), tok, true)
			assert.ErrorIs(t, err, ErrInvalidConfig, "token %d", tok)
		}
		_, err = k.Forget(canceled, "s", "k", true)
		assert.ErrorIs(t, err, context.Canceled)
		assert.False(t, errors.Is(err, ErrUnavailable))
	}))
}

// resendBetween runs one script twice, as go-redis does when the first reply
// was lost, and calls between() in between: what other clients do while
// go-redis waits to send the command again. Other scripts run once.
type resendBetween struct {
	redis.Scripter
	script  *redis.Script
	src     string
	between func()
}

func (r resendBetween) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	if sha != r.script.Hash() {
		return r.Scripter.EvalSha(ctx, sha, keys, args...)
	}
	first := r.Scripter.EvalSha(ctx, sha, keys, args...)
	if first.Err() != nil {
		return first // NOSCRIPT: Script.Run falls back to Eval
	}
	r.between()
	return r.Scripter.EvalSha(ctx, sha, keys, args...)
}

func (r resendBetween) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	if script != r.src {
		return r.Scripter.Eval(ctx, script, keys, args...)
	}
	r.Scripter.Eval(ctx, script, keys, args...)
	r.between()
	return r.Scripter.Eval(ctx, script, keys, args...)
}

// resendingKeeper is a Keeper on b whose store runs script twice for each
// call, calling between() in between.
func resendingKeeper(t *testing.T, b *redistest.Backend, sc *luaScript, between func()) *Keeper {
	t.Helper()
	s, err := openRedisStore(resendBetween{Scripter: b.Client, script: sc.Script, src: sc.src, between: between})
	require.NoError(t, err)
	k, err := keeperOn(s, WithLease(time.Hour))
	require.NoError(t, err)
	return k
}

// TestResentForcedForgetNeverRemovesANewerLiveClaim: an operator
// force-forgets a claim known dead. The reply is lost; before go-redis sends
// the script again, a client claims the key and starts running the
// operation. The resend must leave that live claim alone: a new call finds
// it in progress, and its holder completes.
func TestResentForcedForgetNeverRemovesANewerLiveClaim(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Hour))
		_, err := k.Begin(ctx, "s", "stuck") // the dead holder the operator means
		require.NoError(t, err)

		var live *Claim
		operator := resendingKeeper(t, b, forgetScript, func() {
			out, err := k.Begin(ctx, "s", "stuck")
			require.NoError(t, err, "a client claims the forgotten key")
			require.NotNil(t, out.Claim)
			live = out.Claim // its operation is running now
		})

		_, err = operator.Forget(ctx, "s", "stuck", true)
		require.NoError(t, err)
		require.NotNil(t, live)

		_, err = k.Begin(ctx, "s", "stuck")
		assert.ErrorIs(t, err, ErrInProgress, "the claim made after the forget is live: a new call must not run the operation beside it")
		assert.NoError(t, live.Complete(ctx, []byte("live holder's result"), 0), "the live holder was fenced off by a resend it never saw")
	})
}

// TestResentForgetIsNotAnError: a Forget whose reply was lost, resent after a
// client claimed the key again, finds the record it removed gone: nothing to
// forget, not an error (and the new claim is not in the way).
func TestResentForgetIsNotAnError(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Hour))
		_, err := Do(ctx, k, "s", "done", func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
		operator := resendingKeeper(t, b, forgetScript, func() {
			_, err := k.Begin(ctx, "s", "done")
			require.NoError(t, err)
		})
		r, err := operator.Forget(ctx, "s", "done", false)
		assert.NoError(t, err, "the completed record was forgotten by the first run; the resend reports %v", r.State)
		assert.Equal(t, StateAbsent, r.State, "the resend removed nothing")
		assert.Equal(t, StatePending, inspectOK(t, k, "s", "done").State, "the claim made since is left alone")
	})
}

// TestForgetOfAnAbandonedClaimKeepsItsCheckpoints: Forget without force
// refuses an abandoned claim (its lease ran out) that holds checkpoints, and
// says so; the next attempt takes it over, Recovered, with the checkpoint of
// the step that happened, and does not do it again.
func TestForgetOfAnAbandonedClaimKeepsItsCheckpoints(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Minute))
		s := k.store.(*redisStore)
		out, err := k.Begin(ctx, "s", "order-1")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Checkpoint(ctx, "charged", []byte("ch_1")))
		// The holder dies; its lease runs out.
		require.NoError(t, expireLua.Run(ctx, b.Client, []string{s.RecordKey("s", "order-1")}).Err())
		rec, err := k.Inspect(ctx, "s", "order-1")
		require.NoError(t, err)
		require.Equal(t, StatePending, rec.State)
		require.LessOrEqual(t, rec.LeaseLeft, time.Duration(0))
		assert.Equal(t, []CheckpointInfo{{Name: "charged", Size: 4}}, rec.Checkpoints, "Inspect shows the checkpoints")

		r, ferr := k.Forget(ctx, "s", "order-1", false) // idemctl forget, no -force
		var refused *ForgetRefusedError
		if assert.ErrorAs(t, ferr, &refused) {
			assert.Equal(t, []CheckpointInfo{{Name: "charged", Size: 4}}, refused.Checkpoints)
			assert.Zero(t, refused.LeaseLeft, "the lease ran out")
			assert.False(t, errors.Is(ferr, ErrInProgress), "no lease is live")
			assert.ErrorContains(t, ferr, `"charged"`)
		}
		assert.Equal(t, out.Claim.Token(), r.Token, "the record found is returned")
		next, err := k.Begin(ctx, "s", "order-1")
		require.NoError(t, err)
		require.NotNil(t, next.Claim)
		_, charged := next.Claim.Checkpointed("charged")
		assert.True(t, charged, "Forget without force (err %v) dropped the checkpoint of a step that happened: the next attempt (attempt %d, recovered %v) charges again",
			ferr, next.Claim.Attempt(), next.Claim.Recovered())
		assert.True(t, next.Claim.Recovered())
		assert.Equal(t, 2, next.Claim.Attempt())
	})
}

// TestForgetRefusalSaysWhatIsLost: without force, a live lease and
// checkpoints are refused, each named in the error; force removes the record
// all the same, and the next attempt starts afresh.
func TestForgetRefusalSaysWhatIsLost(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Hour))
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Checkpoint(ctx, "charged", []byte("ch_1")))
		require.NoError(t, out.Claim.Checkpoint(ctx, "shipped", nil))

		r, err := k.forgetToken(ctx, "s", "k", out.Claim.Token(), false)
		var refused *ForgetRefusedError
		require.ErrorAs(t, err, &refused)
		assert.Positive(t, refused.LeaseLeft)
		assert.LessOrEqual(t, refused.LeaseLeft, time.Hour)
		assert.Equal(t, []CheckpointInfo{{"charged", 4}, {"shipped", 0}}, refused.Checkpoints)
		assert.ErrorIs(t, err, ErrInProgress, "a live lease is in progress")
		var ip *InProgressError
		require.ErrorAs(t, err, &ip)
		assert.Equal(t, max(refused.LeaseLeft, time.Millisecond), ip.RetryAfter)
		assert.ErrorContains(t, err, "the lease is live")
		assert.ErrorContains(t, err, `"charged", "shipped"`)
		assert.Equal(t, StatePending, r.State)
		assert.Equal(t, refused.Checkpoints, r.Checkpoints)
		assert.Equal(t, out.Claim.Token(), inspectOK(t, k, "s", "k").Token, "nothing removed")

		r, err = k.forgetToken(ctx, "s", "k", out.Claim.Token(), true)
		require.NoError(t, err)
		assert.Equal(t, StatePending, r.State, "the record as it was")
		assert.Len(t, r.Checkpoints, 2)
		assert.ErrorIs(t, out.Claim.Checkpoint(ctx, "late", nil), ErrLeaseLost, "the holder is fenced off")
		b.Advance(time.Millisecond)
		next, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		assert.Equal(t, 1, next.Claim.Attempt())
		assert.Empty(t, next.Claim.allCheckpoints(), "forced: the checkpoints are gone")
	})
}

// TestForgetTokenLeavesAnotherRecordAlone: ForgetToken names the record by
// the token shown; a newer claim of the key, or the key completed by another
// attempt, is nothing to forget and is left as it is, even with force. The
// completed record's short form is named by its token too.
func TestForgetTokenLeavesAnotherRecordAlone(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		const lease = 50 * time.Millisecond
		k := newKeeper(t, b, WithLease(lease), WithRetention(time.Hour))
		shown, err := k.Begin(ctx, "s", "k") // the record the operator was shown
		require.NoError(t, err)
		b.Advance(lease + time.Millisecond)
		newer, err := newKeeper(t, b, WithLease(time.Hour)).Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.True(t, newer.Claim.Recovered())

		r, err := k.forgetToken(ctx, "s", "k", shown.Claim.Token(), true)
		require.NoError(t, err, "nothing to forget is not an error")
		assert.Equal(t, Record{ID: recordID("s", "k"), Key: k.store.(*redisStore).RecordKey("s", "k")}, r)
		assert.Equal(t, newer.Claim.Token(), inspectOK(t, k, "s", "k").Token, "the newer claim is untouched")

		require.NoError(t, newer.Claim.Complete(ctx, []byte("done"), 0))
		r, err = k.forgetToken(ctx, "s", "k", shown.Claim.Token(), true)
		require.NoError(t, err)
		assert.Equal(t, StateAbsent, r.State)
		assert.Equal(t, StateCompleted, inspectOK(t, k, "s", "k").State, "the completion by another token is untouched")

		r, err = k.forgetToken(ctx, "s", "k", newer.Claim.Token(), false)
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, r.State, "the completed record of the token is removed")
		assert.Equal(t, newer.Claim.Token(), r.Token)
		assert.Equal(t, StateAbsent, inspectOK(t, k, "s", "k").State)
	})
}

// TestForgetConfirmedAfterANewClaim: the operator looked (Inspect), a client
// claimed the key while they decided, and they force-forget the token they
// saw: the new claim is not removed.
func TestForgetConfirmedAfterANewClaim(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Hour))
		_, err := Do(ctx, k, "s", "k", func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
		seen := inspectOK(t, k, "s", "k")
		// Another operator forgets it; a client claims the key again.
		_, err = k.forgetToken(ctx, "s", "k", seen.Token, false)
		require.NoError(t, err)
		b.Advance(time.Millisecond)
		live, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)

		r, err := k.forgetToken(ctx, "s", "k", seen.Token, true)
		require.NoError(t, err)
		assert.Equal(t, StateAbsent, r.State)
		require.NoError(t, live.Claim.Complete(ctx, []byte("mine"), 0), "the claim made after the look holds the key")
	})
}

// TestInspectShowsCheckpoints: Inspect and Scan name the checkpoints of a
// pending or released record, with their value sizes; a completed record
// holds none.
func TestInspectShowsCheckpoints(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Hour))
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		assert.Nil(t, inspectOK(t, k, "s", "k").Checkpoints)
		name := "step:\x00\xff" // any bytes
		require.NoError(t, out.Claim.Checkpoint(ctx, name, make([]byte, MaxCheckpointValue)))
		require.NoError(t, out.Claim.Checkpoint(ctx, "b", []byte("x")))
		want := []CheckpointInfo{{name, MaxCheckpointValue}, {"b", 1}}
		assert.Equal(t, want, inspectOK(t, k, "s", "k").Checkpoints)
		n := 0
		for r, err := range k.store.(*redisStore).Scan(ctx, ScanOptions{}) {
			require.NoError(t, err)
			assert.Equal(t, want, r.Checkpoints, "Scan reads them as Inspect does")
			n++
		}
		assert.Equal(t, 1, n)

		require.NoError(t, out.Claim.Release(ctx))
		r := inspectOK(t, k, "s", "k")
		assert.Equal(t, StateReleased, r.State)
		assert.Equal(t, want, r.Checkpoints, "a released record keeps them")

		next, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.NoError(t, next.Claim.Complete(ctx, []byte("done"), 0))
		assert.Nil(t, inspectOK(t, k, "s", "k").Checkpoints, "completed: dropped")
	})
}

// TestForgetAndAbandonNeverChangeUnreadableCheckpoints: what follows a
// pending record's header and cannot be read as checkpoints is neither
// removed (even forced) nor rewritten: ErrCorrupt, as a claim answers.
func TestForgetAndAbandonNeverChangeUnreadableCheckpoints(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b)
		rk := k.store.(*redisStore).RecordKey("s", "odd")
		const value = "i1P1700000000000000:2:1:4102444800000000:AAAAAAAAAAA::\x00later"
		require.NoError(t, b.Client.Set(ctx, rk, value, time.Hour).Err())
		_, err := k.forgetToken(ctx, "s", "odd", 1700000000000000, true)
		assert.ErrorIs(t, err, ErrCorrupt)
		_, err = k.abandonKey(ctx, "s", "odd", 1700000000000000)
		assert.ErrorIs(t, err, ErrCorrupt)
		_, err = k.Begin(ctx, "s", "odd")
		assert.ErrorIs(t, err, ErrCorrupt, "as a claim answers")
		v, err := b.Client.Get(ctx, rk).Result()
		require.NoError(t, err)
		assert.Equal(t, value, v)
	})
}
