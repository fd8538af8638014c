package idem

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

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
func resendingKeeper(t *testing.T, b *redistest.Backend, script *redis.Script, src string, between func()) *Keeper {
	t.Helper()
	s, err := NewRedisStore(resendBetween{Scripter: b.Client, script: script, src: src, between: between})
	require.NoError(t, err)
	k, err := New(s, WithLease(time.Hour))
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
		operator := resendingKeeper(t, b, forgetScript, forgetLua, func() {
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
		operator := resendingKeeper(t, b, forgetScript, forgetLua, func() {
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
		s := k.store.(*RedisStore)
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

		r, err := k.ForgetToken(ctx, "s", "k", out.Claim.Token(), false)
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

		r, err = k.ForgetToken(ctx, "s", "k", out.Claim.Token(), true)
		require.NoError(t, err)
		assert.Equal(t, StatePending, r.State, "the record as it was")
		assert.Len(t, r.Checkpoints, 2)
		assert.ErrorIs(t, out.Claim.Checkpoint(ctx, "late", nil), ErrLeaseLost, "the holder is fenced off")
		b.Advance(time.Millisecond)
		next, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		assert.Equal(t, 1, next.Claim.Attempt())
		assert.Empty(t, next.Claim.Checkpoints(), "forced: the checkpoints are gone")
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

		r, err := k.ForgetToken(ctx, "s", "k", shown.Claim.Token(), true)
		require.NoError(t, err, "nothing to forget is not an error")
		assert.Equal(t, Record{ID: recordID("s", "k"), Key: k.store.(*RedisStore).RecordKey("s", "k")}, r)
		assert.Equal(t, newer.Claim.Token(), inspectOK(t, k, "s", "k").Token, "the newer claim is untouched")

		require.NoError(t, newer.Claim.Complete(ctx, []byte("done"), 0))
		r, err = k.ForgetToken(ctx, "s", "k", shown.Claim.Token(), true)
		require.NoError(t, err)
		assert.Equal(t, StateAbsent, r.State)
		assert.Equal(t, StateCompleted, inspectOK(t, k, "s", "k").State, "the completion by another token is untouched")

		r, err = k.ForgetToken(ctx, "s", "k", newer.Claim.Token(), false)
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
		_, err = k.ForgetToken(ctx, "s", "k", seen.Token, false)
		require.NoError(t, err)
		b.Advance(time.Millisecond)
		live, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)

		r, err := k.ForgetToken(ctx, "s", "k", seen.Token, true)
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
		for r, err := range k.store.(*RedisStore).Scan(ctx, ScanOptions{}) {
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
		rk := k.store.(*RedisStore).RecordKey("s", "odd")
		const value = "i1P1700000000000000:2:1:4102444800000000:AAAAAAAAAAA::\x00later"
		require.NoError(t, b.Client.Set(ctx, rk, value, time.Hour).Err())
		_, err := k.ForgetToken(ctx, "s", "odd", 1700000000000000, true)
		assert.ErrorIs(t, err, ErrCorrupt)
		_, err = k.Abandon(ctx, "s", "odd", 1700000000000000)
		assert.ErrorIs(t, err, ErrCorrupt)
		_, err = k.Begin(ctx, "s", "odd")
		assert.ErrorIs(t, err, ErrCorrupt, "as a claim answers")
		v, err := b.Client.Get(ctx, rk).Result()
		require.NoError(t, err)
		assert.Equal(t, value, v)
	})
}
