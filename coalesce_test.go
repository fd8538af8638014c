package idem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// coalescingKeeper returns a Keeper with coalescing on, its scripts loaded so
// that round trips are counted without NOSCRIPT fallbacks, and a counter of
// its round trips.
func coalescingKeeper(t *testing.T, b *redistest.Backend, opts ...Option) (*Keeper, *redistest.Counter) {
	t.Helper()
	cnt := &redistest.Counter{}
	b.Client.AddHook(cnt)
	k := newKeeper(t, b, append([]Option{WithCoalescing(true)}, opts...)...)
	require.NoError(t, k.store.(*redisStore).LoadScripts(context.Background()))
	return k, cnt
}

// joined returns how many callers have joined the current flight of
// (scope, key), or -1 when there is none.
func joined(k *Keeper, scope, key string) int {
	id := recordID(scope, key)
	sh := flightsOf(k).shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if fl := sh.m[id]; fl != nil {
		return fl.joined
	}
	return -1
}

// flightsOf returns the coalescing layer of k, which must have one.
func flightsOf(k *Keeper) *flights { return k.claims.(*flights) }

// eventually waits until cond is true, and marks t failed if it is not
// within 10 seconds. It bounds a wait for other goroutines to reach a point;
// it does not measure time. It may be called from any goroutine.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			assert.Failf(t, "timed out", "waiting until %s", what)
			return
		}
	}
}

func TestCoalescingOneClaimForARetryStorm(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, cnt := coalescingKeeper(t, b)
		ctx := context.Background()
		const n = 100
		var runs, busy atomic.Int32
		fn := func(ctx context.Context) (string, error) {
			runs.Add(1)
			// Hold the claim until every other caller has been answered.
			eventually(t, "the others are answered", func() bool { return busy.Load() == n-1 })
			return "done", nil
		}
		var wg sync.WaitGroup
		start := make(chan struct{})
		before := cnt.RoundTrips()
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				v, err := Do(ctx, k, "s", "storm", fn)
				var ip *InProgressError
				switch {
				case errors.As(err, &ip):
					assert.Greater(t, ip.RetryAfter, time.Duration(0))
					assert.LessOrEqual(t, ip.RetryAfter, k.policy.lease)
					busy.Add(1)
				case err != nil:
					assert.NoError(t, err, "Do")
				default:
					assert.Equal(t, "done", v)
				}
			}()
		}
		close(start)
		wg.Wait()
		assert.EqualValues(t, 1, runs.Load(), "the operation runs once")
		assert.EqualValues(t, n-1, busy.Load())
		assert.EqualValues(t, 2, cnt.RoundTrips()-before, "Redis sees one claim and one completion")
		assert.Equal(t, -1, joined(k, "s", "storm"), "nothing is left in flight")

		// Later calls go to Redis and replay.
		assert.EqualValues(t, 1, cnt.Count(func() {
			v, err := Do(ctx, k, "s", "storm", fn)
			require.NoError(t, err)
			assert.Equal(t, "done", v)
		}))
		assert.EqualValues(t, 1, runs.Load())
	})
}

