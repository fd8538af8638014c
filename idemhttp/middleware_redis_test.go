package idemhttp

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
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

func (s *freshKeys) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (bool, error) {
	return s.Store.Complete(ctx, id+strconv.FormatInt(s.n.Load(), 10), token, value, keep)
}
