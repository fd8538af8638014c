package idemtest_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemtest"
	"github.com/idemkit/idem/internal/integration"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// start is where every Clock starts, as the package documents.
var start = time.Date(2025, time.January, 1, 0, 0, 0, 0, time.UTC)

// A claim whose holder never completes it blocks the key until its lease runs
// out by Redis's clock; then the next Begin takes it over, told so.
func TestLeaseExpiryRecovers(t *testing.T) {
	const lease = 10 * time.Second
	keeper, clock := idemtest.New(t, idem.WithLease(lease))
	ctx := t.Context()

	first, err := keeper.Begin(ctx, "acct", "order-1")
	require.NoError(t, err)
	require.NotNil(t, first.Claim)
	assert.Equal(t, 1, first.Claim.Attempt())
	assert.False(t, first.Claim.Recovered())

	// The holder "crashed": nothing renews its lease. Until the lease ends,
	// the key is in progress, and Redis says how long is left.
	_, err = keeper.Begin(ctx, "acct", "order-1")
	var ip *idem.InProgressError
	require.ErrorAs(t, err, &ip)
	assert.ErrorIs(t, err, idem.ErrInProgress)
	assert.Equal(t, lease, ip.RetryAfter)

	clock.Advance(lease - time.Millisecond)
	_, err = keeper.Begin(ctx, "acct", "order-1")
	require.ErrorAs(t, err, &ip)
	assert.Equal(t, time.Millisecond, ip.RetryAfter)

	clock.Advance(2 * time.Millisecond)
	second, err := keeper.Begin(ctx, "acct", "order-1")
	require.NoError(t, err)
	require.NotNil(t, second.Claim)
	assert.True(t, second.Claim.Recovered())
	assert.Equal(t, 2, second.Claim.Attempt())
	assert.Greater(t, second.Claim.Token(), first.Claim.Token())

	// The first holder comes back: it is refused, and the new one completes.
	assert.ErrorIs(t, first.Claim.Complete(ctx, []byte("stale"), 0), idem.ErrLeaseLost)
	require.NoError(t, second.Claim.Complete(ctx, []byte("done"), 0))
	out, err := keeper.Begin(ctx, "acct", "order-1")
	require.NoError(t, err)
	assert.True(t, out.Replayed)
	assert.Equal(t, "done", string(out.Value))
}

// A completed key replays its result for the retention, then runs again.
func TestRetentionExpiryRunsAgain(t *testing.T) {
	const retention = time.Hour
	keeper, clock := idemtest.New(t, idem.WithRetention(retention))
	ctx := t.Context()

	runs := 0
	charge := func(ctx context.Context) (string, error) {
		runs++
		c, _ := idem.ClaimFromContext(ctx)
		return fmt.Sprintf("charge %d (attempt %d)", runs, c.Attempt()), nil
	}

	v, err := idem.Do(ctx, keeper, "acct", "order-2", charge)
	require.NoError(t, err)
	assert.Equal(t, "charge 1 (attempt 1)", v)

	clock.Advance(retention - time.Millisecond)
	v, err = idem.Do(ctx, keeper, "acct", "order-2", charge)
	require.NoError(t, err)
	assert.Equal(t, "charge 1 (attempt 1)", v, "replayed within the retention")
	assert.Equal(t, 1, runs)

	clock.Advance(2 * time.Millisecond)
	v, err = idem.Do(ctx, keeper, "acct", "order-2", charge)
	require.NoError(t, err)
	assert.Equal(t, "charge 2 (attempt 1)", v, "the record expired: a new first attempt")
	assert.Equal(t, 2, runs)
}

