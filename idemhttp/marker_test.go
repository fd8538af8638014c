package idemhttp

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// markKey leaves on b only a marker for the key of r (its DefaultKeyHeader,
// in the middleware's default scope ""), with the fingerprint the
// middleware gives r by default: a consumer handles the key as a message
// (idem.Consume) with r's fingerprint and an empty result, which leaves a
// marker, not a response of the middleware's. With expired, the marker is
// past its retention (the consumer's retention and lease are 100ms, then
// b's clock is moved by 200ms) and within its marker retention
// (idem.DefaultMarkerRetention): the operation ran, its result is no
// longer kept. It reads r's body, and checks that a Keeper on b sees a
// marker and answers it so: completed with an empty result, or
// idem.ErrResultExpired.
func markKey(t *testing.T, b *redistest.Backend, r *http.Request, expired bool) {
	t.Helper()
	ctx := context.Background()
	body, err := io.ReadAll(r.Body)
	require.NoError(t, err)
	fp := requestFingerprint(r, defaultFingerprint(r, body))
	key := r.Header.Get(DefaultKeyHeader)
	var opts []idem.Option
	if expired {
		opts = append(opts, idem.WithLease(100*time.Millisecond), idem.WithRetention(100*time.Millisecond))
	}
	consumer, err := idem.NewRedis(b.Client, opts...)
	require.NoError(t, err)
	res, err := idem.Consume(ctx, consumer, "", []string{key}, func(k string) string { return k },
		func(context.Context, string) error { return nil }, idem.WithFingerprints([][]byte{fp}))
	require.NoError(t, err)
	require.Equal(t, idem.MessageHandled, res[0].Status, "%v", res[0].Err)
	if expired {
		b.Advance(200 * time.Millisecond)
	}

	k, err := idem.NewRedis(b.Client)
	require.NoError(t, err)
	rec, err := k.Inspect(ctx, "", key)
	require.NoError(t, err)
	require.True(t, rec.Compact && rec.State == idem.StateCompleted, "not a marker: %+v", rec)
	out, err := k.Begin(ctx, "", key, idem.WithFingerprint(fp))
	require.Nil(t, out.Claim, "a marker was claimed")
	if expired {
		require.ErrorIs(t, err, idem.ErrResultExpired)
	} else {
		require.NoError(t, err)
		require.True(t, out.Replayed)
		require.Empty(t, out.Value)
	}
}

// TestKeyKnownOnlyByItsMarker: a key whose operation completed and whose
// response is not kept (only a marker is left, past the retention, or the
// key was completed with nothing to replay) is answered 410 with
// ProblemResultExpired; the handler does not run again.
func TestKeyKnownOnlyByItsMarker(t *testing.T) {
	for _, expired := range []bool{true, false} {
		t.Run(map[bool]string{true: "expired", false: "kept"}[expired], func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				req := func() *http.Request { return post("/payments", `{"amount":10}`, "Idempotency-Key", "k1") }
				markKey(t, b, req(), expired)
				k, err := idem.NewRedis(b.Client)
				require.NoError(t, err)
				mw, err := New(k)
				require.NoError(t, err)
				ran := false
				h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ran = true }))
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req())
				requireProblem(t, rec, http.StatusGone, ProblemResultExpired)
				assert.False(t, ran, "expired %v: the handler never runs again", expired)
			})
		})
	}
}
