package redistest

import (
	"context"
	"github.com/idemkit/idem/internal/minitime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Backend is a Redis a suite runs against: an embedded miniredis or a
// redis-server started for the test.
type Backend struct {
	// Name is "miniredis" or "redis", for subtest names.
	Name string
	// Client reaches the backend; it is closed in the test's cleanup.
	Client *redis.Client
	// Advance moves Redis's clock (TIME and key expiry) forward by d: on
	// miniredis at once, on redis-server by sleeping.
	Advance func(d time.Duration)
	// Stop makes the server unreachable.
	Stop func()
	// Real is true for a redis-server process.
	Real bool
	// Mini is the embedded server; nil for a redis-server.
	Mini *miniredis.Miniredis
}

// Miniredis returns a Backend on an embedded miniredis whose clock stands
// still until Advance moves it; its TIME still answers one microsecond more
// at each call (internal/minitime), as a real clock does between two calls,
// so that a fencing token is never handed out twice.
func Miniredis(tb testing.TB) *Backend {
	m := miniredis.RunT(tb)
	now := time.Now()
	m.SetTime(now)
	mt := minitime.Install(m, now)
	c := NewClient(tb, m.Addr())
	c.AddHook(mt.Hook())
	return &Backend{
		Name:   "miniredis",
		Client: c,
		Advance: func(d time.Duration) {
			now = now.Add(d)
			m.SetTime(now) // TIME does not move with FastForward
			mt.Set(now)
			m.FastForward(d)
		},
		Stop: m.Close,
		Mini: m,
	}
}

// Real returns a Backend on a redis-server started for the test; like
// Start, it skips the test without redis-server (fails it when Required).
func Real(tb testing.TB) *Backend {
	s := Start(tb)
	return &Backend{
		Name:    "redis",
		Client:  NewClient(tb, s.Addr),
		Advance: time.Sleep,
		Stop:    s.Stop,
		Real:    true,
	}
}

// Each runs f as a subtest on miniredis and on a real redis-server.
func Each(t *testing.T, f func(t *testing.T, b *Backend)) {
	t.Run("miniredis", func(t *testing.T) { f(t, Miniredis(t)) })
	t.Run("redis", func(t *testing.T) { f(t, Real(t)) })
}

// NewClient returns a client of addr, closed in tb's cleanup, that gives up
// on an unreachable server sooner than go-redis's default: it retries and
// redials a few milliseconds apart.
func NewClient(tb testing.TB, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetryBackoff: 16 * time.Millisecond, DialerRetryTimeout: 5 * time.Millisecond})
	tb.Cleanup(func() { c.Close() })
	return c
}

// Counter is a go-redis hook that counts round trips (one per command sent
// alone, one per pipeline) and commands. The connection handshake (HELLO,
// CLIENT, AUTH, SELECT) is not counted. Add it with client.AddHook.
type Counter struct {
	roundTrips, commands atomic.Int64
	named                sync.Map // a command's name: *atomic.Int64, how many were sent
}

// Named returns how many commands called name (lower case, as go-redis
// names them: "xpending") were counted so far.
func (c *Counter) Named(name string) int64 {
	if n, ok := c.named.Load(name); ok {
		return n.(*atomic.Int64).Load()
	}
	return 0
}

// count adds cmd to the count of its name.
func (c *Counter) count(cmd redis.Cmder) {
	n, ok := c.named.Load(cmd.Name())
	if !ok {
		n, _ = c.named.LoadOrStore(cmd.Name(), new(atomic.Int64))
	}
	n.(*atomic.Int64).Add(1)
}

// RoundTrips returns the round trips counted so far.
func (c *Counter) RoundTrips() int64 { return c.roundTrips.Load() }

// Commands returns the commands counted so far.
func (c *Counter) Commands() int64 { return c.commands.Load() }

// Count returns how many round trips f made.
func (c *Counter) Count(f func()) int64 {
	before := c.roundTrips.Load()
	f()
	return c.roundTrips.Load() - before
}

// DialHook implements redis.Hook.
func (c *Counter) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (c *Counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !handshake(cmd) {
			c.roundTrips.Add(1)
			c.commands.Add(1)
			c.count(cmd)
		}
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook implements redis.Hook.
func (c *Counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) > 0 && !handshake(cmds[0]) {
			c.roundTrips.Add(1)
			c.commands.Add(int64(len(cmds)))
			for _, cmd := range cmds {
				c.count(cmd)
			}
		}
		return next(ctx, cmds)
	}
}

// handshake reports whether cmd is part of go-redis's connection set-up.
func handshake(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "client", "auth", "select":
		return true
	}
	return false
}
