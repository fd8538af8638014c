package idemhttp

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// apiError is an error of a Stripe-shaped API, as its SDK parses it from
// {"error":{"type":...,"message":...}}.
type apiError struct {
	Status   int
	Type     string `json:"type"`
	Message  string `json:"message"`
	Replayed bool
}

func (e *apiError) Error() string { return fmt.Sprintf("%d %s: %s", e.Status, e.Type, e.Message) }

// writeStripeError renders the middleware's own answers as a Stripe-shaped
// API does (see ExampleWithErrorWriter): idempotency_error for a key in use
// or reused, api_error for a 5xx, Stripe-Should-Retry on 409, 422 and 503.
func writeStripeError(w http.ResponseWriter, r *http.Request, ref Refusal) {
	typ := "invalid_request_error"
	switch {
	case ref.Status == http.StatusConflict || ref.Status == http.StatusUnprocessableEntity:
		typ = "idempotency_error"
	case ref.Status >= 500:
		typ = "api_error"
	}
	switch ref.Status {
	case http.StatusConflict, http.StatusServiceUnavailable:
		w.Header().Set("Stripe-Should-Retry", "true")
	case http.StatusUnprocessableEntity:
		w.Header().Set("Stripe-Should-Retry", "false")
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(ref.Status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]string{"type": typ, "message": ref.Detail}})
}

// sdkClient sends requests as a Stripe-shaped SDK does: one
// Idempotency-Key for every attempt of a call, sent on POST and DELETE;
// after a network error, a 409 or a 5xx it sends the call again, up to
// maxRetries times, unless the answer says Stripe-Should-Retry: false; an
// error answer is parsed into an *apiError.
type sdkClient struct {
	http       *http.Client
	maxRetries int
}

// sdkAttempt is what one attempt of a call got.
type sdkAttempt struct {
	status   int
	body     string
	replayed bool
	err      error // a network error
}

// call sends method url with body under key; it returns the answer's
// status and body, or the last error (an *apiError for an error answer),
// and every attempt.
func (c *sdkClient) call(method, url, key, body string) (status int, out string, err error, attempts []sdkAttempt) {
	for range c.maxRetries + 1 {
		req, rerr := http.NewRequest(method, url, bytes.NewReader([]byte(body)))
		if rerr != nil {
			return 0, "", rerr, attempts
		}
		if method == http.MethodPost || method == http.MethodDelete {
			req.Header.Set(DefaultKeyHeader, key)
		}
		resp, derr := c.http.Do(req)
		if derr != nil {
			attempts = append(attempts, sdkAttempt{err: derr})
			err = derr
			continue
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		a := sdkAttempt{status: resp.StatusCode, body: string(b), replayed: resp.Header.Get(ReplayedHeader) == "true"}
		attempts = append(attempts, a)
		if resp.StatusCode < 400 {
			return a.status, a.body, nil, attempts
		}
		var e struct{ Error apiError }
		if json.Unmarshal(b, &e) != nil {
			e.Error = apiError{Type: "unparsed", Message: string(b)}
		}
		e.Error.Status, e.Error.Replayed = resp.StatusCode, a.replayed
		err = &e.Error
		retry := resp.StatusCode == http.StatusConflict || resp.StatusCode >= 500
		if should, perr := strconv.ParseBool(resp.Header.Get("Stripe-Should-Retry")); perr == nil {
			retry = should
		}
		if !retry {
			return a.status, a.body, err, attempts
		}
	}
	return 0, "", err, attempts
}

// A handler that marks its execution begun and then fails (a 500 of its
// own, or a panic) is run once, however often a Stripe-shaped SDK retries
// it: the first answer that reaches the client is the stored one, and
// every retry gets it again, replayed, as a typed error. A reused key is a
// typed idempotency_error, not retried.
func TestExecutionBeganRunsOnceThroughRetryingSDK(t *testing.T) {
	const retries = 5
	for _, failure := range []string{"500", "panic"} {
		t.Run(failure, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				k, err := idem.NewRedis(b.Client)
				require.NoError(t, err)
				guard, err := New(k, WithErrorWriter(writeStripeError))
				require.NoError(t, err)
				var charges atomic.Int64
				srv := quietServer(guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					assert.True(t, ExecutionBegan(r.Context()))
					charges.Add(1) // the card is charged
					if failure == "panic" {
						panic("the processor's answer could not be read")
					}
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(http.StatusInternalServerError)
					io.WriteString(w, `{"error":{"type":"api_error","message":"processor timeout"}}`)
				})))
				defer srv.Close()
				sdk := &sdkClient{http: srv.Client(), maxRetries: retries}

				_, _, err, attempts := sdk.call(http.MethodPost, srv.URL+"/v1/charges", "order-42", "amount=1000")
				var apiErr *apiError
				require.ErrorAs(t, err, &apiErr)
				assert.Equal(t, http.StatusInternalServerError, apiErr.Status)
				assert.Equal(t, "api_error", apiErr.Type)
				assert.Len(t, attempts, retries+1, "the SDK retried every 500")
				var first *sdkAttempt
				for i, a := range attempts {
					if a.err != nil {
						// Only a panic cuts an attempt off; Go's Transport may
						// resend it at once, which then gets the stored 500.
						assert.Equal(t, "panic", failure, "attempt %d: %v", i+1, a.err)
						assert.Nil(t, first, "attempt %d: only the first run is cut off", i+1)
						continue
					}
					assert.Equal(t, http.StatusInternalServerError, a.status, "attempt %d", i+1)
					if first == nil {
						first = &attempts[i]
						assert.Equal(t, failure == "panic", a.replayed, "attempt %d: the panic's 500 reaches the client only as a replay", i+1)
						continue
					}
					assert.True(t, a.replayed, "attempt %d is a replay", i+1)
					assert.Equal(t, first.body, a.body, "attempt %d: every retry gets the stored answer", i+1)
				}
				require.NotNil(t, first, "an answer reached the client")
				if failure == "panic" {
					assert.Contains(t, first.body, `"type":"api_error"`, "rendered by the error writer")
					assert.Contains(t, first.body, "began executing")
				}
				assert.EqualValues(t, 1, charges.Load(), "the handler ran once")

				// The key on another request: a typed idempotency_error, not retried.
				_, _, err, attempts = sdk.call(http.MethodPost, srv.URL+"/v1/charges", "order-42", "amount=9999")
				require.ErrorAs(t, err, &apiErr)
				assert.Equal(t, http.StatusUnprocessableEntity, apiErr.Status)
				assert.Equal(t, "idempotency_error", apiErr.Type)
				assert.Len(t, attempts, 1, "Stripe-Should-Retry: false")
				assert.EqualValues(t, 1, charges.Load())
			})
		})
	}
}
