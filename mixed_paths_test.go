package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// The paths that claim a key, taken one after another on the same few keys
// with time moving between them: Do, Begin (completed, released, or left
// pending as by a process that died), BeginBatch with compact claims or in
// records, Consume with markers or, on a Keeper WithoutMarkers, in records
// (handlers that succeed, fail, fail finally, or record a checkpoint
// first, which moves a compact claim to a record of its own).
// Whatever path made a key's record, claim, marker or checkpoint, every
// other path must see it: a key whose outcome is stored does not run again
// before its retention ends, nor one whose lease is live. This guards
// against a path that writes where another does not look (a claim that
// reads the index but not a record Do made, say).

// mixLease, mixRetention, mixErrorRetention and mixMarkerRetention are the
// Keeper's, chosen so that no sum of the clock's steps (mixSteps) lands on
// one of them.
const (
	mixLease           = 2300 * time.Millisecond
	mixRetention       = 10300 * time.Millisecond
	mixErrorRetention  = 5300 * time.Millisecond
	mixMarkerRetention = 40300 * time.Millisecond
)

var mixSteps = [...]time.Duration{50 * time.Millisecond, 700 * time.Millisecond, 2500 * time.Millisecond, 11 * time.Second, 45 * time.Second}

// mixWorld is a Keeper on a miniredis, whose clock the steps move, or on
// a redis-server (m nil), whose clock they cannot: there the steps that
// move it do nothing, and a run takes far less than a lease.
type mixWorld struct {
	m *miniredis.Miniredis
	// k keeps markers; plain, on the same store's prefix, keeps every
	// claim in a record of its own (WithoutMarkers).
	k, plain *Keeper
	mu       sync.Mutex
	now      time.Time
	start    time.Time
	scope    atomic.Int64
}

// newMixWorld makes a mixWorld on client, a miniredis's when m is set.
func newMixWorld(t testing.TB, client *redis.Client, m *miniredis.Miniredis) *mixWorld {
	w := &mixWorld{m: m, now: time.Unix(1_800_000_000, 0)}
	if m != nil {
		m.SetTime(w.now)
	}
	w.start = w.clock()
	opts := []Option{WithLease(mixLease), WithRetention(mixRetention), WithErrorRetention(mixErrorRetention),
		WithMarkerRetention(mixMarkerRetention), WithClock(w.clock), WithCoalescing(false)}
	var err error
	w.k, err = NewRedis(client, opts...)
	require.NoError(t, err)
	w.plain, err = NewRedis(client, append(opts, WithoutMarkers())...)
	require.NoError(t, err)
	return w
}

// newMixMiniredis makes a mixWorld on a miniredis of its own.
func newMixMiniredis(t testing.TB) *mixWorld {
	m := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { c.Close() })
	return newMixWorld(t, c, m)
}