func TestCoalescingWaitersGetTheLeadersResult(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, cnt := coalescingKeeper(t, b)
		ctx := context.Background()
		const n = 100
		var runs atomic.Int32
		var token atomic.Int64
		fn := func(ctx context.Context) (receipt, error) {
			runs.Add(1)
			c, _ := ClaimFromContext(ctx)
			token.Store(c.Token())
			eventually(t, "every caller waits", func() bool { return joined(k, "s", "wait") == n-1 })
			return receipt{ID: "r1", Amount: 7}, nil
		}
		var wg sync.WaitGroup
		results := make(chan receipt, n)
		before := cnt.RoundTrips()
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				v, err := Do(ctx, k, "s", "wait", fn, WithWait(time.Minute))
				assert.NoError(t, err)
				results <- v
			}()
		}
		wg.Wait()
		close(results)
		for v := range results {
			assert.Equal(t, receipt{ID: "r1", Amount: 7}, v)
		}
		assert.EqualValues(t, 1, runs.Load())
		assert.EqualValues(t, 2, cnt.RoundTrips()-before, "Redis sees one claim and one completion")

		// Begin's waiters get the stored bytes as a replay, each its own copy.
		out, err := k.Begin(ctx, "s", "wait-begin")
		require.NoError(t, err)
		got := make(chan Outcome, 2)
		for i := 0; i < 2; i++ {
			go func() {
				o, err := k.Begin(ctx, "s", "wait-begin", WithWait(time.Minute))
				assert.NoError(t, err)
				got <- o
			}()
		}
		eventually(t, "both wait", func() bool { return joined(k, "s", "wait-begin") == 2 })
		body := []byte("result")
		require.NoError(t, out.Claim.Complete(ctx, body, 0))
		body[0] = 'X' // the caller may reuse its slice
		a, c := <-got, <-got
		for _, o := range []Outcome{a, c} {
			assert.True(t, o.Replayed)
			assert.Nil(t, o.Claim)
			assert.Equal(t, out.Token, o.Token)
			assert.Equal(t, "result", string(o.Value))
		}
		a.Value[0] = 'Y'
		assert.Equal(t, "result", string(c.Value), "each caller has its own Value")
	})
}

func TestCoalescingWaitersClaimAfterRelease(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, cnt := coalescingKeeper(t, b)
		ctx := context.Background()
		const n = 50
		var runs atomic.Int32
		var tokens, attempts [2]int64
		fail := errors.New("try again")
		fn := func(ctx context.Context) (string, error) {
			run := runs.Add(1)
			c, _ := ClaimFromContext(ctx)
			tokens[run-1], attempts[run-1] = c.Token(), int64(c.Attempt())
			if run == 1 {
				eventually(t, "every caller waits", func() bool { return joined(k, "s", "rel") == n-1 })
				return "", fail
			}
			eventually(t, "the others wait again", func() bool { return joined(k, "s", "rel") == n-2 })
			return "second", nil
		}
		var wg sync.WaitGroup
		var failed, second atomic.Int32
		before := cnt.RoundTrips()
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				v, err := Do(ctx, k, "s", "rel", fn, WithWait(time.Minute))
				switch {
				case errors.Is(err, fail):
					failed.Add(1)
				case err != nil:
					assert.NoError(t, err, "Do")
				case v == "second":
					second.Add(1)
				}
			}()
		}
		wg.Wait()
		assert.EqualValues(t, 2, runs.Load(), "the release lets exactly one waiter run the operation again")
		assert.EqualValues(t, 1, failed.Load())
		assert.EqualValues(t, n-1, second.Load())
		assert.Greater(t, tokens[1], tokens[0], "the second claim is fenced above the first")
		assert.Equal(t, [2]int64{1, 2}, attempts, "attempts count the store's claims only")
		assert.EqualValues(t, 4, cnt.RoundTrips()-before, "claim, release, claim, complete")
	})
}

func TestCoalescingOtherFingerprintGoesToTheStore(t *testing.T) {
	b := redistest.Miniredis(t)
	k, cnt := coalescingKeeper(t, b)
	ctx := context.Background()
	held, err := k.Begin(ctx, "s", "fp", WithFingerprint([]byte("a")))
	require.NoError(t, err)
	assert.EqualValues(t, 0, cnt.Count(func() {
		_, err := k.Begin(ctx, "s", "fp", WithFingerprint([]byte("a")))
		require.ErrorIs(t, err, ErrInProgress)
	}), "the same request is answered in the process")
	assert.EqualValues(t, 1, cnt.Count(func() {
		_, err := k.Begin(ctx, "s", "fp", WithFingerprint([]byte("b")))
		require.ErrorIs(t, err, ErrMismatch)
	}), "another request asks the store, which refuses it")
	require.NoError(t, held.Claim.Release(ctx))
	assert.Equal(t, -1, joined(k, "s", "fp"))
}

