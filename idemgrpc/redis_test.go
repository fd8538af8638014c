package idemgrpc_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// backend is a Redis the tests run against: an embedded miniredis or a
// redis-server started for the test.
type backend struct {
	name   string
	client *redis.Client
	// mini is the embedded server, to break on purpose; nil for redis-server.
	mini *miniredis.Miniredis
}

// eachBackend runs f as a subtest on miniredis and on a real redis-server.
func eachBackend(t *testing.T, f func(t *testing.T, b *backend)) {
	t.Run("miniredis", func(t *testing.T) {
		m := miniredis.RunT(t)
		f(t, &backend{name: "miniredis", client: newRedisClient(t, m.Addr()), mini: m})
	})
	t.Run("redis", func(t *testing.T) {
		f(t, &backend{name: "redis", client: newRedisClient(t, startRedis(t))})
	})
}

// keeper returns a Keeper on the backend.
func (b *backend) keeper(t testing.TB, opts ...idem.Option) *idem.Keeper {
	t.Helper()
	k, err := idem.NewRedis(b.client, opts...)
	require.NoError(t, err)
	return k
}

// countCommands counts the commands c sends from now on, pipelined ones
// included.
func countCommands(c *redis.Client) *atomic.Int64 {
	n := new(atomic.Int64)
	c.AddHook(commandCounter{n})
	return n
}

type commandCounter struct{ n *atomic.Int64 }

func (h commandCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h commandCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}

func (h commandCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}

// newMiniKeeper returns a Keeper on a miniredis of its own, for tests that
// need no real server.
func newMiniKeeper(t testing.TB, opts ...idem.Option) (*idem.Keeper, *miniredis.Miniredis) {
	m := miniredis.RunT(t)
	b := &backend{name: "miniredis", client: newRedisClient(t, m.Addr()), mini: m}
	return b.keeper(t, opts...), m
}

// newRedisClient returns a client of addr, closed with the test, that gives
// up on an unreachable server within milliseconds.
func newRedisClient(t testing.TB, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{
		Addr: addr, MaxRetries: 1, DialTimeout: time.Second,
		MaxRetryBackoff: 16 * time.Millisecond, DialerRetryTimeout: 5 * time.Millisecond,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

// startRedis starts redis-server for the test (internal/redistest: a free
// loopback port, a temporary directory, stopped with the test and killed
// with the test binary) and returns its address. Without redis-server on
// PATH the test is skipped, or fails when IDEM_REQUIRE_REDIS=1.
func startRedis(t testing.TB) string {
	t.Helper()
	return redistest.Start(t).Addr
}