func (w *mixWorld) clock() time.Time {
	if w.m == nil {
		return time.Now()
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.now
}

// advance moves Redis's clock, its keys' time to live and the Keeper's
// clock by d, on a miniredis.
func (w *mixWorld) advance(d time.Duration) {
	if w.m == nil {
		return
	}
	w.mu.Lock()
	w.now = w.now.Add(d)
	now := w.now
	w.mu.Unlock()
	w.m.SetTime(now)
	w.m.FastForward(d)
}

// mixKeys is how many keys a run's steps share.
const mixKeys = 4

// mixModel is what a run knows of each key: until when it must not run
// (its outcome stored, or its lease live), and whether it ever ran.
type mixModel struct {
	w     *mixWorld
	scope string
	quiet [mixKeys]time.Time
	ran   [mixKeys]bool
	trace []string
	// failed is what went wrong inside an operation (which may run on a
	// goroutine of its own), checked once the step returns.
	failed string
}

// run records that key i's operation starts now, by path: a key that is
// quiet ran again. (A key never seen before that did not run is caught by
// the step.)
func (md *mixModel) run(i int, path string) {
	now := md.w.clock()
	md.trace = append(md.trace, fmt.Sprintf("%s runs key %d at +%s", path, i, now.Sub(md.w.start)))
	if now.Before(md.quiet[i]) && md.failed == "" {
		md.failed = fmt.Sprintf("key %d ran again by %s %s before its outcome's retention or its lease ended (%s):\n%v",
			i, path, md.quiet[i].Sub(now), md.quiet[i].Sub(md.w.start), md.trace)
	}
	md.ran[i] = true
}

// quietFor records that key i must not run for d from now.
func (md *mixModel) quietFor(i int, d time.Duration) {
	if u := md.w.clock().Add(d); u.After(md.quiet[i]) {
		md.quiet[i] = u
	}
}

// expected fails on an error no path should give here.
func (md *mixModel) expected(t testing.TB, path string, err error) {
	if err == nil || errors.Is(err, ErrInProgress) || errors.Is(err, ErrResultExpired) || errors.Is(err, errMixFailed) {
		return
	}
	var fe *FinalError
	if errors.As(err, &fe) {
		return
	}
	t.Fatalf("%s: unexpected error %v:\n%v", path, err, md.trace)
}

var errMixFailed = errors.New("mix: the operation failed")

// mixRun takes the steps ops describe, two bytes a step: what to do, and
// on which keys or how far the clock moves.
func mixRun(t testing.TB, w *mixWorld, ops []byte) {
	ctx := context.Background()
	md := &mixModel{w: w, scope: fmt.Sprint("mix-", w.scope.Add(1))}
	key := func(i int) string { return fmt.Sprint("k", i) }
	fresh := func(i int) bool { return !md.ran[i] }
	for len(ops) >= 2 {
		op, arg := ops[0], int(ops[1])
		ops = ops[2:]
		i := arg % mixKeys
		switch op % 9 {
		case 0, 1, 2: // Do: a result, a final error, a failure
			wasFresh := fresh(i)
			// []byte: Do hands over as is a result Claim.Complete stored.
			_, err := Do(ctx, w.k, md.scope, key(i), func(context.Context) ([]byte, error) {
				md.run(i, [...]string{"Do (a result)", "Do (final)", "Do (fails)"}[op%9])
				switch op % 9 {
				case 0:
					md.quietFor(i, mixRetention)
					return []byte("v"), nil
				case 1:
					md.quietFor(i, mixErrorRetention)
					return nil, Final(errors.New("final"))
				}
				return nil, errMixFailed
			})
			md.expected(t, "Do", err)
			require.False(t, wasFresh && !md.ran[i], "Do did not run a new key: %v", err)
		case 3, 4, 5: // Begin: completed, released, or left pending
			wasFresh := fresh(i)
			out, err := w.k.Begin(ctx, md.scope, key(i))
			md.expected(t, "Begin", err)
			if err == nil && out.Claim != nil {
				md.run(i, [...]string{"Begin (completed)", "Begin (released)", "Begin (left pending)"}[op%9-3])
				switch op % 9 {
				case 3:
					require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))
					md.quietFor(i, mixRetention)
				case 4:
					require.NoError(t, out.Claim.Release(ctx))
				default:
					md.quietFor(i, mixLease)
				}
			}
			require.False(t, wasFresh && !md.ran[i], "Begin did not claim a new key: %v", err)
		case 6: // BeginBatch, with compact claims or in records, completed
			keys, idx := md.batch(arg)
			var bopts []Option
			if arg&0x40 != 0 {
				bopts = append(bopts, withCompactClaims())
			}
			res, err := w.k.batchBegin(ctx, md.scope, keys, bopts...)
			require.NoError(t, err)
			var items []completion
			var claimed []int
			for j, r := range res {
				md.expected(t, "BeginBatch", r.Err)
				if r.Err == nil && r.Outcome.Claim != nil {
					md.run(idx[j], "BeginBatch")
					items = append(items, completion{Claim: r.Outcome.Claim})
					claimed = append(claimed, idx[j])
				}
			}
			for _, err := range w.k.completeClaims(ctx, items) {
				require.NoError(t, err)
			}
			for _, i := range claimed {
				md.quietFor(i, mixRetention)
			}
		case 7: // Consume
			keys, idx := md.batch(arg)
			fate := map[string]int{}
			for j, k := range keys {
				fate[k] = (arg>>4 + j) % 5
			}
			wasFresh := make([]bool, len(idx))
			for j, i := range idx {
				wasFresh[j] = fresh(i)
			}
			keeper := w.k
			if arg&0x80 != 0 {
				keeper = w.plain // a record a message
			}
			res, err := Consume(ctx, keeper, md.scope, keys, func(k string) string { return k }, func(ctx context.Context, k string) error {
				j := slicesIndex(keys, k)
				md.run(idx[j], [...]string{"Consume (handled)", "Consume (fails)", "Consume (final)", "Consume (checkpoint, handled)", "Consume (checkpoint, fails)"}[fate[k]])
				switch fate[k] {
				case 1:
					return errMixFailed
				case 2:
					return Final(errors.New("final"))
				case 3, 4:
					c, ok := ClaimFromContext(ctx)
					if !ok {
						md.failed = "a handler's context carries no claim"
						return errMixFailed
					}
					if err := c.Checkpoint(ctx, "step", []byte("1")); err != nil && md.failed == "" {
						md.failed = fmt.Sprintf("checkpoint of key %d: %v", idx[j], err)
					}
					if fate[k] == 4 {
						return errMixFailed
					}
				}
				return nil
			})
			require.NoError(t, err)
			for j, r := range res {
				if r.Status == MessageRetry && !r.Ran {
					require.ErrorIs(t, r.Err, ErrInProgress, "Consume of key %d: %v", idx[j], md.trace)
				}
				if r.Status == MessageRejected {
					t.Fatalf("Consume rejected key %d: %v\n%v", idx[j], r.Err, md.trace)
				}
				require.False(t, wasFresh[j] && !r.Ran, "Consume did not run a new key %d: %v", idx[j], r.Status)
				if r.Status != MessageHandled {
					continue
				}
				switch {
				case fate[keys[j]] == 2:
					md.quietFor(idx[j], mixErrorRetention)
				case keeper == w.plain:
					md.quietFor(idx[j], mixRetention) // a record, kept for the retention
				default:
					md.quietFor(idx[j], mixMarkerRetention)
				}
			}
		default:
			w.advance(mixSteps[arg%len(mixSteps)])
			md.trace = append(md.trace, fmt.Sprint("clock +", mixSteps[arg%len(mixSteps)]))
		}
		if md.failed != "" {
			t.Fatal(md.failed)
		}
	}
}

