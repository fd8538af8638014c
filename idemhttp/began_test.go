package idemhttp

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A handler that marks its execution begun and then answers an error has
// its answer stored, whatever its status and whatever the store policy:
// every retry gets it replayed, and the handler runs once. Before
// ExecutionBegan, the same status releases the key as the policy says.
func TestExecutionBeganStoresEveryStatus(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		for _, status := range []int{500, 503, 401, 409, 429, 402} {
			for _, began := range []bool{true, false} {
				t.Run(fmt.Sprintf("%d began=%t", status, began), func(t *testing.T) {
					g := newGuarded(t, b, nil, func(w http.ResponseWriter, r *http.Request) {
						if began {
							assert.True(t, ExecutionBegan(r.Context()), "a guarded request")
						}
						w.Header().Set("Content-Type", "application/json")
						w.WriteHeader(status)
						io.WriteString(w, `{"error":"card_declined"}`)
					})
					key := fmt.Sprintf("k-%d-%t", status, began)
					rec := g.serve(postKey(key, "a"))
					require.Equal(t, status, rec.Code)
					stored := began || DefaultStorePolicy(status)
					if stored {
						assert.Equal(t, status, g.next(t, idem.ResultDone).Status)
					} else {
						assert.Equal(t, status, g.next(t, idem.ResultReleased).Status)
					}
					for i := range 5 {
						rec := g.serve(postKey(key, "a"))
						assert.Equal(t, status, rec.Code, "retry %d", i+1)
						assert.Equal(t, `{"error":"card_declined"}`, rec.Body.String(), "retry %d", i+1)
						assert.Equal(t, "application/json", rec.Header().Get("Content-Type"), "retry %d", i+1)
						if stored {
							assert.Equal(t, "true", rec.Header().Get(ReplayedHeader), "retry %d", i+1)
						} else {
							assert.Empty(t, rec.Header().Get(ReplayedHeader), "retry %d", i+1)
						}
					}
					if stored {
						assert.EqualValues(t, 1, g.runs.Load(), "the handler runs once")
					} else {
						assert.EqualValues(t, 6, g.runs.Load(), "a released key runs every retry")
					}
				})
			}
		}
	})
}

// A 5xx stored after ExecutionBegan is kept for the Keeper's retention,
// as a success is: its side effect happened. A 4xx is kept for the error
// retention, as before.
func TestExecutionBeganRetention(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, idem.WithErrorRetention(idem.DefaultLease))
		a := newApp(t, b, k, func(run int64, w http.ResponseWriter, r *http.Request) {
			ExecutionBegan(r.Context())
			status := 500
			if r.URL.Path == "/402" {
				status = 402
			}
			w.WriteHeader(status)
		})
		for _, tc := range []struct {
			path    string
			longest time.Duration
			least   time.Duration
		}{
			{"/500", idem.DefaultRetention, idem.DefaultLease + 1},
			{"/402", idem.DefaultLease, 1},
		} {
			a.do(request(http.MethodPost, tc.path, "", DefaultKeyHeader, "k"+tc.path))
			d, err := b.Client.PTTL(context.Background(), recordKey(t, b, "", "k"+tc.path)).Result()
			require.NoError(t, err)
			assert.True(t, d >= tc.least && d <= tc.longest, "%s kept for %s", tc.path, d)
		}
	})
}

// A handler that panics after ExecutionBegan stores a 500 of the
// middleware's own, then the panic goes on; every retry gets the 500, and
// the handler runs once. Before ExecutionBegan, a panic releases the key.
func TestExecutionBeganPanicStoresA500(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		g := newGuarded(t, b, nil, func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Query().Get("began") == "1" {
				ExecutionBegan(r.Context())
			}
			w.Header().Set("X-Partial", "yes")
			panic("charge failed")
		})
		serve := func(target, key string) (rec *httptest.ResponseRecorder, got any) {
			defer func() { got = recover() }()
			return g.serve(request(http.MethodPost, target, "a", DefaultKeyHeader, key)), nil
		}

		_, got := serve("/pay?began=1", "k1")
		assert.Equal(t, "charge failed", got, "the panic goes on once the 500 is stored")
		ev := g.next(t, idem.ResultDone)
		assert.Equal(t, http.StatusInternalServerError, ev.Status)
		assert.ErrorIs(t, ev.Err, errPanickedAfterBegan)
		for i := range 5 {
			rec, got := serve("/pay?began=1", "k1")
			require.Nil(t, got, "retry %d: the handler does not run again", i+1)
			p := requireProblem(t, rec, http.StatusInternalServerError, ProblemExecutionFailed)
			assert.Contains(t, p.Detail, "Idempotency-Key")
			assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
			assert.Empty(t, rec.Header().Get("X-Partial"), "what the handler set before it panicked is not its answer")
		}
		assert.EqualValues(t, 1, g.runs.Load())

		// Without ExecutionBegan, as before: released, and run again.
		for i := range 2 {
			_, got := serve("/pay", "k2")
			assert.Equal(t, "charge failed", got)
			assert.ErrorIs(t, g.next(t, idem.ResultReleased).Err, errPanicked, "run %d", i+1)
		}
		assert.EqualValues(t, 3, g.runs.Load())
	})
}

