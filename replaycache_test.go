package idem

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// testClock is a clock a test moves by hand.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func newTestClock() *testClock { return &testClock{now: time.Now()} }

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// countedKeeper returns a Keeper on b with opts, and the counter of the
// round trips of b's client.
func countedKeeper(t *testing.T, b *redistest.Backend, opts ...Option) (*Keeper, *redistest.Counter) {
	t.Helper()
	cnt := &redistest.Counter{}
	b.Client.AddHook(cnt)
	return newKeeper(t, b, opts...), cnt
}

func TestReplayCacheAnswersWithoutARoundTrip(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k, cnt := countedKeeper(t, b, WithReplayCache(100, 1<<20, time.Hour))
		var runs atomic.Int32
		fn := func(context.Context) (string, error) { runs.Add(1); return "result", nil }
		_, err := Do(ctx, k, "s", "k", fn)
		require.NoError(t, err)

		var v string
		n := cnt.Count(func() { v, err = Do(ctx, k, "s", "k", fn) })
		require.NoError(t, err)
		assert.Equal(t, "result", v)
		assert.Zero(t, n, "a result this Keeper stored is replayed from memory")

		var out Outcome
		n = cnt.Count(func() { out, err = k.Begin(ctx, "s", "k") })
		require.NoError(t, err)
		assert.Zero(t, n)
		assert.True(t, out.Replayed)
		assert.Nil(t, out.Claim)
		assert.Positive(t, out.Token)
		out.Value[0] ^= 0xff // the caller owns its Value
		again, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		assert.NotEqual(t, out.Value, again.Value, "another caller's Value is not touched")
		assert.EqualValues(t, 1, runs.Load())

		// Another Keeper (of the same store, which has read the prefix's
		// record) replays from the store once, then from its cache.
		k2, err := keeperOn(k.store, WithReplayCache(100, 1<<20, time.Hour))
		require.NoError(t, err)
		n = cnt.Count(func() { v, err = Do(ctx, k2, "s", "k", fn) })
		require.NoError(t, err)
		assert.Equal(t, "result", v)
		assert.EqualValues(t, 1, n, "the first replay goes to the store")
		n = cnt.Count(func() { v, err = Do(ctx, k2, "s", "k", fn) })
		require.NoError(t, err)
		assert.Equal(t, "result", v)
		assert.Zero(t, n, "a replay seen before is answered from memory")
		assert.EqualValues(t, 1, runs.Load())
		st := k2.ReplayCacheStats()
		assert.EqualValues(t, 1, st.Hits)
		assert.EqualValues(t, 1, st.Misses)
		assert.Equal(t, 1, st.Entries)
		assert.Positive(t, st.Bytes)
	})
}

func TestReplayCacheOffByDefault(t *testing.T) {
	b := redistest.Miniredis(t)
	k, cnt := countedKeeper(t, b)
	ctx := context.Background()
	_, err := Do(ctx, k, "s", "k", func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	n := cnt.Count(func() { _, err = Do(ctx, k, "s", "k", func(context.Context) (int, error) { return 2, nil }) })
	require.NoError(t, err)
	assert.EqualValues(t, 1, n)
	assert.Equal(t, ReplayCacheStats{}, k.ReplayCacheStats())
}

func TestReplayCacheExpiry(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		clock := newTestClock()
		k, cnt := countedKeeper(t, b, WithClock(clock.Now), WithReplayCache(100, 1<<20, 10*time.Minute))
		ok := func(id string) { // a replay of id, from memory or not
			out, err := k.Begin(ctx, "s", id)
			require.NoError(t, err)
			require.True(t, out.Replayed)
		}
		for _, id := range []string{"long", "short"} {
			out, err := k.Begin(ctx, "s", id)
			require.NoError(t, err)
			keep := time.Hour
			if id == "short" {
				keep = time.Minute
			}
			require.NoError(t, out.Claim.Complete(ctx, []byte(id), keep))
		}

		clock.Advance(time.Minute - time.Nanosecond)
		assert.Zero(t, cnt.Count(func() { ok("long"); ok("short") }), "both within their retention and max age")
		clock.Advance(time.Nanosecond)
		assert.EqualValues(t, 1, cnt.Count(func() { ok("short") }), "not served past the retention given to Complete")
		clock.Advance(9*time.Minute - time.Nanosecond)
		assert.Zero(t, cnt.Count(func() { ok("long") }))
		clock.Advance(time.Nanosecond)
		assert.EqualValues(t, 1, cnt.Count(func() { ok("long") }), "not served past the max age")
		assert.Zero(t, cnt.Count(func() { ok("long") }), "the replay from the store fills it again")
	})
}

