package idemwatermill_test

import (
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// newMiniKeeper returns a Keeper on a miniredis of its own, stopped with
// the test, and that miniredis.
func newMiniKeeper(t testing.TB, opts ...idem.Option) (*idem.Keeper, *miniredis.Miniredis) {
	t.Helper()
	m := miniredis.RunT(t)
	k, err := idem.NewRedis(newRedisClient(t, m.Addr()), opts...)
	require.NoError(t, err)
	return k, m
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
