package idemhttp

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestTransportRunsAHandlersOwnConflictOnce: a handler that answers 409 or
// 429 itself (an order already shipped, a rate limit of its own) is run once
// through a Transport: the middleware does not keep those answers, so a
// retry would run the handler again; the Transport returns them at once.
// The middleware's own 409 (another request with the key in progress) is
// still retried, and answered by the first request's response.
func TestTransportRunsAHandlersOwnConflictOnce(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, err := idem.NewRedis(b.Client, idem.WithLease(time.Minute))
		require.NoError(t, err)
		guard, err := New(k)
		require.NoError(t, err)
		var runs atomic.Int32
		release := make(chan struct{})
		srv := httptest.NewServer(guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			switch r.URL.Path {
			case "/conflict":
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(http.StatusConflict)
				_, _ = io.WriteString(w, `{"error":"order already shipped"}`)
			case "/limited":
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(http.StatusTooManyRequests)
			case "/slow":
				<-release
				w.WriteHeader(http.StatusCreated)
			}
		})))
		t.Cleanup(srv.Close)
		seen409 := make(chan struct{}, 100)
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			resp, err := http.DefaultTransport.RoundTrip(r)
			if err == nil && resp.StatusCode == http.StatusConflict {
				seen409 <- struct{}{}
			}
			return resp, err
		})
		client := &http.Client{Transport: &Transport{Base: base, Backoff: time.Millisecond, MaxAttempts: 1000}}

		for _, path := range []string{"/conflict", "/limited"} {
			runs.Store(0)
			resp, err := client.Post(srv.URL+path, "application/json", strings.NewReader("{}"))
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, 1, Attempts(resp), path)
			assert.Equal(t, int32(1), runs.Load(), "%s: the handler ran again for the Transport's retries", path)
		}

		// The middleware's own 409: a second copy of a request in progress
		// is retried until the first one's response is stored.
		runs.Store(0)
		req := func() (*http.Response, error) {
			r, _ := http.NewRequest(http.MethodPost, srv.URL+"/slow", strings.NewReader("{}"))
			r.Header.Set(DefaultKeyHeader, "slow-1")
			return client.Do(r)
		}
		first := make(chan *http.Response, 1)
		go func() {
			resp, err := req()
			assert.NoError(t, err)
			first <- resp
		}()
		for end := time.Now().Add(10 * time.Second); runs.Load() == 0; time.Sleep(time.Millisecond) {
			require.True(t, time.Now().Before(end), "the first request never ran")
		}
		for len(seen409) > 0 {
			<-seen409
		}
		second := make(chan *http.Response, 1)
		go func() {
			resp, err := req()
			assert.NoError(t, err)
			second <- resp
		}()
		select {
		case <-seen409: // the second copy met the middleware's 409
		case <-time.After(10 * time.Second):
			require.Fail(t, "the second copy never got the middleware's 409")
		}
		close(release)
		r1, r2 := <-first, <-second
		require.NotNil(t, r1)
		require.NotNil(t, r2)
		assert.Equal(t, http.StatusCreated, r1.StatusCode)
		assert.Equal(t, http.StatusCreated, r2.StatusCode, "the retried copy gets the first one's response")
		assert.GreaterOrEqual(t, Attempts(r2), 2, "the middleware's 409 was retried")
		assert.True(t, Replayed(r2))
		assert.Equal(t, int32(1), runs.Load())
	})
}

// roundTripFunc is a function that is an http.RoundTripper.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
