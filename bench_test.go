package idem

import (
	"bytes"
	"context"
	"errors"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The benchmarks run every path on an embedded miniredis, and on a real
// redis-server they start themselves when one is on PATH (sub-benchmarks
// "miniredis" and "redis"; parallel ones also "redis-autopipeline", through
// go-redis's AutoPipeliner in the unordered setting openRedisStore suggests).
// Each reports allocations and "roundtrips/op": commands sent alone plus
// pipelines, counted by a go-redis hook, so a batch of the AutoPipeliner
// counts once for all the calls it carries.
//
//	go test -run '^$' -bench . -benchmem
//
// The Redis answer is the same on both; miniredis runs scripts in a Go Lua
// interpreter, several times slower than Redis, so only the "redis" figures
// say anything about speed.

// benchBody is the size of the result the benchmarks store: a typical small
// JSON answer.
const benchBody = 200

// benchKeys makes keys unique across benchmarks and their rounds.
var benchKeys atomic.Int64

func nextBenchKey() string { return "bench-" + strconv.FormatInt(benchKeys.Add(1), 10) }

// benchKeysFor returns n fresh keys, made before the timer starts.
func benchKeysFor(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = nextBenchKey()
	}
	return keys
}

// benchBackend is a Redis the benchmarks share across rounds: one server per
// top-level benchmark, not one per b.N.
type benchBackend struct {
	name   string
	client redis.Scripter
	cnt    *redistest.Counter
}

// benchBackends starts the Redis backends of one top-level benchmark: an
// embedded miniredis and, if redis-server is on PATH, a real one; with
// autopipeline, also the real one through an AutoPipeliner.
func benchBackends(b *testing.B, autopipeline bool) []*benchBackend {
	var out []*benchBackend
	mini := redistest.Miniredis(b)
	cnt := &redistest.Counter{}
	mini.Client.AddHook(cnt)
	out = append(out, &benchBackend{name: "miniredis", client: mini.Client, cnt: cnt})
	if _, err := exec.LookPath("redis-server"); err != nil && !redistest.Required() {
		return append(out, &benchBackend{name: "redis"}) // skipped
	}
	c := redistest.Start(b).Client(b)
	cnt = &redistest.Counter{}
	c.AddHook(cnt)
	out = append(out, &benchBackend{name: "redis", client: c, cnt: cnt})
	if autopipeline {
		ap, err := c.AutoPipelineWithOptions(unorderedAutoPipeline())
		require.NoError(b, err, "AutoPipeline")
		b.Cleanup(func() { ap.Close() })
		out = append(out, &benchBackend{name: "redis-autopipeline", client: ap, cnt: cnt})
	}
	return out
}

// benchEach runs, on each backend, the operation that setup makes with a
// Keeper whose scripts are loaded, through run (sequential or parallel), and
// reports allocations and round trips per operation. setup's own calls are
// neither timed nor counted.
func benchEach(b *testing.B, autopipeline bool, setup func(b *testing.B, k *Keeper) func() error, run func(b *testing.B, op func() error), opts ...Option) {
	for _, be := range benchBackends(b, autopipeline) {
		b.Run(be.name, func(b *testing.B) {
			if be.client == nil {
				b.Skip("redis-server not on PATH")
			}
			s, err := openRedisStore(be.client)
			require.NoError(b, err)
			require.NoError(b, s.LoadScripts(context.Background()))
			k, err := keeperOn(s, opts...)
			require.NoError(b, err)
			op := setup(b, k)
			b.ReportAllocs()
			before := be.cnt.RoundTrips()
			b.ResetTimer()
			run(b, op)
			b.StopTimer()
			b.ReportMetric(float64(be.cnt.RoundTrips()-before)/float64(b.N), "roundtrips/op")
		})
	}
}

// In the timed loops, testify is called only once a check has failed:
// require.NoError and its kin call b.Helper every time, a lock and a stack
// walk (about 100ns, and a lock all parallel callers contend for), which the
// timer would count.

// parallel runs op b.N times over GOMAXPROCS*128 goroutines (256 on two
// cores): as many callers as a busy server has requests in flight, enough for
// the AutoPipeliner to batch.
func parallel(b *testing.B, op func() error) {
	b.SetParallelism(128)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := op(); err != nil {
				assert.NoError(b, err) // not the benchmark's goroutine: no FailNow
				return
			}
		}
	})
}

func sequential(b *testing.B, op func() error) {
	for i := 0; i < b.N; i++ {
		if err := op(); err != nil {
			require.NoError(b, err)
		}
	}
}