func TestReplayCacheBounds(t *testing.T) {
	ctx := context.Background()
	b := redistest.Miniredis(t)
	k, cnt := countedKeeper(t, b, WithReplayCache(2, 1<<20, time.Hour))
	for _, id := range []string{"a", "b", "c"} {
		_, err := Do(ctx, k, "s", id, func(context.Context) (string, error) { return id, nil })
		require.NoError(t, err)
	}
	st := k.ReplayCacheStats()
	assert.Equal(t, 2, st.Entries, "bounded in entries")
	replayTrips := func(id string) int64 {
		return cnt.Count(func() {
			v, err := Do(ctx, k, "s", id, func(context.Context) (string, error) { return "ran again", nil })
			assert.NoError(t, err)
			assert.Equal(t, id, v)
		})
	}
	assert.EqualValues(t, 1, replayTrips("a"), "the least recently used was dropped")
	assert.Zero(t, replayTrips("a"))
	assert.Zero(t, replayTrips("c"))
	assert.EqualValues(t, 1, replayTrips("b"), "a dropped c's elder, b")

	small, cnt2 := countedKeeper(t, redistest.Miniredis(t), WithReplayCache(10, 400, time.Hour))
	big := strings.Repeat("x", 300)
	for _, v := range []string{"small", big} {
		_, err := Do(ctx, small, "s", v[:1], func(context.Context) (string, error) { return v, nil })
		require.NoError(t, err)
	}
	st = small.ReplayCacheStats()
	assert.Equal(t, 1, st.Entries, "a result larger than the bytes bound is not cached")
	assert.LessOrEqual(t, st.Bytes, int64(400))
	n := cnt2.Count(func() {
		v, err := Do(ctx, small, "s", "x", func(context.Context) (string, error) { return "ran again", nil })
		assert.NoError(t, err)
		assert.Equal(t, big, v)
	})
	assert.EqualValues(t, 1, n)
}

func TestReplayCacheFingerprint(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k, cnt := countedKeeper(t, b, WithReplayCache(100, 1<<20, time.Hour))
		a, other := WithFingerprint([]byte("a")), WithFingerprint([]byte("b"))
		out, err := k.Begin(ctx, "s", "k", a)
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))

		var n int64
		for _, opt := range []Option{other, {}} {
			n = cnt.Count(func() { _, err = k.Begin(ctx, "s", "k", opt) })
			require.ErrorIs(t, err, ErrMismatch, "another fingerprint is answered by the store")
			assert.EqualValues(t, 1, n)
		}
		n = cnt.Count(func() { out, err = k.Begin(ctx, "s", "k", a) })
		require.NoError(t, err)
		assert.Zero(t, n)
		assert.Equal(t, []byte("v"), out.Value)
	})
}

func TestReplayCacheHoldsOnlyCompletedResults(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k, cnt := countedKeeper(t, b, WithReplayCache(100, 1<<20, time.Hour), WithLease(time.Hour))
		out, err := k.Begin(ctx, "s", "held")
		require.NoError(t, err)
		n := cnt.Count(func() { _, err = k.Begin(ctx, "s", "held") })
		require.ErrorIs(t, err, ErrInProgress)
		assert.EqualValues(t, 1, n, "a key in progress goes to the store")
		require.NoError(t, out.Claim.Release(ctx))
		out, err = k.Begin(ctx, "s", "held")
		require.NoError(t, err)
		require.NotNil(t, out.Claim, "a released key is claimed again")
		require.NoError(t, out.Claim.Release(ctx))

		_, err = Do(ctx, k, "s", "fails", func(context.Context) (int, error) { return 0, fmt.Errorf("try again") })
		require.Error(t, err)
		var ran bool
		_, err = Do(ctx, k, "s", "fails", func(context.Context) (int, error) { ran = true; return 1, nil })
		require.NoError(t, err)
		assert.True(t, ran, "an error that released the key is not cached")

		_, err = Do(ctx, k, "s", "final", func(context.Context) (int, error) { return 0, FinalCode(fmt.Errorf("no"), "E1", nil) })
		require.Error(t, err)
		n = cnt.Count(func() {
			_, err = Do(ctx, k, "s", "final", func(context.Context) (int, error) { return 1, nil })
		})
		assert.Zero(t, n, "a stored final error is a completed result")
		var fe *FinalError
		require.ErrorAs(t, err, &fe)
		assert.True(t, fe.Replayed)
		assert.Equal(t, "E1", fe.Code)
		out, err = k.Begin(ctx, "s", "final")
		require.NoError(t, err)
		require.ErrorAs(t, out.Err, &fe)
	})
}

