package idemhttp

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// markerStore answers every claim as a Store does for a key whose operation
// completed and left only a marker: within the retention (a replay of an
// empty result) or past it (StatusResultExpired). The steps the middleware
// never takes (batches, checkpoints, the operator's) are left to the nil
// Store it embeds: taking one panics.
type markerStore struct {
	idem.Store
	expired bool
}

func (s markerStore) Claim(context.Context, string, idem.ClaimRequest) (idem.ClaimReply, error) {
	if s.expired {
		return idem.ClaimReply{Status: idem.StatusResultExpired, Token: 7, Attempt: 1, Marker: true}, nil
	}
	return idem.ClaimReply{Status: idem.StatusCompleted, Token: 7, Attempt: 1, Marker: true, Value: []byte{1, 'b'}}, nil
}

func (markerStore) Complete(context.Context, string, int64, []byte, time.Duration) (bool, error) {
	return false, idem.ErrLeaseLost
}

func (markerStore) Release(context.Context, string, int64, time.Duration) error {
	return idem.ErrLeaseLost
}

func (markerStore) Extend(context.Context, string, int64, time.Duration, time.Duration) error {
	return idem.ErrLeaseLost
}

// TestKeyKnownOnlyByItsMarker: a key whose operation completed and whose
// response is not kept (only a marker is left, past the retention, or the
// key was completed with nothing to replay) is answered 410 with
// ProblemResultExpired; the handler does not run again.
func TestKeyKnownOnlyByItsMarker(t *testing.T) {
	for _, expired := range []bool{true, false} {
		k, err := idem.New(markerStore{expired: expired})
		require.NoError(t, err)
		mw, err := New(k)
		require.NoError(t, err)
		ran := false
		h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ran = true }))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, post("/payments", `{"amount":10}`, "Idempotency-Key", "k1"))
		requireProblem(t, rec, http.StatusGone, ProblemResultExpired)
		assert.False(t, ran, "expired %v: the handler never runs again", expired)
	}
}