// benchModes runs the operation that setup makes sequentially and in
// parallel on every backend.
func benchModes(b *testing.B, setup func(b *testing.B, k *Keeper) func() error, opts ...Option) {
	b.Run("sequential", func(b *testing.B) { benchEach(b, false, setup, sequential, opts...) })
	b.Run("parallel", func(b *testing.B) { benchEach(b, true, setup, parallel, opts...) })
}

var benchResult = bytes.Repeat([]byte("x"), benchBody)

// BenchmarkFirstExecution: Do on a new key, claim then complete: two round
// trips.
func BenchmarkFirstExecution(b *testing.B) {
	ctx := context.Background()
	fn := func(ctx context.Context) ([]byte, error) { return benchResult, nil }
	benchModes(b, func(b *testing.B, k *Keeper) func() error {
		keys := benchKeysFor(b.N)
		var next atomic.Int64
		return func() error {
			_, err := Do(ctx, k, "bench", keys[next.Add(1)-1], fn)
			return err
		}
	})
}

// BenchmarkBeginComplete: the first execution through Keeper.Begin and
// Claim.Complete, without Do's lease renewal and codec.
func BenchmarkBeginComplete(b *testing.B) {
	ctx := context.Background()
	benchModes(b, func(b *testing.B, k *Keeper) func() error {
		keys := benchKeysFor(b.N)
		var next atomic.Int64
		return func() error {
			out, err := k.Begin(ctx, "bench", keys[next.Add(1)-1])
			if err != nil {
				return err
			}
			return out.Claim.Complete(ctx, benchResult, 0)
		}
	})
}

// benchCompleted stores the result of n keys and returns them.
func benchCompleted(b *testing.B, k *Keeper, n int, opts ...Option) []string {
	b.Helper()
	ctx := context.Background()
	keys := make([]string, n)
	for i := range keys {
		keys[i] = nextBenchKey()
		_, err := Do(ctx, k, "bench", keys[i], func(ctx context.Context) ([]byte, error) { return benchResult, nil }, opts...)
		require.NoError(b, err)
	}
	return keys
}

// BenchmarkReplay: Do on a completed key: one round trip, and the stored
// 200-byte result decoded.
func BenchmarkReplay(b *testing.B) {
	ctx := context.Background()
	fn := func(ctx context.Context) ([]byte, error) { return nil, errors.New("ran again") }
	benchModes(b, func(b *testing.B, k *Keeper) func() error {
		keys := benchCompleted(b, k, 64)
		var next atomic.Int64
		return func() error {
			v, err := Do(ctx, k, "bench", keys[next.Add(1)%int64(len(keys))], fn)
			if err == nil && len(v) != benchBody {
				err = errors.New("short replay")
			}
			return err
		}
	})
}

// BenchmarkReplayStruct: Do on a completed key whose result is a struct,
// decoded by the codec on every replay.
func BenchmarkReplayStruct(b *testing.B) {
	ctx := context.Background()
	want := receipt{ID: "ch_3MmlLrLkdIwHu7ix0snN0B15", Amount: 4200, Tags: []string{"card", "eur"}}
	benchModes(b, func(b *testing.B, k *Keeper) func() error {
		key := nextBenchKey()
		_, err := Do(ctx, k, "bench", key, func(ctx context.Context) (receipt, error) { return want, nil })
		require.NoError(b, err)
		return func() error {
			v, err := Do(ctx, k, "bench", key, func(ctx context.Context) (receipt, error) { return receipt{}, errors.New("ran again") })
			if err == nil && v.Amount != want.Amount {
				err = errors.New("wrong replay")
			}
			return err
		}
	})
}

// BenchmarkInProgress: Do on a key another attempt holds: one round trip,
// ErrInProgress.
func BenchmarkInProgress(b *testing.B) {
	ctx := context.Background()
	fn := func(ctx context.Context) ([]byte, error) { return nil, errors.New("ran") }
	benchModes(b, func(b *testing.B, k *Keeper) func() error {
		key := nextBenchKey()
		_, err := k.Begin(ctx, "bench", key)
		require.NoError(b, err)
		return func() error {
			if _, err := Do(ctx, k, "bench", key, fn); !errors.Is(err, ErrInProgress) {
				return errors.New("not in progress: " + errString(err))
			}
			return nil
		}
	})
}

