package idem

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The replay cache is filled only with what the store says a Complete
// stored: a second Complete of one claim (a caller retrying a completion
// whose first reply it never got), with another value or another retention,
// writes nothing, and must not put into the cache a result or a lifetime
// that Redis does not hold.

// TestReplayCacheKeepsTheFirstCompletion: Redis keeps the first result; the
// cache answers it too, as every Keeper without a cache does.
func TestReplayCacheKeepsTheFirstCompletion(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithReplayCache(100, 1<<20, time.Hour))
		plain := newKeeper(t, b)
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte("first"), 0))
		require.NoError(t, out.Claim.Complete(ctx, []byte("second"), 0), "a completed claim completes again without error, writing nothing")

		fromStore, err := plain.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.Equal(t, "first", string(fromStore.Value), "Redis keeps the first result")
		cached, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		assert.Equal(t, "first", string(cached.Value), "the replay cache answers a result Redis does not hold")
		assert.Equal(t, uint64(1), k.ReplayCacheStats().Hits, "answered from the cache")
	})
}

// TestReplayCacheNeverOutlivesTheStoredRetention: an entry lives never past
// the retention the Keeper stored it with; a second Complete with a longer
// retention writes nothing and must not give the entry a longer life.
func TestReplayCacheNeverOutlivesTheStoredRetention(t *testing.T) {
	b := redistest.Miniredis(t)
	ctx := context.Background()
	clock := newTestClock()
	k := newKeeper(t, b, WithClock(clock.Now), WithReplayCache(100, 1<<20, 2*time.Hour))
	out, err := k.Begin(ctx, "s", "k")
	require.NoError(t, err)
	require.NoError(t, out.Claim.Complete(ctx, []byte("v"), time.Hour))
	require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0)) // the Keeper's 24 h: nothing written

	clock.Advance(90 * time.Minute)
	b.Advance(90 * time.Minute) // Redis drops the record after its hour
	gone, err := newKeeper(t, b).Inspect(ctx, "s", "k")
	require.NoError(t, err)
	require.Equal(t, StateAbsent, gone.State)

	again, err := k.Begin(ctx, "s", "k")
	require.NoError(t, err)
	assert.NotNil(t, again.Claim, "90 minutes after a completion kept for an hour, the key is free again; the cache replayed it (replayed=%v)", again.Replayed)
}

// TestCompleteAgainIsItsOwnAnswer: the store tells a completion it stored
// from one it found done by the same token, on both forms of the completed
// record; another token is refused.
func TestCompleteAgainIsItsOwnAnswer(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b)
		s := k.store.(*RedisStore)
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		id, tok := recordID("s", "k"), out.Claim.Token()
		stored, err := s.completeOnce(ctx, id, tok, seal(kindBytes, []byte("first")), time.Hour)
		require.NoError(t, err)
		assert.True(t, stored)
		stored, err = s.completeOnce(ctx, id, tok, seal(kindBytes, []byte("second")), time.Hour)
		require.NoError(t, err)
		assert.False(t, stored, "already completed by this token")
		require.NoError(t, s.Complete(ctx, id, tok, seal(kindBytes, []byte("third")), time.Hour), "the Store contract: a retried Complete succeeds")
		_, err = s.completeOnce(ctx, id, tok+1, seal(kindBytes, []byte("other")), time.Hour)
		assert.ErrorIs(t, err, ErrLeaseLost)

		// The long form an earlier version wrote.
		rk := s.key(recordID("s", "long"))
		require.NoError(t, b.Client.Set(ctx, rk, "i1C77:1:0:0:att::"+string(seal(kindBytes, []byte("old"))), time.Hour).Err())
		stored, err = s.completeOnce(ctx, recordID("s", "long"), 77, seal(kindBytes, []byte("new")), time.Hour)
		require.NoError(t, err)
		assert.False(t, stored)
	})
}