func TestReplayCacheForget(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		clock := newTestClock()
		k := newKeeper(t, b, WithReplayCache(100, 1<<20, time.Hour))
		other := newKeeper(t, b, WithClock(clock.Now), WithReplayCache(100, 1<<20, time.Minute))
		var runs atomic.Int32
		fn := func(context.Context) (int32, error) { return runs.Add(1), nil }
		_, err := Do(ctx, k, "s", "k", fn)
		require.NoError(t, err)
		v, err := Do(ctx, other, "s", "k", fn)
		require.NoError(t, err)
		require.EqualValues(t, 1, v)

		_, err = k.Forget(ctx, "s", "k", false)
		require.NoError(t, err)
		b.Advance(time.Millisecond)
		v, err = Do(ctx, k, "s", "k", fn)
		require.NoError(t, err)
		assert.EqualValues(t, 2, v, "Forget drops the entry of its own Keeper")

		v, err = Do(ctx, other, "s", "k", fn)
		require.NoError(t, err)
		assert.EqualValues(t, 1, v, "another Keeper replays its entry until its max age")
		clock.Advance(time.Minute)
		v, err = Do(ctx, other, "s", "k", fn)
		require.NoError(t, err)
		assert.EqualValues(t, 2, v, "then it sees the key's new result")
	})
}

func TestReplayCacheConcurrent(t *testing.T) {
	for _, coalesce := range []bool{false, true} {
		t.Run(fmt.Sprint("coalescing=", coalesce), func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				ctx := context.Background()
				k := newKeeper(t, b, WithReplayCache(4, 1<<20, time.Hour), WithCoalescing(coalesce), WithWait(time.Minute))
				const keys, workers, calls = 8, 16, 50
				var runs [keys]atomic.Int32
				var wg sync.WaitGroup
				for w := range workers {
					wg.Go(func() {
						for i := range calls {
							id := (w + i) % keys
							v, err := Do(ctx, k, "s", fmt.Sprint(id), func(context.Context) ([]byte, error) {
								runs[id].Add(1)
								return []byte(fmt.Sprint("v", id)), nil
							})
							if !assert.NoError(t, err) {
								return
							}
							assert.Equal(t, fmt.Sprint("v", id), string(v))
							v[0] = 'x' // each caller owns its value
						}
					})
				}
				wg.Wait()
				for id := range runs {
					assert.EqualValues(t, 1, runs[id].Load(), "key %d ran once", id)
				}
				st := k.ReplayCacheStats()
				assert.LessOrEqual(t, st.Entries, 4)
				assert.Positive(t, st.Hits)
			})
		})
	}
}

func TestReplayCacheInvalidConfig(t *testing.T) {
	b := redistest.Miniredis(t)
	for _, o := range []Option{
		WithReplayCache(0, 1, time.Second),
		WithReplayCache(1, 0, time.Second),
		WithReplayCache(1, 1, 0),
	} {
		_, err := NewRedis(b.Client, o)
		assert.ErrorIs(t, err, ErrInvalidConfig)
	}
	k := newKeeper(t, b)
	_, err := k.Begin(context.Background(), "s", "k", WithReplayCache(1, 1, time.Second))
	assert.ErrorIs(t, err, ErrInvalidConfig, "it does not apply to a call")
}