// A handler that began and then returns without an answer after its
// client went away stores the 500 of the middleware's own, not a 200 with
// nothing; one that wrote a status stores it.
func TestExecutionBeganClientGone(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		for _, tc := range []struct {
			name   string
			write  int // 0: nothing
			status int
			typ    string
		}{
			{"nothing written", 0, 500, ProblemExecutionFailed},
			{"503 written", 503, 503, ""},
			{"201 written", 201, 201, ""},
		} {
			t.Run(tc.name, func(t *testing.T) {
				g := newGuarded(t, b, nil, func(w http.ResponseWriter, r *http.Request) {
					ExecutionBegan(r.Context())
					cancelOf(r)()
					<-r.Context().Done()
					if tc.write != 0 {
						w.WriteHeader(tc.write)
					}
				})
				key := "gone-" + tc.name
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				g.serve(postKey(key, "a").WithContext(context.WithValue(ctx, cancelKey{}, cancel)))
				ev := g.next(t, idem.ResultDone)
				assert.Equal(t, tc.status, ev.Status)
				if tc.typ != "" {
					assert.ErrorIs(t, ev.Err, errGaveUpAfterBegan)
				}

				rec := g.serve(postKey(key, "a"))
				assert.Equal(t, tc.status, rec.Code)
				assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
				if tc.typ != "" {
					requireProblem(t, rec, tc.status, tc.typ)
				}
				assert.EqualValues(t, 1, g.runs.Load())
			})
		}
	})
}

// cancelKey holds the cancel function of a test request's context.
type cancelKey struct{}

// cancelOf returns the cancel function a test put in r's context.
func cancelOf(r *http.Request) context.CancelFunc {
	return r.Context().Value(cancelKey{}).(context.CancelFunc)
}

// ExecutionBegan reports false, and does nothing, where no request is
// guarded: a method the middleware does not guard, a request let through
// without a key, a handler run fail-open, a bare context.
func TestExecutionBeganOutsideAClaim(t *testing.T) {
	assert.False(t, ExecutionBegan(context.Background()))
	b := redistest.Miniredis(t)
	var inside atomic.Int64
	h := func(w http.ResponseWriter, r *http.Request) {
		if ExecutionBegan(r.Context()) {
			inside.Add(1)
		}
		w.WriteHeader(http.StatusInternalServerError)
	}
	g := newGuarded(t, b, nil, h, WithKeyRequired(false))
	g.serve(request(http.MethodPut, "/x", "a", DefaultKeyHeader, "k1"))
	g.serve(request(http.MethodPost, "/x", "a"))
	assert.Zero(t, inside.Load())

	open := newGuarded(t, b, nil, h, WithFailOpen(true))
	b.Stop()
	rec := open.serve(postKey("k1", "a"))
	assert.Equal(t, http.StatusInternalServerError, rec.Code)
	open.next(t, idem.ResultFailOpen)
	assert.Zero(t, inside.Load())
}

// Stripe's rule (SuccessStorePolicy): a request that fails validation
// before ExecutionBegan leaves its key free, so the corrected request runs
// under it; under the default policy its 400 is stored and the corrected
// request answers 422. A failure after ExecutionBegan is stored under both.
func TestSuccessStorePolicyFreesAKeyThatFailedValidation(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		charge := func(charges *atomic.Int64) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				body, _ := io.ReadAll(r.Body)
				var req struct{ Amount int }
				if json.Unmarshal(body, &req) != nil || req.Amount <= 0 {
					w.WriteHeader(http.StatusBadRequest)
					return
				}
				ExecutionBegan(r.Context())
				n := charges.Add(1)
				if req.Amount > 1000 {
					w.WriteHeader(http.StatusPaymentRequired) // declined
					return
				}
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, "ch_%d", n)
			}
		}
		for _, tc := range []struct {
			name      string
			opts      []Option
			corrected int
		}{
			{"default policy", nil, http.StatusUnprocessableEntity},
			{"SuccessStorePolicy", []Option{WithStorePolicy(SuccessStorePolicy)}, http.StatusCreated},
		} {
			t.Run(tc.name, func(t *testing.T) {
				var charges atomic.Int64
				g := newGuarded(t, b, nil, charge(&charges), tc.opts...)
				key := "order-" + tc.name
				require.Equal(t, http.StatusBadRequest, g.serve(postKey(key, `{"amount":-1}`)).Code)
				assert.Equal(t, tc.corrected, g.serve(postKey(key, `{"amount":100}`)).Code)

				declined := "declined-" + tc.name
				for i := range 3 {
					rec := g.serve(postKey(declined, `{"amount":5000}`))
					assert.Equal(t, http.StatusPaymentRequired, rec.Code)
					assert.Equal(t, i > 0, rec.Header().Get(ReplayedHeader) == "true", "attempt %d", i+1)
				}
				wantCharges := int64(1) // the decline
				if tc.corrected == http.StatusCreated {
					wantCharges++
				}
				assert.Equal(t, wantCharges, charges.Load())
			})
		}
	})
}

func TestSuccessStorePolicy(t *testing.T) {
	for status := 100; status < 600; status++ {
		assert.Equal(t, status >= 200 && status < 400, SuccessStorePolicy(status), "%d", status)
	}
}

// ExecutionBegan counts from a context made from the handler's, in another
// goroutine; that context still carries the claim and ends with the
// request's.
func TestExecutionBeganFromADerivedContext(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		g := newGuarded(t, b, nil, func(w http.ResponseWriter, r *http.Request) {
			ctx, cancel := context.WithTimeout(r.Context(), time.Minute)
			defer cancel()
			_, claimed := idem.ClaimFromContext(ctx)
			assert.True(t, claimed, "the claim is in the handler's context")
			done := make(chan bool)
			go func() { done <- ExecutionBegan(ctx) }()
			assert.True(t, <-done)
			w.WriteHeader(http.StatusBadGateway)
		})
		assert.Equal(t, http.StatusBadGateway, g.serve(postKey("k1", "a")).Code)
		rec := g.serve(postKey("k1", "a"))
		assert.Equal(t, http.StatusBadGateway, rec.Code)
		assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
		assert.EqualValues(t, 1, g.runs.Load())
	})
}
