package idemhttp

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestClusterHTTP guards requests on a 3-master Cluster: each key runs
// once, replays with every header value, and the records spread over every
// master.
func TestClusterHTTP(t *testing.T) {
	cc := redistest.StartCluster(t, 3, 0).Client(t, nil)
	k, err := idem.NewRedis(cc, idem.WithPrefix("http:"))
	require.NoError(t, err)
	mw, err := New(k)
	require.NoError(t, err)
	var runs atomic.Int32
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Add("X-Charge", "a")
		w.Header().Add("X-Charge", "b")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charged %s", r.Header.Get("Idempotency-Key"))
	}))
	do := func(key, body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	const keys = 20
	for i := 0; i < keys; i++ {
		key := fmt.Sprintf("pay-%d", i)
		first := do(key, "amount=10")
		require.Equal(t, http.StatusCreated, first.Code, "first %s: %q", key, first.Body.String())
		require.Equal(t, "charged "+key, first.Body.String(), "first %s", key)
		again := do(key, "amount=10")
		require.Equal(t, http.StatusCreated, again.Code, "replay %s: %q %v", key, again.Body.String(), again.Header())
		require.Equal(t, first.Body.String(), again.Body.String(), "replay %s: body", key)
		require.Equal(t, "true", again.Header().Get(ReplayedHeader), "replay %s: headers %v", key, again.Header())
		require.Equal(t, "a,b", strings.Join(again.Header().Values("X-Charge"), ","), "replay %s: headers %v", key, again.Header())
		other := do(key, "amount=99")
		require.Equal(t, http.StatusUnprocessableEntity, other.Code, "other body with %s", key)
	}
	assert.Equal(t, int32(keys), runs.Load(), "times the handler ran for %d keys", keys)
	var spread atomic.Int32
	err = cc.ForEachMaster(context.Background(), func(ctx context.Context, c *redis.Client) error {
		n, err := c.Keys(ctx, "http:*").Result()
		if len(n) > 0 {
			spread.Add(1)
		}
		return err
	})
	require.NoError(t, err)
	assert.Equal(t, int32(3), spread.Load(), "masters holding records")
}
