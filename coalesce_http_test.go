package idem_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A retry storm behind the HTTP middleware, with coalescing on: the other
// requests wait in the process, Redis sees one claim and one completion.
func TestCoalescingBehindTheMiddleware(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		cnt := &redistest.Counter{}
		b.Client.AddHook(cnt)
		k, err := idem.NewRedis(b.Client, idem.WithCoalescing(true))
		require.NoError(t, err)
		require.NoError(t, k.LoadScripts(context.Background()), "the scripts, and the prefix's record for k")
		mw, err := idemhttp.New(k, idemhttp.WithWait(time.Minute))
		require.NoError(t, err)
		const n = 30
		var runs atomic.Int32
		h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			idem.Eventually(t, "every other request waits", func() bool { return idem.Waiting(k) == n-1 })
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, `{"id":"pay_1"}`)
		}))
		before := cnt.RoundTrips()
		var wg sync.WaitGroup
		recs := make([]*httptest.ResponseRecorder, n)
		for i := range recs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"amount":1000}`))
				r.Header.Set(idemhttp.DefaultKeyHeader, "storm")
				recs[i] = httptest.NewRecorder()
				h.ServeHTTP(recs[i], r)
			}()
		}
		wg.Wait()
		assert.EqualValues(t, 1, runs.Load(), "the handler runs once")
		replayed := 0
		for _, rec := range recs {
			assert.Equal(t, http.StatusCreated, rec.Code)
			assert.Equal(t, `{"id":"pay_1"}`, rec.Body.String())
			if rec.Header().Get(idemhttp.ReplayedHeader) == "true" {
				replayed++
			}
		}
		assert.Equal(t, n-1, replayed)
		assert.EqualValues(t, 2, cnt.RoundTrips()-before, "Redis sees one claim and one completion")
	})
}
