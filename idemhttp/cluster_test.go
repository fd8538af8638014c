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
	if err != nil {
		t.Fatal(err)
	}
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
		if first.Code != http.StatusCreated || first.Body.String() != "charged "+key {
			t.Fatalf("first %s: %d %q", key, first.Code, first.Body.String())
		}
		again := do(key, "amount=10")
		if again.Code != http.StatusCreated || again.Body.String() != first.Body.String() ||
			again.Header().Get(ReplayedHeader) != "true" || strings.Join(again.Header().Values("X-Charge"), ",") != "a,b" {
			t.Fatalf("replay %s: %d %q %v", key, again.Code, again.Body.String(), again.Header())
		}
		if other := do(key, "amount=99"); other.Code != http.StatusUnprocessableEntity {
			t.Fatalf("other body with %s: %d, want 422", key, other.Code)
		}
	}
	if runs.Load() != keys {
		t.Fatalf("handler ran %d times for %d keys", runs.Load(), keys)
	}
	var spread atomic.Int32
	err = cc.ForEachMaster(context.Background(), func(ctx context.Context, c *redis.Client) error {
		n, err := c.Keys(ctx, "http:*").Result()
		if len(n) > 0 {
			spread.Add(1)
		}
		return err
	})
	require.NoError(t, err)
	if spread.Load() != 3 {
		t.Fatalf("records on %d masters, want 3", spread.Load())
	}
}
