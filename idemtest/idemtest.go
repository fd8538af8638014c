// Package idemtest runs idem in tests: a Keeper on an embedded Redis
// (miniredis) and a Clock that moves the Keeper's clock and Redis's together,
// so that leases and retention run out without sleeping.
//
//	func TestRetry(t *testing.T) {
//		keeper, clock := idemtest.New(t) // lease 30s, retention 24h
//		first, _ := keeper.Begin(t.Context(), "acct", "job-1") // attempt 1; its worker dies
//		_, err := keeper.Begin(t.Context(), "acct", "job-1")   // idem.ErrInProgress
//		clock.Advance(idem.DefaultLease + time.Millisecond)
//		retry, _ := keeper.Begin(t.Context(), "acct", "job-1") // Recovered(), attempt 2
//		...
//		clock.Advance(idem.DefaultRetention + time.Millisecond) // every record expires
//	}
//
// Handler does the same for an http.Handler guarded by idemhttp. NewEnv
// returns every part (the miniredis to look at or break, the go-redis client);
// Env.Handler guards a handler on a Keeper made with options of your own. The
// test's cleanup closes everything.
//
// The Clock starts at 2025-01-01T00:00:00Z and moves only with Advance.
// Whatever runs on real timers does not move with it: Do and Claim.KeepAlive
// renew a lease every third of the lease of real time (with the default lease
// of 30s (idem.DefaultLease), never for a Do that runs less than 10s), so a
// Do still running when the test advances past its lease learns that it lost
// the key only at its next renewal or when it stores its result (see
// Clock.Advance). And WithWait measures its wait on the Clock: a wait ends
// when the other attempt does, when its context ends, or when the test
// advances past it.
package idemtest

import (
	"net/http"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/minitime"
	"github.com/redis/go-redis/v9"
)

// TB is the part of testing.TB that idemtest uses: *testing.T, *testing.B,
// *testing.F and testing.TB all satisfy it. Fatalf is called only from the
// goroutine that called New, NewEnv, Handler or Env.Handler, when the
// environment cannot be built; Cleanup closes the client and the server.
type TB interface {
	Helper()
	Logf(format string, args ...any)
	Fatalf(format string, args ...any)
	Cleanup(func())
}

// start is where every Clock starts: a fixed instant, so that what a test
// derives from the time (fencing tokens, which are Redis's clock in
// microseconds for a new key; lease ends) is the same on every run.
var start = time.Date(2025, time.January, 1, 0, 0, 0, 0, time.UTC)

// Env is a Keeper on an embedded Redis, with its parts. The fields are set by
// NewEnv and must not be replaced.
type Env struct {
	// Keeper runs on Redis, through Client, and reads Clock.Now as its clock.
	Keeper *idem.Keeper
	// Clock is the time of both the Keeper and Redis; Advance moves them.
	Clock *Clock
	// Redis is the embedded server, to look at (Redis.Keys, Redis.TTL,
	// Redis.Get; beside the records, whose keys hold a '{', prefix +
	// "layout" says how they are written) or to break: Env.SetError makes
	// every command answer an error reply (idem.ErrUnavailable, 503 from
	// idemhttp); Redis.Set on a record's key (see Redis.Keys) puts a value there that is not a record
	// (idem.ErrCorrupt, 500); Redis.Close makes it unreachable for good
	// (idem.ErrUnavailable, after about 0.1s of redialling). Do not call its
	// SetTime, FastForward or ClockTTL: Clock.Advance moves its time. Its
	// own SetError works too, but replaces the hook that keeps its TIME
	// increasing (see Clock), which the next command of Client that
	// succeeds puts back. The test's cleanup closes it, after Client.
	Redis *miniredis.Miniredis
	// Client is the go-redis client of the Keeper, for commands of the test's
	// own. It gives up on an unreachable server within milliseconds, and is
	// closed by the test's cleanup.
	Client *redis.Client

	tb TB
}

// NewEnv starts an embedded Redis (miniredis.RunT) and returns a Keeper on
// it, made by idem.NewRedis(Client, opts...) with idem.WithClock(Clock.Now)
// appended: opts take every option NewRedis takes, with its defaults (lease
// 30s (idem.DefaultLease), retention 24h (idem.DefaultRetention), prefix
// "idem:" (idem.DefaultPrefix)), but a WithClock among them is overridden,
// since leases and expiry are decided by Redis's clock, which only the Clock
// moves. Options NewRedis refuses fail the test (tb.Fatalf). Call it from the
// test's goroutine; the client and server are closed by tb's cleanup.
func NewEnv(tb TB, opts ...idem.Option) *Env {
	tb.Helper()
	m := miniredis.RunT(tb)
	// SetTime moves key expiry (with ClockTTL, in one step under miniredis's
	// lock) and the TIME the scripts read for leases and tokens; minitime
	// answers TIME so that it strictly increases while the Clock stands
	// still, and fencing tokens never repeat for a key.
	m.SetTime(start)
	m.ClockTTL(true)
	clock := &Clock{now: start, redis: m, time: minitime.Install(m, start)}
	client := redis.NewClient(&redis.Options{
		Addr:               m.Addr(),
		MaxRetryBackoff:    16 * time.Millisecond,
		DialerRetryTimeout: 5 * time.Millisecond,
	})
	client.AddHook(clock.time.Hook())
	tb.Cleanup(func() { _ = client.Close() }) // before m.Close, which RunT registered first
	k, err := idem.NewRedis(client, append(opts[:len(opts):len(opts)], idem.WithClock(clock.Now))...)
	if err != nil {
		tb.Fatalf("idemtest: %v", err)
		return nil // for a TB whose Fatalf returns
	}
	return &Env{Keeper: k, Clock: clock, Redis: m, Client: client, tb: tb}
}

