package idem

import (
	"context"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// BenchmarkMessages compares the two ways a consumer can use idem, on a
// real redis-server the benchmark starts, at the same concurrency
// (-idem.workers callers, default 8, on one plain client) and with the same
// stream: a fifth of the messages are redeliveries of messages handled
// before.
//
//   - consume-batch-500: Consume on batches of 500 messages; one op is a batch.
//   - do-per-message: Do for each message; one op is a message.
//   - do-first: Do for each message of a stream of new messages only, as
//     idembench's -workload first.
//
// Each reports msgs/s, the Redis CPU each message cost (script-µs/msg: the
// usec of EVALSHA and EVAL in INFO commandstats; redis-cpu-µs/msg: the
// server process's CPU, network I/O included; see redisCPU) and round trips
// per message:
//
//	go test -run '^$' -bench BenchmarkMessages -benchtime 5s .
func BenchmarkMessages(b *testing.B) {
	srv := redistest.Start(b)
	b.Run("consume-batch-500", func(b *testing.B) {
		benchMessages(b, srv, 500, func(ctx context.Context, k *Keeper, batch []string) {
			res, err := Consume(ctx, k, "bench", batch, func(s string) string { return s }, func(context.Context, string) error { return nil })
			if err != nil || !res[0].Ack {
				assert.Fail(b, "Consume", "%v %+v", err, res[0])
			}
		})
	})
	doEach := func(ctx context.Context, k *Keeper, batch []string) {
		_, err := Do(ctx, k, "bench", batch[0], func(context.Context) ([]byte, error) { return nil, nil })
		if err != nil {
			assert.NoError(b, err)
		}
	}
	b.Run("do-per-message", func(b *testing.B) { benchMessages(b, srv, 1, doEach) })
	b.Run("do-first", func(b *testing.B) {
		benchRedelivered = 0
		defer func() { benchRedelivered = 0.2 }()
		benchMessages(b, srv, 1, doEach)
	})
}

// The message benchmarks' settings.
var (
	benchWorkers     = flag.Int("idem.workers", 8, "callers the message benchmarks run at once")
	benchRedelivered = 0.2 // share of the stream handled before; do-first sets it to 0
)

// benchMessages runs b.N ops of size messages each through op, on
// -idem.workers goroutines, and reports the figures of BenchmarkMessages.
func benchMessages(b *testing.B, srv *redistest.Server, size int, op func(ctx context.Context, k *Keeper, batch []string)) {
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 4 * *benchWorkers})
	b.Cleanup(func() { client.Close() })
	var cnt redistest.Counter
	client.AddHook(&cnt)
	k, err := NewRedis(client)
	require.NoError(b, err)
	require.NoError(b, k.store.(*redisStore).LoadScripts(ctx))

	// The stream: b.N*size messages, a share of them handled before.
	msgs := b.N * size
	keys := make([]string, msgs)
	var before []string
	every := 0
	if benchRedelivered > 0 {
		every = int(1 / benchRedelivered)
	}
	for i := range keys {
		keys[i] = nextBenchKey()
		if every > 0 && i%every == every-1 {
			before = append(before, keys[i])
		}
	}
	for len(before) > 0 {
		n := min(500, len(before))
		_, err := Consume(ctx, k, "bench", before[:n], func(s string) string { return s }, func(context.Context, string) error { return nil })
		require.NoError(b, err)
		before = before[n:]
	}

	scripts0, process0 := redisCPU(b, client)
	rt0 := cnt.RoundTrips()
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for range *benchWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := next.Add(1) - 1; j < int64(b.N); j = next.Add(1) - 1 {
				op(ctx, k, keys[int(j)*size:(int(j)+1)*size])
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	b.StopTimer()
	scripts, process := redisCPU(b, client)
	b.ReportMetric(float64(msgs)/took.Seconds(), "msgs/s")
	b.ReportMetric(float64(scripts-scripts0)/float64(msgs), "script-µs/msg")
	b.ReportMetric(float64(process-process0)/float64(msgs), "redis-cpu-µs/msg")
	b.ReportMetric(float64(cnt.RoundTrips()-rt0)/float64(msgs), "roundtrips/msg")
}

// redisCPU returns the microseconds Redis has spent since its start in the
// script commands (EVALSHA and EVAL), by INFO commandstats: idem's whole work
// on the server, the commands a script calls included (commandstats counts
// those again under their own names, which are left out), network I/O
// excluded; and in all, by INFO cpu (used_cpu_sys plus used_cpu_user), I/O
// included.
func redisCPU(tb testing.TB, c *redis.Client) (scripts, process int64) {
	info, err := c.Info(context.Background(), "commandstats", "cpu").Result()
	require.NoError(tb, err)
	for _, line := range strings.Split(info, "\n") {
		name, stats, ok := strings.Cut(strings.TrimSpace(line), ":")
		switch {
		case !ok:
		case name == "cmdstat_evalsha", name == "cmdstat_eval":
			for _, f := range strings.Split(stats, ",") {
				if v, ok := strings.CutPrefix(f, "usec="); ok {
					n, err := strconv.ParseInt(v, 10, 64)
					require.NoError(tb, err, "%s", line)
					scripts += n
				}
			}
		case name == "used_cpu_sys", name == "used_cpu_user":
			sec, err := strconv.ParseFloat(stats, 64)
			require.NoError(tb, err, "%s", line)
			process += int64(sec * 1e6)
		}
	}
	return scripts, process
}

