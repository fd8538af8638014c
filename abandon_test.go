package idem

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestAbandonHandsTheClaimToTheNextAttempt: the holder of a claim with a
// long lease dies after a checkpoint; Abandon by its token ends the lease
// and keeps the record, and the next claim takes the key over at once:
// Recovered, attempt 2, a higher token, the checkpoint handed over, the
// fingerprint still binding the key.
func TestAbandonHandsTheClaimToTheNextAttempt(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Hour))
		fp := WithFingerprint([]byte("order body"))
		dead, err := k.Begin(ctx, "s", "order-1", fp)
		require.NoError(t, err)
		require.NoError(t, dead.Claim.Checkpoint(ctx, "charged", []byte("ch_1")))
		before := inspectOK(t, k, "s", "order-1")
		_, err = k.Begin(ctx, "s", "order-1", fp)
		require.ErrorIs(t, err, ErrInProgress, "the dead holder's lease blocks the key")

		r, err := k.abandonKey(ctx, "s", "order-1", dead.Claim.Token())
		require.NoError(t, err)
		assert.Equal(t, StatePending, r.State)
		assert.Equal(t, dead.Claim.Token(), r.Token)
		assert.LessOrEqual(t, r.LeaseLeft, time.Duration(0), "the lease is over")
		assert.Equal(t, []CheckpointInfo{{"charged", 4}}, r.Checkpoints)
		assert.Equal(t, 1, r.Attempt)
		assert.True(t, r.Fingerprint)
		assert.InDelta(t, float64(before.ExpiresIn), float64(r.ExpiresIn), float64(time.Second), "the record's time to live is kept")

		_, err = k.Begin(ctx, "s", "order-1", WithFingerprint([]byte("another body")))
		assert.ErrorIs(t, err, ErrMismatch, "the fingerprint still binds the key")
		next, err := k.Begin(ctx, "s", "order-1", fp)
		require.NoError(t, err, "the next attempt takes over at once")
		require.NotNil(t, next.Claim)
		assert.True(t, next.Claim.Recovered())
		assert.Equal(t, 2, next.Claim.Attempt())
		assert.Greater(t, next.Claim.Token(), dead.Claim.Token())
		v, ok := next.Claim.Checkpointed("charged")
		assert.True(t, ok)
		assert.Equal(t, "ch_1", string(v))
		assert.ErrorIs(t, dead.Claim.Complete(ctx, []byte("stale"), 0), ErrLeaseLost, "the dead holder is fenced off")
		require.NoError(t, next.Claim.Complete(ctx, []byte("done"), 0))
	})
}

// TestAbandonIsSafeToRunTwice: a second Abandon, or one go-redis sends again
// after a lost reply, finds the lease over and writes nothing; one resent
// after the next attempt claimed the key leaves that claim alone.
func TestAbandonIsSafeToRunTwice(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Hour))
		dead, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		resend := resendingKeeper(t, b, abandonScript, func() {})
		r, err := resend.abandonKey(ctx, "s", "k", dead.Claim.Token())
		require.NoError(t, err)
		assert.Equal(t, dead.Claim.Token(), r.Token)
		assert.LessOrEqual(t, r.LeaseLeft, time.Duration(0))
		r2, err := k.abandonKey(ctx, "s", "k", dead.Claim.Token())
		require.NoError(t, err)
		assert.Equal(t, r.State, r2.State)
		assert.Equal(t, r.Token, r2.Token)
		assert.Equal(t, r.LeaseLeft, r2.LeaseLeft+r2.ReadAt.Sub(r.ReadAt), "the second run did not move the lease end")

		var next *Claim
		operator := resendingKeeper(t, b, abandonScript, func() {
			out, err := k.Begin(ctx, "s", "k")
			require.NoError(t, err)
			next = out.Claim
		})
		r, err = operator.abandonKey(ctx, "s", "k", dead.Claim.Token())
		require.NoError(t, err, "the claim of the token no longer holds the key: nothing to do")
		require.NotNil(t, next)
		assert.Equal(t, next.Token(), r.Token, "the record as it is: the next attempt's claim")
		assert.Positive(t, r.LeaseLeft, "the next attempt's lease is untouched")
		_, err = k.Begin(ctx, "s", "k")
		assert.ErrorIs(t, err, ErrInProgress)
		require.NoError(t, next.Complete(ctx, []byte("done"), 0))
	})
}

