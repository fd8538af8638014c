package idemhttp_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/redis/go-redis/v9"
)

// A payments endpoint guarded by the middleware: the retried request is
// answered with the first response, and the card is charged once.
func ExampleNew() {
	keeper, done := newKeeper() // any Redis; miniredis keeps the example self-contained
	defer done()
	guard, err := idemhttp.New(keeper)
	if err != nil {
		panic(err)
	}

	charges := 0
	mux := http.NewServeMux()
	mux.Handle("POST /payments", guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		claim, _ := idem.ClaimFromContext(r.Context())
		charges++ // charge the card, passing claim.Token() on as a fencing token
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":"ch_%d","attempt":%d}`, charges, claim.Attempt())
	})))

	for range 2 {
		req := httptest.NewRequest("POST", "/payments", strings.NewReader(`{"amount":1000}`))
		req.Header.Set("Idempotency-Key", "order-42")
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		fmt.Println(rec.Code, rec.Body, "replayed:", rec.Header().Get("Idempotent-Replayed") == "true")
	}

	// The same key with another body is a client error, not a replay.
	req := httptest.NewRequest("POST", "/payments", strings.NewReader(`{"amount":9999}`))
	req.Header.Set("Idempotency-Key", "order-42")
	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, req)
	fmt.Println(rec.Code, rec.Header().Get("Content-Type"))
	fmt.Println("charges:", charges)
	// Output:
	// 201 {"charge":"ch_1","attempt":1} replayed: false
	// 201 {"charge":"ch_1","attempt":1} replayed: true
	// 422 application/problem+json
	// charges: 1
}

// Count the middleware's outcomes for metrics: the Keeper's Observer is told
// of every request (idem.StepRequest) and of the Keeper's own steps.
func ExampleNew_observer() {
	var mu sync.Mutex
	counts := map[string]int{}
	keeper, done := newKeeper(idem.WithObserver(idem.ObserverFunc(func(_ context.Context, ev idem.Event) {
		mu.Lock()
		defer mu.Unlock()
		counts[ev.Step.String()+" "+ev.Result.String()]++
	})))
	defer done()

	guard, err := idemhttp.New(keeper)
	if err != nil {
		panic(err)
	}
	h := guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusAccepted)
	}))
	for _, key := range []string{"a", "a", "b", ""} {
		req := httptest.NewRequest("POST", "/jobs", nil)
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	for _, name := range []string{"claim claimed", "claim replayed", "complete done", "request done", "request replayed", "request invalid"} {
		fmt.Printf("%s: %d\n", name, counts[name])
	}
	// Output:
	// claim claimed: 2
	// claim replayed: 1
	// complete done: 2
	// request done: 2
	// request replayed: 1
	// request invalid: 1
}

// newKeeper returns a Keeper with opts on an embedded miniredis, and a
// function that stops both.
func newKeeper(opts ...idem.Option) (*idem.Keeper, func()) {
	m := miniredis.NewMiniRedis()
	if err := m.Start(); err != nil {
		panic(err)
	}
	client := redis.NewClient(&redis.Options{Addr: m.Addr()})
	keeper, err := idem.NewRedis(client, opts...)
	if err != nil {
		panic(err)
	}
	return keeper, func() { client.Close(); m.Close() }
}

// A handler asks the middleware what it guards the request under: the
// tenant its scope function named and the key, to pass on to a downstream
// API's own idempotency, say.
func ExampleRequestKey() {
	keeper, done := newKeeper()
	defer done()
	guard, err := idemhttp.New(keeper, idemhttp.WithScope(func(r *http.Request) (string, error) {
		return r.Header.Get("X-Account"), nil
	}))
	if err != nil {
		panic(err)
	}
	h := guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant, key, ok := idemhttp.RequestKey(r)
		fmt.Printf("tenant %q, key %q, guarded %v\n", tenant, key, ok)
		w.WriteHeader(http.StatusCreated)
	}))

	req := httptest.NewRequest("POST", "/payments", strings.NewReader(`{"amount":1000}`))
	req.Header.Set("Idempotency-Key", "order-42")
	req.Header.Set("X-Account", "acme")
	h.ServeHTTP(httptest.NewRecorder(), req)
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/payments", nil)) // not guarded
	// Output:
	// tenant "acme", key "order-42", guarded true
	// tenant "", key "", guarded false
}
