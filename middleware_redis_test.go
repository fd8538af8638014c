package idem

import (
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
)

// mwRedisServer is a redis-server started for the test; it skips the test
// without redis-server (fails it with IDEM_REQUIRE_REDIS=1).
func mwRedisServer(t *testing.T) *mwEnv {
	s := redistest.Start(t)
	return &mwEnv{client: mwClient(t, s.Addr), advance: time.Sleep, stop: s.Stop}
}

// TestMiddlewareRedis runs the middleware suite of TestMiddleware against
// real redis-server processes, one per test.
func TestMiddlewareRedis(t *testing.T) {
	redistest.Binary(t, "redis-server")
	mwSuite(t, mwRedisServer)
}
