package idem

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMarkerNeverAnswersForANonCanonicalTwin: ids are told apart by every
// character, the padding bits of the last one included. A RedisStore takes any id (Store.Claim,
// BatchStore.ClaimBatch; Inspect and Forget take any 22 base64url
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