// SetError makes every command of the embedded Redis answer the error reply
// msg, as "LOADING Redis is loading the dataset in memory" (the Keeper
// answers idem.ErrUnavailable, the middleware 503), until SetError(""). It
// is safe to call while commands run.
func (e *Env) SetError(msg string) { e.Clock.time.SetError(msg) }

// New returns a Keeper on an embedded Redis and the Clock that moves it: the
// Keeper and Clock of NewEnv(tb, opts...), which documents the options and
// the cleanup.
func New(tb TB, opts ...idem.Option) (*idem.Keeper, *Clock) {
	tb.Helper()
	e := NewEnv(tb, opts...)
	if e == nil {
		return nil, nil
	}
	return e.Keeper, e.Clock
}

// Handler returns h guarded by idemhttp.New(keeper, opts...) on the Keeper of
// NewEnv(tb) (default options: lease 30s (idem.DefaultLease), retention 24h
// (idem.DefaultRetention)), and the Clock that moves it. Options idemhttp.New
// refuses fail the test (tb.Fatalf). For Keeper options of your own, use
// NewEnv(tb, keeperOpts...).Handler(h, opts...).
func Handler(tb TB, h http.Handler, opts ...idemhttp.Option) (http.Handler, *Clock) {
	tb.Helper()
	e := NewEnv(tb)
	if e == nil {
		return nil, nil
	}
	return e.Handler(h, opts...), e.Clock
}

// Handler returns h guarded by idemhttp.New(e.Keeper, opts...). Options
// idemhttp.New refuses fail the test given to NewEnv (Fatalf); call it from
// that test's goroutine. Each call makes a middleware of its own, on the same
// Keeper and Redis: handlers guarded by two calls share their records.
func (e *Env) Handler(h http.Handler, opts ...idemhttp.Option) http.Handler {
	e.tb.Helper()
	guard, err := idemhttp.New(e.Keeper, opts...)
	if err != nil {
		e.tb.Fatalf("idemtest: %v", err)
		return nil
	}
	return guard(h)
}

// Clock is the time of a Keeper and of the embedded Redis under it. It starts
// at 2025-01-01T00:00:00Z and moves only with Advance. It is safe for
// concurrent use. Clocks are made by New, NewEnv and Handler; the zero Clock
// is not usable.
//
// While the Clock stands still, Redis's TIME moves by one microsecond at
// each answer (no answer is equal to or earlier than one before it), and
// key expiry does not move: the fencing token of a claim, made from TIME,
// strictly increases for a key whatever the test does, a Forget followed by
// a new claim at the same instant included, so that a stale holder is never
// taken for the new one. So a lease left or an age that Redis measures may
// be off by a few microseconds from the Clock; Clock.Now does not move.
type Clock struct {
	mu    sync.Mutex
	now   time.Time
	redis *miniredis.Miniredis
	time  *minitime.Time
}

// Now returns the Clock's time (in UTC, without a monotonic reading). The
// Keeper reads it through idem.WithClock; a test may read it too, and so may
// the code under test, to stamp what it stores.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the Clock, and Redis's clock with it, forward by d: Redis's
// TIME (by which the scripts judge leases and make tokens) and the time to
// live of every key move in one step, as if d had passed. So after
// Advance(lease + time.Millisecond) a key whose holder stopped renewing can
// be claimed again (Claim.Recovered, the next Attempt), and after
// Advance(retention + time.Millisecond) a completed key is gone and runs
// again. d == 0 does nothing; a negative d panics, since neither clock may go
// back.
//
// Advance does not run anything that waits on real time. A Do (or a claim's
// KeepAlive) still running when the Clock passes its lease end is not told at
// once: its next renewal, due a third of the lease of real time after the
// previous one, finds by the Clock that the lease has run out, sends nothing,
// and cancels the operation's context with idem.ErrLeaseLost (Do then stores
// nothing and returns it). Before that renewal, a completion or release is
// decided by Redis: refused with ErrLeaseLost if another attempt has claimed
// the key meanwhile, accepted if none has. With the default lease of 30s
// (idem.DefaultLease), no renewal fires before a Do has run 10s; with a short
// lease, whose renewals fire during the test, which comes first is a race.
func (c *Clock) Advance(d time.Duration) {
	if d < 0 {
		panic("idemtest: Clock.Advance with a negative duration " + d.String())
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	c.redis.SetTime(c.now)
	c.time.Set(c.now)
}