// BenchmarkMismatch: Do with another fingerprint than the stored one: one
// round trip, ErrMismatch.
func BenchmarkMismatch(b *testing.B) {
	ctx := context.Background()
	fn := func(ctx context.Context) ([]byte, error) { return nil, errors.New("ran") }
	other := WithFingerprint([]byte("another body"))
	benchModes(b, func(b *testing.B, k *Keeper) func() error {
		key := benchCompleted(b, k, 1, WithFingerprint([]byte("the body")))[0]
		return func() error {
			if _, err := Do(ctx, k, "bench", key, fn, other); !errors.Is(err, ErrMismatch) {
				return errors.New("no mismatch: " + errString(err))
			}
			return nil
		}
	})
}

// BenchmarkCoalescedStorm: many concurrent Do calls on one key whose
// operation is running, with coalescing on: answered in the process, without
// a round trip.
func BenchmarkCoalescedStorm(b *testing.B) {
	ctx := context.Background()
	fn := func(ctx context.Context) ([]byte, error) { return nil, errors.New("ran") }
	benchEach(b, false, func(b *testing.B, k *Keeper) func() error {
		key := nextBenchKey()
		held, err := k.Begin(ctx, "bench", key)
		require.NoError(b, err)
		b.Cleanup(func() { _ = held.Claim.Release(ctx) })
		return func() error {
			if _, err := Do(ctx, k, "bench", key, fn); !errors.Is(err, ErrInProgress) {
				return errors.New("not in progress: " + errString(err))
			}
			return nil
		}
	}, parallel, WithCoalescing(true))
}

// BenchmarkCodec: what a stored result costs in the process alone: the
// codec's encoding and decoding, and the envelope around it.
func BenchmarkCodec(b *testing.B) {
	v := receipt{ID: "ch_3MmlLrLkdIwHu7ix0snN0B15", Amount: 4200, Tags: []string{"card", "eur"}}
	c := msgpackCodec{}
	b.Run("msgpack-struct", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			body, err := c.Marshal(v)
			if err != nil {
				require.NoError(b, err)
			}
			kind, got, err := open(seal(kindValue, body))
			if err != nil || kind != kindValue {
				require.NoError(b, err)
				require.Equal(b, kindValue, kind)
			}
			var back receipt
			if err := c.Unmarshal(got, &back); err != nil {
				require.NoError(b, err)
			}
		}
	})
	b.Run("msgpack-bytes", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			body, err := c.Marshal(benchResult)
			if err != nil {
				require.NoError(b, err)
			}
			_, got, err := open(seal(kindValue, body))
			if err != nil {
				require.NoError(b, err)
			}
			var back []byte
			if err := c.Unmarshal(got, &back); err != nil {
				require.NoError(b, err)
			}
		}
	})
	b.Run("envelope", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, _, err := open(seal(kindBytes, benchResult)); err != nil {
				require.NoError(b, err)
			}
		}
	})
	b.Run("record-id", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = recordID("tenant-42", "8e2bd1c4-1f6f-4c6c-a7f0-2b1f0d0c4e9a")
		}
	})
}

func errString(err error) string {
	if err == nil {
		return "nil"
	}
	return err.Error()
}

// memStore is a store in a map, only as faithful as the benchmarks of idem's
// own cost need: claims of absent records and replays of completed ones.
// The steps those benchmarks never take (batches, checkpoints, the
// operator's) are left to the nil store it embeds: taking one panics.
type memStore struct {
	recordStore
	mu sync.Mutex
	m  map[string][]byte // nil value: claimed
}

func (s *memStore) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.m[id]
	switch {
	case !ok:
		s.m[id] = nil
		return claimReply{Status: statusClaimed, Token: 1, Attempt: 1}, nil
	case v == nil:
		return claimReply{Status: statusInProgress, LeaseLeft: req.Lease}, nil
	}
	return claimReply{Status: statusCompleted, Token: 1, Attempt: 1, Value: bytes.Clone(v)}, nil
}

func (s *memStore) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[id] = bytes.Clone(value)
	return true, nil
}

func (s *memStore) Release(ctx context.Context, id string, token int64, keep time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, id)
	return nil
}

func (s *memStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	return nil
}

