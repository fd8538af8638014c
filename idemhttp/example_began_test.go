package idemhttp_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemkit/idem/idemhttp"
)

// A payments handler marks its execution begun once the request is valid,
// just before it sends the charge. With SuccessStorePolicy (Stripe's
// rule), a request that failed validation leaves its key free for the
// corrected request; a failure after the charge was sent (the processor
// timed out) is stored, and its retry is answered without charging again.
func ExampleExecutionBegan() {
	keeper, done := newKeeper()
	defer done()
	guard, err := idemhttp.New(keeper, idemhttp.WithStorePolicy(idemhttp.SuccessStorePolicy))
	if err != nil {
		panic(err)
	}
	charges := 0
	h := guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Amount int }
		if json.NewDecoder(r.Body).Decode(&req) != nil || req.Amount <= 0 {
			http.Error(w, "amount must be positive", http.StatusBadRequest) // released: nothing happened
			return
		}
		idemhttp.ExecutionBegan(r.Context()) // from here on, whatever is answered is kept
		charges++                            // send the charge
		if req.Amount > 5000 {
			http.Error(w, "the processor did not answer in time", http.StatusBadGateway) // stored
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "ch_%d\n", charges)
	}))
	send := func(key, body string) {
		req := httptest.NewRequest("POST", "/payments", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Printf("%s %d replayed=%t %s", key, rec.Code, rec.Header().Get("Idempotent-Replayed") == "true", rec.Body)
	}

	send("order-1", `{"amount":-5}`)  // fails validation
	send("order-1", `{"amount":500}`) // corrected, under the same key
	send("order-2", `{"amount":9000}`)
	send("order-2", `{"amount":9000}`) // the client retries the 502
	fmt.Println("charges:", charges)
	// Output:
	// order-1 400 replayed=false amount must be positive
	// order-1 201 replayed=false ch_1
	// order-2 502 replayed=false the processor did not answer in time
	// order-2 502 replayed=true the processor did not answer in time
	// charges: 2
}
