package idemhttp_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemkit/idem/idemhttp"
)

// A webhook receiver: the provider redelivers an event until it hears 2xx,
// so the same signed event can arrive twice. The key is the provider's event
// id, read from the body; the scope is the provider, so that the inbox holds
// (provider, event id). The order is fulfilled once.
func ExampleWithKeyFunc() {
	keeper, done := newKeeper()
	defer done()
	secret := []byte("whsec_example")
	sign := func(body string) string {
		mac := hmac.New(sha256.New, secret)
		mac.Write([]byte(body))
		return hex.EncodeToString(mac.Sum(nil))
	}

	guard, err := idemhttp.New(keeper,
		idemhttp.WithScope(func(r *http.Request) (string, error) { return "stripe", nil }),
		idemhttp.WithKeyFunc(func(r *http.Request, body []byte) (string, error) {
			if !hmac.Equal([]byte(r.Header.Get("Webhook-Signature")), []byte(sign(string(body)))) {
				return "", idemhttp.Refuse(http.StatusUnauthorized, "The webhook signature does not verify.")
			}
			var event struct {
				ID string `json:"id"`
			}
			if err := json.Unmarshal(body, &event); err != nil {
				return "", idemhttp.Refuse(http.StatusBadRequest, "The webhook body is not an event.")
			}
			return event.ID, nil
		}),
	)
	if err != nil {
		panic(err)
	}
	fulfilled := 0
	receiver := guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fulfilled++ // ship the order
		w.WriteHeader(http.StatusNoContent)
	}))

	deliver := func(body, signature string) {
		req := httptest.NewRequest(http.MethodPost, "/webhooks/stripe", strings.NewReader(body))
		req.Header.Set("Webhook-Signature", signature)
		rec := httptest.NewRecorder()
		receiver.ServeHTTP(rec, req)
		fmt.Println(rec.Code, "replayed:", rec.Header().Get(idemhttp.ReplayedHeader) == "true")
	}
	event := `{"id":"evt_1","type":"checkout.session.completed"}`
	deliver(event, sign(event)) // first delivery
	deliver(event, sign(event)) // redelivered
	deliver(event, "forged")
	fmt.Println("orders fulfilled:", fulfilled)
	// Output:
	// 204 replayed: false
	// 204 replayed: true
	// 401 replayed: false
	// orders fulfilled: 1
}