// BenchmarkInProcess measures what idem itself costs per call, with a store
// in memory instead of Redis: the floor under every figure above. Paths:
// Do's first execution and replay of a []byte result ("first", "replay"),
// of a struct ("first-struct", "replay-struct") and of a string
// ("replay-string"); Begin then Claim.Complete ("begin-complete"); Begin on
// a completed key ("begin-replay", what the HTTP middleware does); and a
// KeepAlive started and stopped on a held claim ("keepalive"). Each runs on
// a plain Keeper, with coalescing, and with a replay cache ("cached", whose
// replays are hits).
//
//	go test -run '^$' -bench 'BenchmarkInProcess' -benchmem -benchtime 20000x -count 3 .
func BenchmarkInProcess(b *testing.B) {
	modes := []struct {
		name string
		opts []Option
	}{
		{"plain", nil},
		{"coalescing", []Option{WithCoalescing(true)}},
		{"cached", []Option{WithReplayCache(1<<16, 64<<20, time.Hour)}},
	}
	for _, m := range modes {
		k, err := keeperOn(&memStore{m: map[string][]byte{}}, m.opts...)
		require.NoError(b, err)
		for _, p := range inProcessPaths {
			b.Run(p.name+"/"+m.name, func(b *testing.B) {
				op := p.setup(b, k)
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := op(i); err != nil {
						require.NoError(b, err)
					}
				}
			})
		}
	}
}

// inProcessPaths are the paths of BenchmarkInProcess: setup, untimed,
// returns the operation of round i.
var inProcessPaths = []struct {
	name  string
	setup func(b *testing.B, k *Keeper) func(i int) error
}{
	{"first", func(b *testing.B, k *Keeper) func(int) error {
		return firstEach(b, func(key string) error { _, err := Do(context.Background(), k, "bench", key, bytesResult); return err })
	}},
	{"first-struct", func(b *testing.B, k *Keeper) func(int) error {
		return firstEach(b, func(key string) error { _, err := Do(context.Background(), k, "bench", key, structResult); return err })
	}},
	{"begin-complete", func(b *testing.B, k *Keeper) func(int) error {
		ctx := context.Background()
		return firstEach(b, func(key string) error {
			out, err := k.Begin(ctx, "bench", key)
			if err != nil {
				return err
			}
			return out.Claim.Complete(ctx, benchResult, 0)
		})
	}},
	{"replay", func(b *testing.B, k *Keeper) func(int) error {
		return replayEach(b, k, bytesResult, func(v []byte) bool { return len(v) == benchBody })
	}},
	{"replay-struct", func(b *testing.B, k *Keeper) func(int) error {
		return replayEach(b, k, structResult, func(v receipt) bool { return v.Amount == benchReceipt.Amount })
	}},
	{"replay-string", func(b *testing.B, k *Keeper) func(int) error {
		fn := func(context.Context) (string, error) { return string(benchResult), nil }
		return replayEach(b, k, fn, func(v string) bool { return len(v) == benchBody })
	}},
	{"begin-replay", func(b *testing.B, k *Keeper) func(int) error {
		ctx := context.Background()
		key := nextBenchKey()
		out, err := k.Begin(ctx, "bench", key)
		require.NoError(b, err)
		require.NoError(b, out.Claim.Complete(ctx, benchResult, 0))
		return func(int) error {
			out, err := k.Begin(ctx, "bench", key)
			if err == nil && len(out.Value) != benchBody {
				err = errors.New("wrong replay")
			}
			return err
		}
	}},
	{"keepalive", func(b *testing.B, k *Keeper) func(int) error {
		ctx := context.Background()
		out, err := k.Begin(ctx, "bench", nextBenchKey())
		require.NoError(b, err)
		return func(int) error {
			_, stop := out.Claim.KeepAlive(ctx)
			return stop()
		}
	}},
}

var benchReceipt = receipt{ID: "ch_3MmlLrLkdIwHu7ix0snN0B15", Amount: 4200, Tags: []string{"card", "eur"}}

func bytesResult(context.Context) ([]byte, error)   { return benchResult, nil }
func structResult(context.Context) (receipt, error) { return benchReceipt, nil }

// firstEach returns an operation that calls first with a fresh key each
// round, the keys made before the timer starts.
func firstEach(b *testing.B, first func(key string) error) func(int) error {
	keys := benchKeysFor(b.N)
	return func(i int) error { return first(keys[i]) }
}

// replayEach completes a key with fn's result and returns an operation that
// replays it with Do, checking the result with ok.
func replayEach[T any](b *testing.B, k *Keeper, fn func(context.Context) (T, error), ok func(T) bool) func(int) error {
	ctx := context.Background()
	key := nextBenchKey()
	_, err := Do(ctx, k, "bench", key, fn)
	require.NoError(b, err)
	return func(int) error {
		v, err := Do(ctx, k, "bench", key, fn)
		if err == nil && !ok(v) {
			err = errors.New("wrong replay")
		}
		return err
	}
}
