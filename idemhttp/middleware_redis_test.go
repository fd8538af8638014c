package idemhttp

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMiddlewareRedis runs the middleware suite of TestMiddleware against
// real redis-server processes, one per test.
func TestMiddlewareRedis(t *testing.T) {
	redistest.Binary(t, "redis-server")
	suite(t, redistest.Real)
}

// BenchmarkMiddlewareReplayRedis measures a replayed request end to end on
// a local redis-server: one script round trip, decoding, writing.
func BenchmarkMiddlewareReplayRedis(b *testing.B) {
	s := redistest.Start(b)
	rs, err := idem.NewRedisStore(s.Client(b))
	require.NoError(b, err)
	bench(b, rs, true)
}

// BenchmarkMiddlewareFirstRequestRedis measures a first request end to end
// on a local redis-server: claim, handler, complete (two round trips).
func BenchmarkMiddlewareFirstRequestRedis(b *testing.B) {
	s := redistest.Start(b)
	rs, err := idem.NewRedisStore(s.Client(b))
	require.NoError(b, err)
	bench(b, &freshKeys{Store: rs}, false)
}

// mwFreshKeys gives every Claim a record id of its own, so that every
// request is a first one.
type freshKeys struct {
	idem.Store
	n atomic.Int64
}

func (s *freshKeys) Claim(ctx context.Context, id string, req idem.ClaimRequest) (idem.ClaimReply, error) {
	return s.Store.Claim(ctx, id+strconv.FormatInt(s.n.Add(1), 10), req)
}

func (s *freshKeys) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) error {
	return s.Store.Complete(ctx, id+strconv.FormatInt(s.n.Load(), 10), token, value, keep)
}

// TestRecordMemory reports the Redis memory of a stored response: a 201 with
// Content-Type and a 200-byte body (MEMORY USAGE: value, key and keyspace
// entry). The core's TestRecordMemory holds a bare result to 350 bytes; the
// status and headers make this one larger, so it is reported, not bounded.
func TestRecordMemory(t *testing.T) {
	b := redistest.Real(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	body := bytes.Repeat([]byte("x"), 200)
	mw, err := New(k)
	require.NoError(t, err)
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write(body)
	}))
	req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"amount":1000,"currency":"EUR"}`))
	req.Header.Set(DefaultKeyHeader, "http-1")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	require.Equal(t, http.StatusCreated, rec.Code)
	n, err := b.Client.MemoryUsage(ctx, recordKey(t, b, "", "http-1")).Result()
	require.NoError(t, err)
	assert.Less(t, n, int64(1024))
	t.Logf("201 with Content-Type and a 200-byte body: %d bytes", n)
}