// BenchmarkReplayCacheHit: Do on a key whose result is in the replay cache:
// no round trip, a copy of the stored 200-byte result.
func BenchmarkReplayCacheHit(b *testing.B) {
	ctx := context.Background()
	k := newKeeper(b, redistest.Miniredis(b), WithReplayCache(1024, 1<<20, time.Hour))
	keys := benchCompleted(b, k, 64)
	fn := func(context.Context) ([]byte, error) { return nil, fmt.Errorf("ran again") }
	b.ReportAllocs()
	var next atomic.Int64
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			v, err := Do(ctx, k, "bench", keys[next.Add(1)%int64(len(keys))], fn)
			if err != nil || len(v) != benchBody {
				b.Error("no replay", err)
				return
			}
		}
	})
}

// The replay cache is filled only with what the store says a Complete
// stored: a second Complete of one claim (a caller retrying a completion
// whose first reply it never got), with another value or another retention,
// writes nothing, and must not put into the cache a result or a lifetime
// that Redis does not hold.

// TestReplayCacheKeepsTheFirstCompletion: Redis keeps the first result; the
// cache answers it too, as every Keeper without a cache does.
func TestReplayCacheKeepsTheFirstCompletion(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithReplayCache(100, 1<<20, time.Hour))
		plain := newKeeper(t, b)
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte("first"), 0))
		require.NoError(t, out.Claim.Complete(ctx, []byte("second"), 0), "a completed claim completes again without error, writing nothing")

		fromStore, err := plain.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.Equal(t, "first", string(fromStore.Value), "Redis keeps the first result")
		cached, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		assert.Equal(t, "first", string(cached.Value), "the replay cache answers a result Redis does not hold")
		assert.Equal(t, uint64(1), k.ReplayCacheStats().Hits, "answered from the cache")
	})
}

// TestReplayCacheNeverOutlivesTheStoredRetention: an entry lives never past
// the retention the Keeper stored it with; a second Complete with a longer
// retention writes nothing and must not give the entry a longer life.
func TestReplayCacheNeverOutlivesTheStoredRetention(t *testing.T) {
	b := redistest.Miniredis(t)
	ctx := context.Background()
	clock := newTestClock()
	k := newKeeper(t, b, WithClock(clock.Now), WithReplayCache(100, 1<<20, 2*time.Hour))
	out, err := k.Begin(ctx, "s", "k")
	require.NoError(t, err)
	require.NoError(t, out.Claim.Complete(ctx, []byte("v"), time.Hour))
	require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0)) // the Keeper's 24 h: nothing written

	clock.Advance(90 * time.Minute)
	b.Advance(90 * time.Minute) // Redis drops the record after its hour
	gone, err := newKeeper(t, b).Inspect(ctx, "s", "k")
	require.NoError(t, err)
	require.Equal(t, StateAbsent, gone.State)

	again, err := k.Begin(ctx, "s", "k")
	require.NoError(t, err)
	assert.NotNil(t, again.Claim, "90 minutes after a completion kept for an hour, the key is free again; the cache replayed it (replayed=%v)", again.Replayed)
}

// TestCompleteAgainIsItsOwnAnswer: the store tells a completion it stored
// from one it found done by the same token, on both forms of the completed
// record; another token is refused.
func TestCompleteAgainIsItsOwnAnswer(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b)
		s := k.store.(*redisStore)
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		id, tok := recordID("s", "k"), out.Claim.Token()
		stored, err := s.completeOnce(ctx, id, tok, seal(kindBytes, []byte("first")), time.Hour)
		require.NoError(t, err)
		assert.True(t, stored)
		stored, err = s.completeOnce(ctx, id, tok, seal(kindBytes, []byte("second")), time.Hour)
		require.NoError(t, err)
		assert.False(t, stored, "already completed by this token")
		require.NoError(t, errOf(s.Complete(ctx, id, tok, seal(kindBytes, []byte("third")), time.Hour)), "the Store contract: a retried Complete succeeds")
		_, err = s.completeOnce(ctx, id, tok+1, seal(kindBytes, []byte("other")), time.Hour)
		assert.ErrorIs(t, err, ErrLeaseLost)

		// The long form an earlier version wrote.
		rk := s.key(recordID("s", "long"))
		require.NoError(t, b.Client.Set(ctx, rk, "i1C77:1:0:0:att::"+string(seal(kindBytes, []byte("old"))), time.Hour).Err())
		stored, err = s.completeOnce(ctx, recordID("s", "long"), 77, seal(kindBytes, []byte("new")), time.Hour)
		require.NoError(t, err)
		assert.False(t, stored)
	})
}
