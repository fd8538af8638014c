package idemgrpc_test

import (
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// The tests run on the root's test backends (internal/redistest): an
// embedded miniredis and a redis-server started for the test, stopped with
// it; without redis-server on PATH the real half is skipped, or fails when
// IDEM_REQUIRE_REDIS=1.

// newKeeper returns a Keeper on c.
func newKeeper(t testing.TB, c *redis.Client, opts ...idem.Option) *idem.Keeper {
	t.Helper()
	k, err := idem.NewRedis(c, opts...)
	require.NoError(t, err)
	return k
}

// countCommands counts the commands c sends from now on, pipelined ones
// included (internal/redistest's Counter).
func countCommands(c *redis.Client) *redistest.Counter {
	n := &redistest.Counter{}
	c.AddHook(n)
	return n
}

// newMiniKeeper returns a Keeper on a miniredis of its own, for tests that
// need no real server.
func newMiniKeeper(t testing.TB, opts ...idem.Option) (*idem.Keeper, *miniredis.Miniredis) {
	m := miniredis.RunT(t)
	return newKeeper(t, redistest.NewClient(t, m.Addr()), opts...), m
}