// gateStore holds every Claim until gate is closed (or the call's context
// ends), then answers err if set, else passes the call on.
type gateStore struct {
	recordStore
	claims atomic.Int32
	gate   chan struct{}
	err    error
}

func (g *gateStore) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	g.claims.Add(1)
	select {
	case <-g.gate:
	case <-ctx.Done():
		return claimReply{}, ctx.Err()
	}
	if g.err != nil {
		return claimReply{}, g.err
	}
	return g.recordStore.Claim(ctx, id, req)
}

func gatedKeeper(t *testing.T, err error) (*Keeper, *gateStore) {
	t.Helper()
	s, serr := openRedisStore(redistest.Miniredis(t).Client)
	require.NoError(t, serr)
	g := &gateStore{recordStore: s, gate: make(chan struct{}), err: err}
	k, kerr := keeperOn(g, WithCoalescing(true))
	require.NoError(t, kerr)
	return k, g
}

func TestCoalescingSharesTheClaimsAnswer(t *testing.T) {
	ctx := context.Background()
	const n = 20
	// storm starts n callers of Begin on key once the gate is set up, opens
	// the gate when all have joined, and returns their answers.
	storm := func(t *testing.T, k *Keeper, g *gateStore, key string) ([]Outcome, []error) {
		outs, errs := make([]Outcome, n), make([]error, n)
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				outs[i], errs[i] = k.Begin(ctx, "s", key)
			}()
		}
		eventually(t, "all join", func() bool { return joined(k, "s", key) == n-1 })
		close(g.gate)
		wg.Wait()
		assert.EqualValues(t, 1, g.claims.Load(), "one call to the store")
		return outs, errs
	}
	for _, cause := range []error{
		fmt.Errorf("%w: connection refused", ErrUnavailable),
		fmt.Errorf("%w: wrong type", ErrCorrupt),
	} {
		t.Run(cause.Error(), func(t *testing.T) {
			k, g := gatedKeeper(t, cause)
			_, errs := storm(t, k, g, "err")
			for _, err := range errs {
				assert.Equal(t, cause, err)
			}
		})
	}
	t.Run("replay", func(t *testing.T) {
		k, g := gatedKeeper(t, nil)
		close(g.gate)
		out, err := k.Begin(ctx, "s", "done")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte("kept"), 0))
		g.gate = make(chan struct{})
		g.claims.Store(0)
		outs, errs := storm(t, k, g, "done")
		for i := range outs {
			require.NoError(t, errs[i])
			assert.True(t, outs[i].Replayed)
			assert.Equal(t, "kept", string(outs[i].Value))
		}
		outs[0].Value[0] = 'X'
		assert.Equal(t, "kept", string(outs[1].Value), "each caller has its own Value")
	})
}

func TestCoalescingLeadersCancellationIsNotShared(t *testing.T) {
	k, g := gatedKeeper(t, nil)
	ctx := context.Background()
	lctx, cancel := context.WithCancel(ctx)
	leaderDone := make(chan error)
	go func() {
		_, err := k.Begin(lctx, "s", "c")
		leaderDone <- err
	}()
	eventually(t, "the leader calls the store", func() bool { return g.claims.Load() == 1 })
	const n = 10
	outs, errs := make([]Outcome, n), make([]error, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i], errs[i] = k.Begin(ctx, "s", "c")
		}()
	}
	eventually(t, "all join", func() bool { return joined(k, "s", "c") == n })
	cancel()
	require.ErrorIs(t, <-leaderDone, context.Canceled)
	close(g.gate)
	wg.Wait()
	claimed := 0
	for i := range outs {
		if outs[i].Claim != nil {
			claimed++
			continue
		}
		require.ErrorIs(t, errs[i], ErrInProgress, "the others see the new leader's claim")
	}
	assert.Equal(t, 1, claimed, "one follower claims in the leader's place")
	assert.EqualValues(t, 2, g.claims.Load())
}

