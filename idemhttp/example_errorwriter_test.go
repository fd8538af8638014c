package idemhttp_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"

	"github.com/idemkit/idem/idemhttp"
)

// stripeError is the error object of a Stripe-shaped API, as its SDKs
// parse it: {"error":{"type":...,"message":...}}.
type stripeError struct {
	Type    string `json:"type"`
	Message string `json:"message"`
}

// An API shaped like Stripe's answers the middleware's own refusals in its
// own error format, so that its clients' SDKs read them as they read its
// other errors: idempotency_error for a key in use or reused, and
// Stripe-Should-Retry to tell the SDK whether sending again can help (a key
// in use, a store away: yes; a reused key: never). Retry-After is on the
// answer already.
func ExampleWithErrorWriter() {
	writeStripeError := func(w http.ResponseWriter, r *http.Request, ref idemhttp.Refusal) {
		if ref.Type == idemhttp.ProblemBodyNotKept {
			idemhttp.WriteProblem(w, r, ref) // a replay, not an error: keep the default
			return
		}
		typ := "invalid_request_error"
		switch {
		case ref.Status == http.StatusConflict || ref.Status == http.StatusUnprocessableEntity || ref.Status == http.StatusGone:
			typ = "idempotency_error"
		case ref.Status >= 500:
			typ = "api_error"
		}
		retry := ref.Status == http.StatusConflict || ref.Status == http.StatusServiceUnavailable
		w.Header().Set("Stripe-Should-Retry", strconv.FormatBool(retry))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(ref.Status)
		_ = json.NewEncoder(w).Encode(map[string]stripeError{"error": {Type: typ, Message: ref.Detail}})
	}

	keeper, done := newKeeper()
	defer done()
	guard, err := idemhttp.New(keeper, idemhttp.WithErrorWriter(writeStripeError))
	if err != nil {
		panic(err)
	}
	charging, charged := make(chan struct{}), make(chan struct{})
	h := guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(charging) // the handler runs once
		<-charged
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":"ch_1"}`)
	}))
	send := func(body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("POST", "/v1/charges", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", "order-42")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	show := func(rec *httptest.ResponseRecorder) {
		fmt.Printf("%d Stripe-Should-Retry: %s, Retry-After: %q\n%s", rec.Code,
			rec.Header().Get("Stripe-Should-Retry"), rec.Header().Get("Retry-After"), rec.Body)
	}

	first := make(chan *httptest.ResponseRecorder)
	go func() { first <- send("amount=1000") }()
	<-charging
	show(send("amount=1000")) // a retry while the first is charging
	close(charged)
	fmt.Println((<-first).Code, "created")
	show(send("amount=9999")) // the key again, with another amount
	// Output:
	// 409 Stripe-Should-Retry: true, Retry-After: "1"
	// {"error":{"type":"idempotency_error","message":"A request with this Idempotency-Key is still being handled. Retry later to get its response."}}
	// 201 created
	// 422 Stripe-Should-Retry: false, Retry-After: ""
	// {"error":{"type":"idempotency_error","message":"This Idempotency-Key was first used with another request (another method, path or body). Send a new key for a new request."}}
}