// batch returns the keys (distinct, one to three) a batch step takes from
// its argument, and their numbers.
func (md *mixModel) batch(arg int) ([]string, []int) {
	n := 1 + (arg>>2)%3
	keys, idx := make([]string, n), make([]int, n)
	for j := range n {
		idx[j] = (arg + j) % mixKeys
		keys[j] = fmt.Sprint("k", idx[j])
	}
	return keys, idx
}

func slicesIndex(s []string, v string) int {
	for i, x := range s {
		if x == v {
			return i
		}
	}
	return -1
}

// TestMixedPathsOnSharedKeys runs random sequences of the paths on shared
// keys (see mixRun), deterministic from fixed seeds: on miniredis with the
// clock moving, and on redis-server with it standing still.
func TestMixedPathsOnSharedKeys(t *testing.T) {
	runs := func(t *testing.T, w *mixWorld, n int) {
		if testing.Short() {
			n /= 5
		}
		for seed := range n {
			r := rand.New(rand.NewPCG(uint64(seed), 7))
			ops := make([]byte, 2*(10+r.IntN(40)))
			for j := range ops {
				ops[j] = byte(r.UintN(256))
			}
			mixRun(t, w, ops)
		}
	}
	t.Run("miniredis", func(t *testing.T) { runs(t, newMixMiniredis(t), 300) })
	t.Run("redis", func(t *testing.T) {
		b := redistest.Real(t)
		runs(t, newMixWorld(t, b.Client, nil), 100)
	})
}

// FuzzMixedPaths is TestMixedPathsOnSharedKeys on the fuzzer's sequences.
// Fuzz it with -fuzztime as a count (-fuzztime 2000x): the miniredis under
// it keeps what each run wrote.
func FuzzMixedPaths(f *testing.F) {
	f.Add([]byte{0, 0, 8, 3, 7, 0, 8, 3, 7, 0})
	f.Add([]byte{5, 1, 7, 1, 8, 2, 7, 1, 8, 3, 7, 1})
	f.Add([]byte{7, 0x30, 8, 3, 0, 0, 3, 1, 7, 0x31})
	f.Add([]byte{6, 0, 8, 2, 0, 0, 8, 3, 7, 0, 8, 4, 7, 0})
	w := newMixMiniredis(f)
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 200 {
			ops = ops[:200]
		}
		mixRun(t, w, ops)
	})
}