func TestCoalescingHoldEndsWithTheLease(t *testing.T) {
	b := redistest.Miniredis(t)
	k, cnt := coalescingKeeper(t, b, WithLease(time.Second), WithRetention(time.Minute))
	now := time.Now()
	var mu sync.Mutex
	k.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock(); b.Advance(d) }
	ctx := context.Background()

	old, err := k.Begin(ctx, "s", "lease")
	require.NoError(t, err)
	assert.EqualValues(t, 0, cnt.Count(func() {
		_, err := k.Begin(ctx, "s", "lease")
		require.ErrorIs(t, err, ErrInProgress)
	}))
	// A renewed lease keeps the hold.
	advance(800 * time.Millisecond)
	require.NoError(t, old.Claim.Extend(ctx))
	advance(800 * time.Millisecond)
	assert.EqualValues(t, 0, cnt.Count(func() {
		_, err := k.Begin(ctx, "s", "lease")
		var ip *InProgressError
		require.ErrorAs(t, err, &ip)
		assert.Equal(t, 200*time.Millisecond, ip.RetryAfter)
	}))
	// Once it runs out, the store decides: it is taken over, fenced above.
	advance(300 * time.Millisecond)
	var next Outcome
	assert.EqualValues(t, 1, cnt.Count(func() {
		next, err = k.Begin(ctx, "s", "lease")
		require.NoError(t, err)
	}))
	require.NotNil(t, next.Claim)
	assert.True(t, next.Claim.Recovered())
	assert.Equal(t, 2, next.Claim.Attempt())
	assert.Greater(t, next.Claim.Token(), old.Claim.Token())
	require.ErrorIs(t, old.Claim.Complete(ctx, []byte("stale"), 0), ErrLeaseLost)
	assert.Equal(t, 0, joined(k, "s", "lease"), "the stale holder's failure leaves the new hold in place")
	require.NoError(t, next.Claim.Complete(ctx, []byte("fresh"), 0))
	assert.Equal(t, -1, joined(k, "s", "lease"))
}

func TestCoalescingSweepsAbandonedHolds(t *testing.T) {
	k, _ := coalescingKeeper(t, redistest.Miniredis(t), WithLease(time.Second))
	now := time.Now()
	k.now = func() time.Time { return now }
	ctx := context.Background()
	// keys returns n keys whose records fall in the first shard.
	sh := &flightsOf(k).shards[0]
	keys := func(prefix string, n int) []string {
		var out []string
		for i := 0; len(out) < n && i < 1e6; i++ {
			key := fmt.Sprint(prefix, i)
			if flightsOf(k).shard(recordID("s", key)) == sh {
				out = append(out, key)
			}
		}
		require.Len(t, out, n)
		return out
	}
	for _, key := range keys("abandoned-", minSweep) {
		_, err := k.Begin(ctx, "s", key) // claimed, then never completed nor released
		require.NoError(t, err)
	}
	require.Len(t, sh.m, minSweep)
	now = now.Add(2 * time.Second)
	_, err := k.Begin(ctx, "s", keys("fresh-", 1)[0])
	require.NoError(t, err)
	assert.Len(t, sh.m, 1, "the holds whose lease ran out are dropped")
}

func TestFlightShardsSpreadKeys(t *testing.T) {
	f := newFlights(nil, time.Now)
	counts := map[*flightShard]int{}
	for i := 0; i < 100*flightShards; i++ {
		counts[f.shard(recordID("s", fmt.Sprint(i)))]++
	}
	require.Len(t, counts, flightShards, "every shard is used")
	for _, n := range counts {
		assert.InDelta(t, 100, n, 50)
	}
}

// waiting returns how many callers follow the one flight in k, or -1 unless
// there is exactly one.
func waiting(k *Keeper) int {
	found, joined := 0, -1
	for i := range flightShards {
		sh := &flightsOf(k).shards[i]
		sh.mu.Lock()
		for _, fl := range sh.m {
			found++
			joined = fl.joined
		}
		sh.mu.Unlock()
	}
	if found != 1 {
		return -1
	}
	return joined
}
