package idem

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCompactCompletionKeepsItsRetention: a marker keeps the retention its
// completion asked for, as a record does. Completion.Retention (and
// Claim.Complete's retention) is "how long the result is kept". A claim of
// BeginBatch(WithCompactClaims()) completed with an empty result and a
// retention of 10s, read 700ms later by a Keeper whose retention is 200ms
// and marker retention 400ms, must still be replayed: a claim kept in a record
// (WithCompactClaims off, or the same call's claim that went to a record)
// is. The marker instead answers by the reader's retention and marker
// retention only, so past 400ms the key is free and the operation runs again.
func TestCompactCompletionKeepsItsRetention(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		// Scaled down so that a real redis-server can wait for it: a retention
		// of 200ms, a marker retention of 400ms, a completion kept 10s, read
		// 700ms later.
		k := newKeeper(t, b, WithLease(100*time.Millisecond), WithRetention(200*time.Millisecond), WithMarkerRetention(400*time.Millisecond))
		ctx := context.Background()

		for _, compact := range []bool{false, true} {
			key := map[bool]string{false: "record", true: "compact"}[compact]
			var opts []Option
			if compact {
				opts = append(opts, WithCompactClaims())
			}
			res, err := k.BeginBatch(ctx, "s", []string{key}, opts...)
			require.NoError(t, err)
			require.NoError(t, res[0].Err)
			c := res[0].Outcome.Claim
			require.NotNil(t, c)
			t.Logf("%s: ref %d", key, c.ref)
			errs := k.CompleteBatch(ctx, []Completion{{Claim: c, Value: nil, Retention: 10 * time.Second}})
			require.NoError(t, errs[0])
		}

		b.Advance(700 * time.Millisecond) // within the 10s asked for
		for _, key := range []string{"record", "compact"} {
			o, err := k.Begin(ctx, "s", key)
			if o.Claim != nil {
				_ = o.Claim.Release(ctx)
			}
			assert.NoError(t, err, "%s", key)
			assert.Nil(t, o.Claim, "%s: completed 700ms ago with a retention of 10s (marker retention 400ms), claimed again: the operation runs twice", key)
			assert.True(t, o.Replayed, "%s: not replayed", key)
		}
	})
}

// TestMarkerNeverAnswersForANonCanonicalTwin: ids are told apart by every
// character, the padding bits of the last one included. A RedisStore takes any id (Store.Claim,
// Store.ClaimBatch; Inspect and Forget take any 22 base64url
// characters), and indexDigest decodes a 22-character base64url id without
// checking that it is the canonical encoding: the last character carries 2
// bits of padding that the decoder drops. Two distinct ids that differ only
// there have one digest, one index entry: the marker of one answers for the
// other ("a marker never answers for another id"), and Inspect of one shows
// the other's marker. Record ids made by RecordID are canonical; ids a
// caller of the store makes need not be.
func TestMarkerNeverAnswersForANonCanonicalTwin(t *testing.T) {
	b := redistest.Real(t)
	ctx := context.Background()
	s, err := NewRedisStore(b.Client)
	require.NoError(t, err)
	a, other := "AAAAAAAAAAAAAAAAAAAAAA", "AAAAAAAAAAAAAAAAAAAAAB" // two ids, two record keys
	require.NotEqual(t, s.key(a), s.key(other))

	req := BatchClaimRequest{IDs: []string{a}, Attempt: "AAAAAAAAAAA", Lease: time.Minute, Keep: time.Hour,
		Retention: time.Hour, MarkerRetention: time.Hour, Compact: true}
	got := s.ClaimBatch(ctx, req)
	require.NoError(t, got[0].Err)
	require.Equal(t, StatusClaimed, got[0].Reply.Status)
	errs := s.CompleteBatch(ctx, []BatchCompletion{{Fence: Fence{ID: a, Token: got[0].Reply.Token, Ref: got[0].Reply.Ref}, Value: emptyBytes, Keep: time.Hour}})
	require.NoError(t, errs[0])

	r, err := s.Claim(ctx, other, ClaimRequest{Attempt: "BBBBBBBBBBB", Lease: time.Minute, Keep: time.Hour, Retention: time.Hour, MarkerRetention: time.Hour})
	require.NoError(t, err)
	assert.Equal(t, StatusClaimed, r.Status, "%s was never claimed, but is answered as %s's marker (status %d)", other, a, r.Status)

	rec, err := s.Inspect(ctx, other)
	require.NoError(t, err)
	t.Logf("Inspect(%s): state %s token %d", other, rec.State, rec.Token)
}

// TestMarkerScaleChangesNothingAReaderRelies: the index sizes itself, and
// WithMarkerScale is ignored, so stores that were given different scales
// read one index. Before, with a declared scale: "every store on a prefix must
// use the same [scale], each index key records it, and a store of another
// scale is refused with ErrInvalidConfig before it writes anything"
// (docs/consumers.md). On one server, a scale above 2^25 spreads the index
// over several keys (i:0, i:1, ...). A deployment that raises the scale
// from the default to 2^26 finds the old layout only in i:0; its calls whose
// entries fall in i:1, which does not exist yet, are not refused: they
// write i:1 with the new layout and claim afresh messages that the old
// store handled (their markers are in i:0), so their handlers run again.
func TestMarkerScaleChangesNothingAReaderRelies(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		old := newKeeper(t, b) // DefaultMarkerScale: one index key, i:0
		msgs := make([]string, 200)
		for i := range msgs {
			msgs[i] = fmt.Sprint("m", i)
		}
		id := func(m string) string { return m }
		res, err := Consume(ctx, old, "s", msgs, id, func(context.Context, string) error { return nil })
		require.NoError(t, err)
		for i, r := range res {
			require.Equal(t, MessageHandled, r.Status, msgs[i])
		}

		bigger := newKeeper(t, b, WithMarkerScale(1<<26)) // two index keys, i:0 and i:1
		ran, refused := 0, 0
		res, err = Consume(ctx, bigger, "s", msgs, id, func(context.Context, string) error { ran++; return nil })
		require.NoError(t, err)
		for _, r := range res {
			if errors.Is(r.Err, ErrInvalidConfig) {
				refused++
			}
		}
		t.Logf("redelivered to a store of another scale: %d refused (ErrInvalidConfig), %d handlers ran again", refused, ran)
		assert.Zero(t, ran, "messages handled before ran again under a store of another scale")
		n, _ := b.Client.Exists(ctx, "idem:i:1").Result()
		assert.Zero(t, n, "the store of another scale wrote an index key")
	})
}
