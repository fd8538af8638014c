package idem

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// backend is a Redis the core suite runs against.
type backend struct {
	name   string
	client *redis.Client
	// advance moves Redis's clock (TIME and key expiry) forward by d.
	advance func(d time.Duration)
	// stop makes the server unreachable.
	stop func()
	// real is true for a redis-server process.
	real bool
}

// newMiniredis returns a backend on an embedded miniredis whose clock stands
// still until advance moves it.
func newMiniredis(t testing.TB) *backend {
	m := miniredis.RunT(t)
	now := time.Now()
	m.SetTime(now)
	return &backend{
		name:   "miniredis",
		client: testClient(t, m.Addr()),
		advance: func(d time.Duration) {
			now = now.Add(d)
			m.SetTime(now)
			m.FastForward(d)
		},
		stop: m.Close,
	}
}

// newRealRedis returns a backend on a redis-server started for the test; it
// skips the test without redis-server (fails it with IDEM_REQUIRE_REDIS=1).
func newRealRedis(t testing.TB) *backend {
	s := redistest.Start(t)
	return &backend{
		name:    "redis",
		client:  testClient(t, s.Addr),
		advance: time.Sleep,
		stop:    s.Stop,
		real:    true,
	}
}

// testClient is a client of addr that gives up on an unreachable server
// sooner than the default: retries and redials a few milliseconds apart.
func testClient(t testing.TB, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetryBackoff: 16 * time.Millisecond, DialerRetryTimeout: 5 * time.Millisecond})
	t.Cleanup(func() { c.Close() })
	return c
}

// eachBackend runs f as a subtest on miniredis and on a real redis-server.
func eachBackend(t *testing.T, f func(t *testing.T, b *backend)) {
	t.Run("miniredis", func(t *testing.T) { f(t, newMiniredis(t)) })
	t.Run("redis", func(t *testing.T) { f(t, newRealRedis(t)) })
}

// newKeeper returns a Keeper on b's client.
func newKeeper(t testing.TB, b *backend, opts ...Option) *Keeper {
	t.Helper()
	k, err := NewRedis(b.client, opts...)
	if err != nil {
		t.Fatalf("NewRedis: %v", err)
	}
	return k
}

// counter is a go-redis hook that counts round trips: one per command sent
// alone, one per pipeline.
type counter struct{ n atomic.Int64 }

func (c *counter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

func (c *counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmds)
	}
}

// roundTrips returns how many round trips f made on c.
func (c *counter) roundTrips(f func()) int64 {
	before := c.n.Load()
	f()
	return c.n.Load() - before
}

// quietLogger drops go-redis's own log lines (dial failures in the
// unavailability tests), which the tests assert on as errors instead.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

func init() { redis.SetLogger(quietLogger{}) }
