package idemhttp

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A handler's 401, 403 or 407 says the request failed authentication: it is
// not the operation's answer, so it is released, never replayed, and the
// next request with the key runs the handler.
func TestAuthenticationFailureIsReleased(t *testing.T) {
	for _, status := range []int{http.StatusUnauthorized, http.StatusForbidden, http.StatusProxyAuthRequired} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				authorized := false
				g := newGuarded(t, b, nil, func(w http.ResponseWriter, r *http.Request) {
					if !authorized {
						w.WriteHeader(status)
						return
					}
					w.WriteHeader(http.StatusCreated)
					_, _ = io.WriteString(w, "paid")
				})

				refused := g.serve(post("/payments", "10 EUR", DefaultKeyHeader, "pay-1"))
				require.Equal(t, status, refused.Code, "body: %s", refused.Body)
				ev := g.next(t, idem.ResultReleased)
				assert.Equal(t, idem.StepRequest, ev.Step)
				assert.Equal(t, status, ev.Status)

				authorized = true
				paid := g.serve(post("/payments", "10 EUR", DefaultKeyHeader, "pay-1"))
				require.Equal(t, http.StatusCreated, paid.Code, "the next request with the key runs: body %s", paid.Body)
				assert.Empty(t, paid.Header().Get(ReplayedHeader), "the refusal is not replayed")
				assert.Equal(t, "paid", paid.Body.String())
				ev = g.next(t, idem.ResultClaimed)
				assert.Equal(t, 2, ev.Attempt, "the released key is claimed again")
				g.next(t, idem.ResultDone)

				again := g.serve(post("/payments", "10 EUR", DefaultKeyHeader, "pay-1"))
				assert.Equal(t, http.StatusCreated, again.Code)
				assert.Equal(t, "true", again.Header().Get(ReplayedHeader), "the success is stored")
				assert.Equal(t, int64(2), g.runs.Load(), "the handler ran for the refusal and the success, not for the replay")
			})
		})
	}
}

// The first version of a webhook receiver: the key is the provider's event
// id header, and the handler checks the signature. A forged delivery of an
// event (its id, another body, a bad signature) is answered 401 and
// released, so it cannot lock the event id: the genuine delivery that
// follows runs, and the provider's redelivery of it is a replay.
func TestWebhookForgedDeliveryDoesNotLockOutTheGenuineOne(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		secret := []byte("whsec_test")
		sign := func(body string) string {
			mac := hmac.New(sha256.New, secret)
			mac.Write([]byte(body))
			return hex.EncodeToString(mac.Sum(nil))
		}
		handled := map[string]int{}
		g := newGuarded(t, b, nil, func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			if !hmac.Equal([]byte(r.Header.Get("Stripe-Signature")), []byte(sign(string(body)))) {
				http.Error(w, "bad signature", http.StatusUnauthorized)
				return
			}
			handled[r.Header.Get("Stripe-Event-Id")]++
			w.WriteHeader(http.StatusOK)
		}, WithKeyHeader("Stripe-Event-Id"),
			WithScope(func(*http.Request) (string, error) { return "stripe", nil }))

		deliver := func(id, body, signature string) (int, bool) {
			rec := g.serve(post("/webhooks/stripe", body, "Stripe-Event-Id", id, "Stripe-Signature", signature))
			return rec.Code, rec.Header().Get(ReplayedHeader) == "true"
		}
		events := []string{"evt_1", "evt_2", "evt_3"}
		for _, id := range events {
			genuine := `{"id":"` + id + `","type":"checkout.session.completed"}`
			forged := `{"id":"` + id + `","type":"charge.refunded"}`

			code, replayed := deliver(id, forged, "forged")
			assert.Equal(t, http.StatusUnauthorized, code, "%s: forged", id)
			assert.False(t, replayed, "%s: forged", id)

			code, replayed = deliver(id, genuine, sign(genuine))
			assert.Equal(t, http.StatusOK, code, "%s: the genuine delivery runs", id)
			assert.False(t, replayed, "%s: the genuine delivery is not the forged one's replay", id)

			code, replayed = deliver(id, genuine, sign(genuine))
			assert.Equal(t, http.StatusOK, code, "%s: redelivered", id)
			assert.True(t, replayed, "%s: the redelivery is a replay", id)
		}
		for _, id := range events {
			assert.Equal(t, 1, handled[id], "%s handled once", id)
		}
		assert.Len(t, handled, len(events), "every event handled")
	})
}
