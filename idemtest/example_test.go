package idemtest_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemtest"
)

// exampleT stands in for the *testing.T that a test passes; examples have
// none. It runs its cleanups when finish is called, as a test does at its end.
type exampleT struct{ cleanups []func() }

func (t *exampleT) Helper()                           {}
func (t *exampleT) Logf(format string, args ...any)   {}
func (t *exampleT) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (t *exampleT) Cleanup(f func())                  { t.cleanups = append(t.cleanups, f) }

func (t *exampleT) finish() {
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}

// A worker claims a job and dies without completing it. The job stays in
// progress until its lease runs out; the test advances the clock past the
// lease instead of sleeping, and the retry takes the job over, told that an
// earlier attempt may have partly run.
func ExampleNew() {
	t := &exampleT{} // in a test: its t
	defer t.finish()
	ctx := context.Background()

	keeper, clock := idemtest.New(t, idem.WithLease(10*time.Second))

	crashed, _ := keeper.Begin(ctx, "acct", "job-1") // never completed nor released
	fmt.Println("attempt", crashed.Claim.Attempt(), "recovered", crashed.Claim.Recovered())

	_, err := keeper.Begin(ctx, "acct", "job-1")
	var ip *idem.InProgressError
	if errors.As(err, &ip) {
		fmt.Println("in progress, lease ends in", ip.RetryAfter)
	}

	clock.Advance(10*time.Second + time.Millisecond)
	retry, _ := keeper.Begin(ctx, "acct", "job-1")
	fmt.Println("attempt", retry.Claim.Attempt(), "recovered", retry.Claim.Recovered())
	fmt.Println("higher token:", retry.Claim.Token() > crashed.Claim.Token())
	fmt.Println("clock:", clock.Now().Format(time.RFC3339Nano))
	// Output:
	// attempt 1 recovered false
	// in progress, lease ends in 10s
	// attempt 2 recovered true
	// higher token: true
	// clock: 2025-01-01T00:00:10.001Z
}

// A guarded handler runs once, answers the retry with the stored response,
// and runs again once the retention has passed.
func ExampleHandler() {
	t := &exampleT{} // in a test: its t
	defer t.finish()

	charges := 0
	h, clock := idemtest.Handler(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		charges++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charge %d", charges)
	}))
	post := func() {
		req := httptest.NewRequest(http.MethodPost, "/payments", nil)
		req.Header.Set("Idempotency-Key", "order-42")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Println(rec.Code, rec.Body, "replayed:", rec.Header().Get("Idempotent-Replayed") == "true")
	}

	post()
	post()
	clock.Advance(idem.DefaultRetention + time.Millisecond)
	post()
	// Output:
	// 201 charge 1 replayed: false
	// 201 charge 1 replayed: true
	// 201 charge 2 replayed: false
}

// NewEnv gives the parts: Keeper options of the test's own, the miniredis
// under the Keeper, to look at or to break, and Env.Handler to guard a
// handler on that Keeper.
func ExampleNewEnv() {
	t := &exampleT{} // in a test: its t
	defer t.finish()

	env := idemtest.NewEnv(t, idem.WithPrefix("payments:"), idem.WithRetention(time.Hour))
	h := env.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusAccepted)
	}))
	post := func(key string) int {
		req := httptest.NewRequest(http.MethodPost, "/payments", nil)
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code
	}

	fmt.Println(post("a"))
	for _, key := range env.Redis.Keys() {
		// The records; beside them, payments:layout says how the prefix is
		// written.
		if strings.HasPrefix(key, "payments:{") {
			fmt.Println(key[:len("payments:{")], env.Redis.TTL(key))
		}
	}

	env.SetError("LOADING Redis is loading the dataset in memory")
	fmt.Println(post("b"))
	env.SetError("")
	fmt.Println(post("b"))
	// Output:
	// 202
	// payments:{ 1h0m0s
	// 503
	// 202
}