// A guarded handler runs once, replays to a retry, and runs again once the
// retention has passed.
func TestHandlerReplaysThenRunsAgain(t *testing.T) {
	var runs atomic.Int32
	h, clock := idemtest.Handler(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charge %d", n)
	}))

	post := func() *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"amount":100}`))
		req.Header.Set("Idempotency-Key", "order-3")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}

	rec := post()
	assert.Equal(t, http.StatusCreated, rec.Code)
	assert.Equal(t, "charge 1", rec.Body.String())
	assert.Empty(t, rec.Header().Get(idemhttp.ReplayedHeader))

	rec = post()
	assert.Equal(t, http.StatusCreated, rec.Code)
	assert.Equal(t, "charge 1", rec.Body.String())
	assert.Equal(t, "true", rec.Header().Get("Idempotent-Replayed"))
	assert.Equal(t, int32(1), runs.Load())

	clock.Advance(idem.DefaultRetention + time.Millisecond)
	rec = post()
	assert.Equal(t, http.StatusCreated, rec.Code)
	assert.Equal(t, "charge 2", rec.Body.String())
	assert.Empty(t, rec.Header().Get(idemhttp.ReplayedHeader))
	assert.Equal(t, int32(2), runs.Load())
}

// A retry while the handler runs gets 409 with the lease left; after the
// lease, a retry takes over with Recovered, and the stale handler's response
// is not stored.
func TestHandlerInProgressThenTakeover(t *testing.T) {
	const lease = 20 * time.Second
	env := idemtest.NewEnv(t, idem.WithLease(lease))
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	var runs atomic.Int32
	h := env.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, _ := idem.ClaimFromContext(r.Context())
		if runs.Add(1) == 1 {
			entered <- struct{}{}
			<-release // a slow first attempt
		}
		fmt.Fprintf(w, "attempt %d recovered %t", c.Attempt(), c.Recovered())
	}))
	post := func() *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/jobs", nil)
		req.Header.Set("Idempotency-Key", "job-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}

	firstDone := make(chan *httptest.ResponseRecorder)
	go func() { firstDone <- post() }()
	<-entered

	rec := post()
	assert.Equal(t, http.StatusConflict, rec.Code)
	assert.Equal(t, "1", rec.Header().Get("Retry-After"), "a short hint, not the 20s of lease left")

	env.Clock.Advance(lease + time.Millisecond)
	rec = post()
	assert.Equal(t, http.StatusOK, rec.Code)
	assert.Equal(t, "attempt 2 recovered true", rec.Body.String())

	close(release)
	first := <-firstDone
	assert.Equal(t, http.StatusOK, first.Code, "the first client still gets its response")

	rec = post()
	assert.Equal(t, "attempt 2 recovered true", rec.Body.String(), "the taker's response is the one stored")
	assert.Equal(t, "true", rec.Header().Get(idemhttp.ReplayedHeader))
}

// A Do that is still running when the test advances past its lease is not
// told at once: with the default lease no renewal fires during the test, and
// it learns it lost the key when it stores its result.
func TestDoRunningPastItsLease(t *testing.T) {
	keeper, clock := idemtest.New(t)
	ctx := t.Context()
	entered := make(chan struct{})
	release := make(chan struct{})
	type result struct {
		v   string
		err error
	}
	done := make(chan result)
	go func() {
		v, err := idem.Do(ctx, keeper, "acct", "order-4", func(ctx context.Context) (string, error) {
			close(entered)
			<-release
			return "first", ctx.Err()
		})
		done <- result{v, err}
	}()
	<-entered

	clock.Advance(idem.DefaultLease + time.Millisecond)
	second, err := keeper.Begin(ctx, "acct", "order-4")
	require.NoError(t, err)
	require.NotNil(t, second.Claim)
	assert.True(t, second.Claim.Recovered())

	close(release)
	r := <-done
	assert.Equal(t, "first", r.v, "the function ran: Do returns its value")
	require.ErrorIs(t, r.err, idem.ErrLeaseLost, "but its result was refused")

	require.NoError(t, second.Claim.Complete(ctx, []byte("second"), 0))
}

// A call that waits (WithWait) for an attempt in progress measures its wait
// on the Clock: advancing past the holder's lease lets it take the key over,
// whether the Advance comes before or during its wait.
func TestWaitTakesOverAfterAdvance(t *testing.T) {
	keeper, clock := idemtest.New(t)
	ctx := t.Context()
	_, err := keeper.Begin(ctx, "acct", "order-5")
	require.NoError(t, err)

	got := make(chan idem.Outcome)
	go func() {
		out, err := keeper.Begin(ctx, "acct", "order-5", idem.WithWait(time.Hour))
		assert.NoError(t, err)
		got <- out
	}()
	clock.Advance(idem.DefaultLease + time.Millisecond)
	out := <-got
	require.NotNil(t, out.Claim)
	assert.True(t, out.Claim.Recovered())
	assert.Equal(t, 2, out.Claim.Attempt())
}

// Advance moves the Clock, Redis's TIME and key expiry together.
func TestClockMovesRedis(t *testing.T) {
	env := idemtest.NewEnv(t)
	ctx := t.Context()
	assert.Equal(t, start, env.Clock.Now())
	rt, err := env.Client.Time(ctx).Result()
	require.NoError(t, err)
	assert.True(t, rt.Equal(start), "TIME %s", rt)

	require.NoError(t, env.Client.Set(ctx, "k", "v", time.Minute).Err())
	env.Clock.Advance(time.Minute - time.Millisecond)
	assert.Equal(t, start.Add(time.Minute-time.Millisecond), env.Clock.Now())
	rt, err = env.Client.Time(ctx).Result()
	require.NoError(t, err)
	assert.True(t, rt.Equal(env.Clock.Now()), "TIME %s", rt)
	n, err := env.Client.Exists(ctx, "k").Result()
	require.NoError(t, err)
	assert.Equal(t, int64(1), n)
	pttl, err := env.Client.PTTL(ctx, "k").Result()
	require.NoError(t, err)
	assert.Equal(t, time.Millisecond, pttl)

	env.Clock.Advance(time.Millisecond)
	n, err = env.Client.Exists(ctx, "k").Result()
	require.NoError(t, err)
	assert.Zero(t, n)

	env.Clock.Advance(0)
	assert.Equal(t, start.Add(time.Minute), env.Clock.Now())
	assert.Panics(t, func() { env.Clock.Advance(-time.Nanosecond) })
	assert.Equal(t, start.Add(time.Minute), env.Clock.Now())
}

func TestClockConcurrent(t *testing.T) {
	keeper, clock := idemtest.New(t)
	ctx := t.Context()
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for j := range 50 {
				clock.Advance(time.Millisecond)
				_ = clock.Now()
				_, err := keeper.Begin(ctx, "acct", fmt.Sprintf("k-%d-%d", i, j))
				assert.NoError(t, err)
			}
		})
	}
	wg.Wait()
	assert.Equal(t, start.Add(400*time.Millisecond), clock.Now())
}

// Keeper options are honoured, and a WithClock among them is overridden by
// the Clock.
func TestNewEnvOptions(t *testing.T) {
	var userClock atomic.Int32
	env := idemtest.NewEnv(t,
		idem.WithPrefix("app:"),
		idem.WithLease(5*time.Second),
		idem.WithClock(func() time.Time { userClock.Add(1); return time.Now() }),
	)
	assert.Equal(t, 5*time.Second, integration.Lease(env.Keeper))
	assert.Equal(t, idem.DefaultRetention, integration.Retention(env.Keeper))

	_, err := env.Keeper.Begin(t.Context(), "acct", "order-6")
	require.NoError(t, err)
	keys := recordKeys(env)
	require.Len(t, keys, 1)
	assert.True(t, strings.HasPrefix(keys[0], "app:{"), keys[0])
	assert.Equal(t, 5*time.Second+idem.DefaultRetention, env.Redis.TTL(keys[0]), "a pending record is kept lease + retention")
	assert.Zero(t, userClock.Load(), "the Keeper reads the Clock, not the WithClock given")
}

// The embedded Redis can be broken: every command fails, a record is
// overwritten with another value, the server goes away. The Keeper and the
// middleware say so, and the handler does not run.
func TestBrokenRedis(t *testing.T) {
	env := idemtest.NewEnv(t)
	var runs atomic.Int32
	h := env.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusAccepted)
	}))
	post := func(key string) int {
		req := httptest.NewRequest(http.MethodPost, "/payments", nil)
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code
	}

	env.Redis.SetError("LOADING Redis is loading the dataset in memory")
	_, err := env.Keeper.Begin(t.Context(), "acct", "order-7")
	assert.ErrorIs(t, err, idem.ErrUnavailable)
	assert.Equal(t, http.StatusServiceUnavailable, post("order-7"))
	assert.Zero(t, runs.Load())

	env.Redis.SetError("")
	assert.Equal(t, http.StatusAccepted, post("order-7"))
	assert.Equal(t, int32(1), runs.Load())

	// A value that is not a record is reported, never overwritten.
	keys := recordKeys(env)
	require.Len(t, keys, 1)
	require.NoError(t, env.Redis.Set(keys[0], "not a record"))
	assert.Equal(t, http.StatusInternalServerError, post("order-7"))
	v, err := env.Redis.Get(keys[0])
	require.NoError(t, err)
	assert.Equal(t, "not a record", v)

	env.Redis.Close()
	_, err = env.Keeper.Begin(t.Context(), "acct", "order-8")
	assert.ErrorIs(t, err, idem.ErrUnavailable)
	assert.Equal(t, http.StatusServiceUnavailable, post("order-8"))
	assert.Equal(t, int32(1), runs.Load())
}

// fakeTB records Fatalf instead of ending the test, so that a refusal can be
// checked; its cleanups run with the real test's.
type fakeTB struct {
	*testing.T
	fatal string
}

func (f *fakeTB) Fatalf(format string, args ...any) { f.fatal = fmt.Sprintf(format, args...) }

func TestRefusedOptionsFailTheTest(t *testing.T) {
	f := &fakeTB{T: t}
	env := idemtest.NewEnv(f, idem.WithLease(-time.Second))
	assert.Nil(t, env)
	assert.Contains(t, f.fatal, "idemtest: ")
	assert.Contains(t, f.fatal, idem.ErrInvalidConfig.Error())

	f = &fakeTB{T: t}
	keeper, clock := idemtest.New(f, idem.WithFingerprint([]byte("x"))) // applies to a call, not a Keeper
	assert.Nil(t, keeper)
	assert.Nil(t, clock)
	assert.NotEmpty(t, f.fatal)

	f = &fakeTB{T: t}
	h, clock := idemtest.Handler(f, http.NotFoundHandler(), idemhttp.WithMethods())
	assert.Nil(t, h)
	assert.NotNil(t, clock)
	assert.Contains(t, f.fatal, "idemtest: ")
	assert.False(t, t.Failed())
}

// With the Clock standing still, a Forget followed by a new claim of the key
// gets a higher token than the forgotten claim's, so that the stale holder's
// completion is refused; the same after the embedded Redis was broken and
// mended, through Env.SetError or miniredis's own SetError.
func TestFrozenClockNeverReusesAToken(t *testing.T) {
	env := idemtest.NewEnv(t)
	ctx := t.Context()
	for _, brk := range []struct {
		name   string
		break_ func(msg string)
	}{
		{"none", nil},
		{"Env.SetError", env.SetError},
		{"Redis.SetError", env.Redis.SetError},
	} {
		key := "order-" + brk.name
		stale, err := env.Keeper.Begin(ctx, "acct", key)
		require.NoError(t, err)
		_, err = env.Keeper.Forget(ctx, "acct", key, true)
		require.NoError(t, err)
		if brk.break_ != nil {
			brk.break_("LOADING Redis is loading the dataset in memory")
			_, err := env.Keeper.Begin(ctx, "acct", key)
			require.ErrorIs(t, err, idem.ErrUnavailable, brk.name)
			brk.break_("")
		}
		fresh, err := env.Keeper.Begin(ctx, "acct", key)
		require.NoError(t, err, brk.name)
		require.NotNil(t, fresh.Claim, brk.name)
		assert.Greater(t, fresh.Claim.Token(), stale.Claim.Token(), "%s: a token handed out twice", brk.name)
		assert.ErrorIs(t, stale.Claim.Complete(ctx, []byte("stale"), 0), idem.ErrLeaseLost, "%s: the stale holder's completion is accepted", brk.name)
		require.NoError(t, fresh.Claim.Complete(ctx, []byte("fresh"), 0), brk.name)
	}
	assert.Equal(t, start, env.Clock.Now(), "the Clock did not move")
}

// recordKeys is the keys of env's records: its Redis's keys but the
// prefix's record (prefix + "layout"), which says how they are written.
func recordKeys(env *idemtest.Env) []string {
	var keys []string
	for _, k := range env.Redis.Keys() {
		if strings.Contains(k, "{") {
			keys = append(keys, k)
		}
	}
	return keys
}