func TestRedisCPUReadsInfo(t *testing.T) {
	b := redistest.Real(t)
	s0, p0 := redisCPU(t, b.Client)
	for i := range 200 {
		require.NoError(t, b.Client.Eval(context.Background(), "return redis.call('SET', KEYS[1], 'v')", []string{fmt.Sprint("k", i)}).Err())
	}
	s1, p1 := redisCPU(t, b.Client)
	assert.Greater(t, s1, s0)
	assert.GreaterOrEqual(t, p1, p0)
}

// BenchmarkMessagesAlternating compares, on a real redis-server, Consume on
// batches of 500 messages (a fifth of them redeliveries) with Do on new
// messages, one at a time (idembench's -workload first), in alternating
// one-second slices, so that both see the same machine; one op is a pair of
// slices. It reports each side's msgs/s and Redis CPU per message (as
// BenchmarkMessages), and the ratios:
//
//	go test -run '^$' -bench BenchmarkMessagesAlternating -benchtime 10x .
func BenchmarkMessagesAlternating(b *testing.B) {
	if testing.Short() {
		b.Skip("runs one-second slices per op: run it without -short")
	}
	srv := redistest.Start(b)
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 4 * *benchWorkers})
	b.Cleanup(func() { client.Close() })
	k, err := NewRedis(client)
	require.NoError(b, err)
	require.NoError(b, k.store.(*redisStore).LoadScripts(ctx))
	ident := func(s string) string { return s }
	ok := func(context.Context, string) error { return nil }
	var batch, first sliceTotals
	for i := 0; i < b.N; i++ {
		batch.add(benchSlice(b, client, time.Second, func() func() int {
			var last []string // each batch redelivers a fifth of the one before
			return func() int {
				msgs := make([]string, 0, 500)
				if len(last) > 0 {
					msgs = append(msgs, last[:100]...)
				}
				for len(msgs) < 500 {
					msgs = append(msgs, nextBenchKey())
				}
				if _, err := Consume(ctx, k, "bench", msgs, ident, ok); err != nil {
					assert.NoError(b, err)
				}
				last = msgs[len(msgs)-400:]
				return len(msgs)
			}
		}))
		first.add(benchSlice(b, client, time.Second, func() func() int {
			return func() int {
				_, err := Do(ctx, k, "bench", nextBenchKey(), func(context.Context) ([]byte, error) { return nil, nil })
				if err != nil {
					assert.NoError(b, err)
				}
				return 1
			}
		}))
	}
	b.ReportMetric(batch.rate(), "batch-msgs/s")
	b.ReportMetric(first.rate(), "first-msgs/s")
	b.ReportMetric(batch.rate()/first.rate(), "x-msgs/s")
	b.ReportMetric(batch.cpu(), "batch-redis-cpu-µs/msg")
	b.ReportMetric(first.cpu(), "first-redis-cpu-µs/msg")
	b.ReportMetric(batch.cpu()/first.cpu(), "x-cpu")
}

// sliceTotals adds up the slices of one side of BenchmarkMessagesAlternating.
type sliceTotals struct {
	msgs, cpuUsec int64
	took          time.Duration
}

func (s *sliceTotals) add(o sliceTotals) {
	s.msgs, s.cpuUsec, s.took = s.msgs+o.msgs, s.cpuUsec+o.cpuUsec, s.took+o.took
}

func (s *sliceTotals) rate() float64 { return float64(s.msgs) / s.took.Seconds() }
func (s *sliceTotals) cpu() float64  { return float64(s.cpuUsec) / float64(s.msgs) }

// benchSlice runs ops, each made by newOp for one worker and returning the
// messages it handled, on -idem.workers workers for d, and returns the
// messages, the time and the Redis process CPU they took.
func benchSlice(b *testing.B, client *redis.Client, d time.Duration, newOp func() func() int) sliceTotals {
	_, cpu0 := redisCPU(b, client)
	var msgs atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	end := start.Add(d)
	for range *benchWorkers {
		op := newOp()
		wg.Go(func() {
			for time.Now().Before(end) {
				msgs.Add(int64(op()))
			}
		})
	}
	wg.Wait()
	took := time.Since(start)
	_, cpu1 := redisCPU(b, client)
	return sliceTotals{msgs: msgs.Load(), cpuUsec: cpu1 - cpu0, took: took}
}