// TestAbandonLeavesWhatIsNotTheClaim: Abandon of a completed or released
// record, of a newer claim, or of no record, does nothing and says what it
// found; the record is unchanged.
func TestAbandonLeavesWhatIsNotTheClaim(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		const lease = 50 * time.Millisecond
		k := newKeeper(t, b, WithLease(lease), WithRetention(time.Hour))
		r, err := k.abandonKey(ctx, "s", "absent", 12345)
		require.NoError(t, err)
		assert.Equal(t, StateAbsent, r.State)

		out, err := k.Begin(ctx, "s", "done")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))
		r, err = k.abandonKey(ctx, "s", "done", out.Claim.Token())
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, r.State)
		assert.Equal(t, out.Claim.Token(), r.Token)
		got, err := k.Begin(ctx, "s", "done")
		require.NoError(t, err)
		assert.Equal(t, "v", string(got.Value), "the result still replays")

		long := newKeeper(t, b, WithLease(time.Hour))
		out, err = long.Begin(ctx, "s", "released")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Release(ctx))
		r, err = k.abandonKey(ctx, "s", "released", out.Claim.Token())
		require.NoError(t, err)
		assert.Equal(t, StateReleased, r.State)

		old, err := k.Begin(ctx, "s", "taken")
		require.NoError(t, err)
		b.Advance(lease + time.Millisecond)
		newer, err := long.Begin(ctx, "s", "taken")
		require.NoError(t, err)
		r, err = k.abandonKey(ctx, "s", "taken", old.Claim.Token())
		require.NoError(t, err)
		assert.Equal(t, newer.Claim.Token(), r.Token, "the newer claim is what is there")
		assert.Positive(t, r.LeaseLeft, "and its lease is untouched")
		_, err = k.Begin(ctx, "s", "taken")
		assert.ErrorIs(t, err, ErrInProgress)
	})
}

// TestAbandonOfALiveHolder: Abandon of a holder that is in fact alive: its
// next renewal gives it the lease back while nobody claimed the key; once
// another attempt has, the holder's renewal finds the lease lost and its
// operation's context is cancelled.
func TestAbandonOfALiveHolder(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Hour))
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		_, err = k.abandonKey(ctx, "s", "k", out.Claim.Token())
		require.NoError(t, err)
		require.NoError(t, out.Claim.Extend(ctx), "nobody took the key over: the renewal holds it again")
		_, err = k.Begin(ctx, "s", "k")
		require.ErrorIs(t, err, ErrInProgress)

		_, err = k.abandonKey(ctx, "s", "k", out.Claim.Token())
		require.NoError(t, err)
		next, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.True(t, next.Claim.Recovered())
		assert.ErrorIs(t, out.Claim.Extend(ctx), ErrLeaseLost, "taken over: the holder learns it at its next renewal")
	})
}

// TestAbandonNeverChangesWhatIsNotARecord, and refuses bad input before the
// store.
func TestAbandonRefusals(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		var n redistest.Counter
		b.Client.AddHook(&n)
		k := newKeeper(t, b)
		rk := k.store.(*redisStore).RecordKey("s", "k")
		require.NoError(t, b.Client.Set(ctx, rk, "someone else's value", 0).Err())
		r, err := k.abandonKey(ctx, "s", "k", 1)
		require.ErrorIs(t, err, ErrCorrupt)
		assert.Equal(t, rk, r.Key)
		v, err := b.Client.Get(ctx, rk).Result()
		require.NoError(t, err)
		assert.Equal(t, "someone else's value", v)

		canceled, cancel := context.WithCancel(ctx)
		cancel()
		assert.Zero(t, n.Count(func() {
			_, err := k.abandonKey(ctx, "s", "", 1)
			assert.ErrorIs(t, err, ErrInvalidKey)
			for _, tok := range []int64{0, -5, 1 << 53} {
				_, err = k.abandonKey(ctx, "s", "k", tok)
				assert.ErrorIs(t, err, ErrInvalidConfig, "token %d", tok)
			}
			_, err = k.store.(*redisStore).Abandon(ctx, "idem:{x}", 1)
			assert.ErrorIs(t, err, ErrInvalidKey)
			_, err = k.abandonKey(canceled, "s", "k", 1)
			assert.ErrorIs(t, err, context.Canceled)
			assert.False(t, errors.Is(err, ErrUnavailable))
		}))
	})
}
