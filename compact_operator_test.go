package idem

// Operators and compact claims: Inspect, Forget and Abandon see a claim of
// Consume or of BeginBatch with WithCompactClaims, and a marker, where the
// key has no record of its own, and act on them by token as on records.

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// compactClaims claims keys compactly with BeginBatch and returns the
// claims, in order.
func compactClaims(t *testing.T, k *Keeper, keys ...string) []*Claim {
	t.Helper()
	res, err := k.batchBegin(context.Background(), "s", keys, withCompactClaims())
	require.NoError(t, err)
	claims := make([]*Claim, len(res))
	for i, r := range res {
		require.NoError(t, r.Err, keys[i])
		require.NotNil(t, r.Outcome.Claim, keys[i])
		claims[i] = r.Outcome.Claim
	}
	return claims
}

func TestInspectCompactClaimsAndMarkers(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Minute))
		claims := compactClaims(t, k, "held", "released", "done")

		r, err := k.Inspect(ctx, "s", "held")
		require.NoError(t, err)
		assert.Equal(t, StatePending, r.State)
		assert.True(t, r.Compact)
		assert.Equal(t, claims[0].Token(), r.Token)
		assert.Equal(t, 1, r.Attempt)
		assert.False(t, r.Recovered)
		assert.InDelta(t, time.Minute.Seconds(), r.LeaseLeft.Seconds(), 2)
		assert.Positive(t, r.ExpiresIn)
		assert.Nil(t, r.Checkpoints)
		assert.Equal(t, recordID("s", "held"), r.ID)

		require.NoError(t, k.releaseClaims(ctx, claims[1:2])[0])
		r, err = k.Inspect(ctx, "s", "released")
		require.NoError(t, err)
		assert.Equal(t, StateReleased, r.State)
		assert.True(t, r.Compact)

		require.NoError(t, k.completeClaims(ctx, []completion{{Claim: claims[2]}})[0])
		r, err = k.Inspect(ctx, "s", "done")
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, r.State, "a marker")
		assert.True(t, r.Compact)
		assert.Equal(t, StoredBytes, r.Stored)
		assert.Zero(t, r.Size)
		assert.GreaterOrEqual(t, r.CompletedAgo, time.Duration(0))
		assert.Less(t, r.CompletedAgo, time.Minute)

		r, err = k.Inspect(ctx, "s", "never")
		require.NoError(t, err)
		assert.Equal(t, StateAbsent, r.State)
		assert.False(t, r.Compact)
	})
}

func TestForgetCompactClaimsAndMarkers(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Minute))
		runs := 0
		handle := func(context.Context, msg) error { runs++; return nil }
		_, err := Consume(ctx, k, "s", msgs("m1", "m2"), msgID, handle)
		require.NoError(t, err)

		// A marker is forgotten without force; the message runs again.
		seen, err := k.Inspect(ctx, "s", "m1")
		require.NoError(t, err)
		require.True(t, seen.Compact)
		_, err = k.forgetToken(ctx, "s", "m1", seen.Token+1, false)
		require.NoError(t, err)
		again, err := k.Inspect(ctx, "s", "m1")
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, again.State, "another token: nothing done")
		r, err := k.forgetToken(ctx, "s", "m1", seen.Token, false)
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, r.State, "the marker as it was")
		assert.True(t, r.Compact)
		r, err = k.forgetToken(ctx, "s", "m1", seen.Token, false)
		require.NoError(t, err, "sent again: nothing left to forget")
		assert.Equal(t, StateAbsent, r.State)
		res, err := Consume(ctx, k, "s", msgs("m1", "m2"), msgID, handle)
		require.NoError(t, err)
		assert.Equal(t, MessageHandled, res[0].Status, "forgotten: handled again")
		assert.Equal(t, MessageReplayed, res[1].Status, "the call's other marker stays")
		assert.Equal(t, 3, runs)

		// A compact claim whose lease is live is refused without force;
		// forced, its holder is fenced off.
		claims := compactClaims(t, k, "held", "other")
		_, err = k.Forget(ctx, "s", "held", false)
		var refused *ForgetRefusedError
		require.ErrorAs(t, err, &refused)
		assert.Positive(t, refused.LeaseLeft)
		assert.ErrorIs(t, err, ErrInProgress)
		r, err = k.Forget(ctx, "s", "held", true)
		require.NoError(t, err)
		assert.Equal(t, StatePending, r.State)
		assert.True(t, r.Compact)
		errs := k.completeClaims(ctx, []completion{{Claim: claims[0]}, {Claim: claims[1]}})
		assert.ErrorIs(t, errs[0], ErrLeaseLost, "the forgotten claim's holder is refused")
		assert.NoError(t, errs[1], "the call's other claim is its own")
		out, err := k.Begin(ctx, "s", "held")
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.Equal(t, 1, out.Claim.Attempt(), "forgotten: a first attempt")
		assert.Greater(t, out.Claim.Token(), claims[0].Token())
	})
}

