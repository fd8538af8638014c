package idem

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
)

// mwRedisServer is a redis-server started for the test; it skips the test
// without redis-server (fails it with IDEM_REQUIRE_REDIS=1).
func mwRedisServer(t *testing.T) *mwEnv {
	return newRealRedis(t)
}

// TestMiddlewareRedis runs the middleware suite of TestMiddleware against
// real redis-server processes, one per test.
func TestMiddlewareRedis(t *testing.T) {
	redistest.Binary(t, "redis-server")
	mwSuite(t, mwRedisServer)
}

// BenchmarkMiddlewareReplayRedis measures a replayed request end to end on
// a local redis-server: one script round trip, decoding, writing.
func BenchmarkMiddlewareReplayRedis(b *testing.B) {
	s := redistest.Start(b)
	rs, err := NewRedisStore(s.Client(b))
	if err != nil {
		b.Fatal(err)
	}
	mwBench(b, rs, true)
}

// BenchmarkMiddlewareFirstRequestRedis measures a first request end to end
// on a local redis-server: claim, handler, complete (two round trips).
func BenchmarkMiddlewareFirstRequestRedis(b *testing.B) {
	s := redistest.Start(b)
	rs, err := NewRedisStore(s.Client(b))
	if err != nil {
		b.Fatal(err)
	}
	mwBench(b, &mwFreshKeys{Store: rs}, false)
}

// mwFreshKeys gives every Claim a record id of its own, so that every
// request is a first one.
type mwFreshKeys struct {
	Store
	n atomic.Int64
}

func (s *mwFreshKeys) Claim(ctx context.Context, id string, req ClaimRequest) (ClaimReply, error) {
	return s.Store.Claim(ctx, id+strconv.FormatInt(s.n.Add(1), 10), req)
}

func (s *mwFreshKeys) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) error {
	return s.Store.Complete(ctx, id+strconv.FormatInt(s.n.Load(), 10), token, value, keep)
}