func TestAbandonCompactClaim(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Minute))
		claims := compactClaims(t, k, "dead", "alive")

		r, err := k.abandonKey(ctx, "s", "dead", claims[0].Token()+1)
		require.NoError(t, err)
		assert.Equal(t, StatePending, r.State, "another token: nothing done")
		assert.True(t, r.Compact)
		assert.Positive(t, r.LeaseLeft)

		r, err = k.abandonKey(ctx, "s", "dead", claims[0].Token())
		require.NoError(t, err)
		assert.Equal(t, StatePending, r.State)
		assert.False(t, r.Compact, "moved to a record of its own")
		assert.LessOrEqual(t, r.LeaseLeft, time.Duration(0), "its lease ended")
		r, err = k.abandonKey(ctx, "s", "dead", claims[0].Token())
		require.NoError(t, err, "sent again")
		assert.LessOrEqual(t, r.LeaseLeft, time.Duration(0))

		_, err = k.Begin(ctx, "s", "alive")
		assert.ErrorIs(t, err, ErrInProgress, "the call's other claim keeps its lease")
		out, err := k.Begin(ctx, "s", "dead")
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.True(t, out.Claim.Recovered(), "taken over at once")
		assert.Equal(t, 2, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), claims[0].Token())
		errs := k.completeClaims(ctx, []completion{{Claim: claims[0]}, {Claim: claims[1]}})
		assert.ErrorIs(t, errs[0], ErrLeaseLost)
		assert.NoError(t, errs[1])
		require.NoError(t, out.Claim.Complete(ctx, []byte("recovered"), 0))
	})
}

// TestOperatorsCheckTheLayout: an index of another layout (the first one's,
// "v1 scale=N") is not read as if it were this version's, nor changed.
func TestOperatorsCheckTheLayout(t *testing.T) {
	b := redistest.Miniredis(t)
	ctx := context.Background()
	k := newKeeper(t, b)
	claims := compactClaims(t, k, "x")
	_, ikey, _ := k.store.(*redisStore).compactIndexArgs(recordID("s", "x")) // the index of the store's layout
	state, err := b.Client.HGet(ctx, ikey, "").Result()
	require.NoError(t, err)
	require.NoError(t, b.Client.HSet(ctx, ikey, "", "v1 scale=1000").Err())
	other := k
	_, err = other.Inspect(ctx, "s", "x")
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = other.forgetToken(ctx, "s", "x", claims[0].Token(), true)
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = other.abandonKey(ctx, "s", "x", claims[0].Token())
	assert.ErrorIs(t, err, ErrInvalidConfig)
	require.NoError(t, b.Client.HSet(ctx, ikey, "", state).Err())
	r, err := k.Inspect(ctx, "s", "x")
	require.NoError(t, err)
	assert.Equal(t, StatePending, r.State, "nothing done")
	assert.True(t, r.Compact)
}

// TestScanListsCompactClaimsByCall: Scan lists the compact claims and
// markers of each call, a Record for each state, after the records.
func TestScanListsCompactClaimsByCall(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Minute))
		s := k.store.(*redisStore)
		_, err := Consume(ctx, k, "s", msgs("m1", "m2", "m3"), msgID, func(context.Context, msg) error { return nil })
		require.NoError(t, err)
		claims := compactClaims(t, k, "p1", "p2", "r1")
		require.NoError(t, k.releaseClaims(ctx, claims[2:])[0])
		out, err := k.Begin(ctx, "s", "record")
		require.NoError(t, err)

		var pending, completed, released, records []Record
		for r, err := range s.Scan(ctx, ScanOptions{}) {
			require.NoError(t, err)
			switch {
			case !r.Compact:
				records = append(records, r)
			case r.State == StatePending:
				pending = append(pending, r)
			case r.State == StateCompleted:
				completed = append(completed, r)
			case r.State == StateReleased:
				released = append(released, r)
			}
		}
		require.Len(t, records, 1)
		assert.Equal(t, out.Claim.Token(), records[0].Token)
		require.Len(t, completed, 1, "one call completed three markers")
		assert.Equal(t, 3, completed[0].Claims)
		assert.Empty(t, completed[0].ID, "a compact claim's id is not kept whole")
		assert.Regexp(t, ":c3?:", completed[0].Key, "a call record's key (v2 or v3)")
		assert.Equal(t, StoredBytes, completed[0].Stored)
		require.Len(t, pending, 1)
		assert.Equal(t, 2, pending[0].Claims)
		assert.Equal(t, claims[0].Token(), pending[0].Token)
		assert.Positive(t, pending[0].LeaseLeft)
		require.Len(t, released, 1)
		assert.Equal(t, 1, released[0].Claims)
		assert.Equal(t, pending[0].Key, released[0].Key, "the same call")

		var only []Record
		for r, err := range s.Scan(ctx, ScanOptions{State: StatePending}) {
			require.NoError(t, err)
			only = append(only, r)
		}
		require.Len(t, only, 2, "the pending record and the call's pending claims")

		n := 0
		for _, err := range s.Scan(ctx, ScanOptions{Limit: 2}) {
			require.NoError(t, err)
			n++
		}
		assert.Equal(t, 2, n, "the limit counts both kinds")
	})
}
