package main

import (
	"bytes"
	"context"
	"slices"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPacer drives a pacer by a clock of its own: the arrivals of one
// caller, evenly spaced from each start, what a call takes of them, and
// the sums of the slices.
func TestPacer(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	ms := func(f float64) time.Time { return t0.Add(time.Duration(f * float64(time.Millisecond))) }

	// 400/s over 4 callers: 100/s each, 10ms apart; the first of caller 0
	// a quarter of an interval after the start.
	p := newPacer(400, 0, 4)
	p.restart(t0)
	assert.Zero(t, p.arrived(t0))
	assert.Zero(t, p.due(t0))
	assert.Zero(t, p.arrived(t0.Add(-time.Second)), "nothing arrives before the start")
	assert.Equal(t, ms(2.5), p.next(), "the first arrives after a quarter of an interval")
	assert.Zero(t, p.arrived(ms(2.5).Add(-time.Nanosecond)))
	assert.EqualValues(t, 1, p.arrived(ms(2.5)))
	assert.EqualValues(t, 1, p.arrived(ms(12.4)))
	assert.EqualValues(t, 2, p.arrived(ms(12.5)))
	assert.EqualValues(t, 100, p.arrived(ms(1000)), "100 in a second")

	assert.Equal(t, 30, p.take(ms(1000), 30), "at most the limit")
	assert.EqualValues(t, 70, p.due(ms(1000)))
	assert.Equal(t, 70, p.take(ms(1000), 100), "what is due, below the limit")
	assert.Zero(t, p.due(ms(1000)))
	assert.Zero(t, p.take(ms(1000), 100), "nothing is due")
	assert.Equal(t, ms(1002.5), p.next(), "the 101st")
	assert.Equal(t, 1, p.take(ms(1002.5), 100))
	p.settle(ms(1005), true)
	assert.EqualValues(t, 101, p.arrivedSum)
	assert.EqualValues(t, 101, p.takenSum)

	// A slice that starts again later: no backlog from the time between.
	p.restart(ms(5000))
	assert.Zero(t, p.due(ms(5000)), "nothing arrived while the slice did not run")
	assert.Equal(t, ms(5002.5), p.next())
	assert.Equal(t, 5, p.take(ms(5042.5), 100))
	p.settle(ms(5100), true)
	assert.EqualValues(t, 101+10, p.arrivedSum, "10 arrived in the slice's 100ms")
	assert.EqualValues(t, 101+5, p.takenSum)

	// A stream that ran out: what arrived after is not counted.
	p.restart(ms(6000))
	assert.Equal(t, 3, p.take(ms(6030), 100))
	p.settle(ms(7000), false)
	assert.EqualValues(t, 111+3, p.arrivedSum)
	assert.EqualValues(t, 106+3, p.takenSum)
}

// TestPacerCallersInterleave checks that the callers' arrivals, each at
// the rate over the callers, are together evenly spaced at the rate.
func TestPacerCallersInterleave(t *testing.T) {
	const callers = 4
	var all []time.Duration
	for i := range callers {
		p := newPacer(400, i, callers)
		for k := int64(1); k <= 10; k++ {
			all = append(all, p.arrival(k))
		}
	}
	slices.Sort(all)
	for j, at := range all {
		assert.Equal(t, time.Duration(j+1)*2500*time.Microsecond, at, "arrival %d of all", j+1)
	}
}

// TestPacerArrivalsAreExact checks, at a rate whose interval is not a whole
// number of nanoseconds, that a message counts as arrived from the instant
// arrival places it at, and not a nanosecond before: whatever the rounding,
// a caller that waits for next finds it due.
func TestPacerArrivalsAreExact(t *testing.T) {
	t0 := time.Now()
	for _, c := range []struct {
		rate           float64
		index, callers int
	}{{1000, 0, 3}, {1000, 2, 3}, {7, 0, 1}, {123456.789, 5, 7}, {0.3, 1, 2}} {
		p := newPacer(c.rate, c.index, c.callers)
		p.restart(t0)
		for k := int64(1); k <= 5000; k++ {
			at := t0.Add(p.arrival(k))
			require.Equal(t, k, p.arrived(at), "rate %v caller %d: message %d at its arrival", c.rate, c.index, k)
			require.Equal(t, k-1, p.arrived(at.Add(-time.Nanosecond)), "rate %v caller %d: message %d before its arrival", c.rate, c.index, k)
			require.Equal(t, at, p.next(), "rate %v caller %d", c.rate, c.index)
			require.Equal(t, 1, p.take(at, 10))
		}
	}
	tiny := newPacer(1e-15, 0, 1)
	assert.Equal(t, maxArrival, tiny.arrival(3), "a tiny rate does not overflow")
	tiny.restart(t0)
	assert.Zero(t, tiny.arrived(t0.Add(time.Hour)))
}

func TestBehind(t *testing.T) {
	assert.False(t, behind(0, 0))
	assert.False(t, behind(100, 100))
	assert.False(t, behind(100, 95))
	assert.True(t, behind(100, 94))
	assert.True(t, behind(1000, 0))
}

// TestPacedBatch checks a paced caller's stream: what arrived, up to
// -batch; what was not acknowledged without waiting; no batch when the
// slice ends first; and -dup's share carried across small batches.
func TestPacedBatch(t *testing.T) {
	ctx := context.Background()
	o := &options{concurrency: 1, batch: 10, dup: 0.2, keys: 1000, seed: 1, rate: 100}
	s := newStream(o, 0, newBitset())
	require.NotNil(t, s.pace)
	never := make(chan struct{})

	// A second of arrivals: a batch of -batch, all new (the first).
	s.pace.restart(time.Now().Add(-time.Second))
	msgs, ok := s.pacedBatch(ctx, o, never)
	require.True(t, ok)
	require.Len(t, msgs, 10)
	msgs = slices.Clone(msgs)
	assert.EqualValues(t, 10, s.pace.taken)
	for i, m := range msgs {
		assert.EqualValues(t, i, m.id, "the first batch's ids are new")
	}

	// Nothing arrives before an hour from now: a message not
	// acknowledged is taken at once, alone.
	s.pace.restart(time.Now().Add(time.Hour))
	s.redeliver(msgs[3])
	again, ok := s.pacedBatch(ctx, o, never)
	require.True(t, ok)
	assert.Equal(t, []message{msgs[3]}, again, "a message not acknowledged counts as arrived")

	// Nothing due, nothing pending: the caller waits, until the slice
	// ends.
	end := make(chan struct{})
	close(end)
	_, ok = s.pacedBatch(ctx, o, end)
	assert.False(t, ok, "the slice ended before a message arrived")
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, ok = s.pacedBatch(cancelled, o, never)
	assert.False(t, ok, "the run was interrupted")

	// Batches of one: -dup redelivers a fifth of the messages in all.
	var redelivered int
	for range 1000 {
		r := s.pacedRedeliveries(o, 1)
		require.LessOrEqual(t, r, 1)
		redelivered += r
	}
	assert.InDelta(t, 200, redelivered, 1)

	// A stream that has no new id left delivers what is pending, without
	// waiting.
	s.ended = true
	s.redeliver(msgs[5])
	again, ok = s.pacedBatch(ctx, o, never)
	require.True(t, ok)
	assert.Equal(t, []message{msgs[5]}, again)
	assert.True(t, s.done())

	// The stream's last ids: what arrived beyond them is not taken.
	o.messages = 4
	last := newStream(o, 0, newBitset())
	last.pace.restart(time.Now().Add(-time.Second))
	msgs, ok = last.pacedBatch(ctx, o, never)
	require.True(t, ok)
	assert.Len(t, msgs, 4)
	assert.EqualValues(t, 4, last.pace.taken, "4 taken of the 10 a batch could take")
	assert.True(t, last.done())
}

// pacedRun is the paced run of the tests: 4 callers at 2000 messages/s in
// all, 500/s each, where an unpaced caller would take batches of 100; 1000
// ids a side, a fifth of the messages redelivered, some handler calls
// failing.
var pacedRun = []string{"-workload", "batch", "-batch", "100", "-c", "4", "-rate", "2000", "-messages", "1000", "-dup", "0.2", "-fail", "0.02", "-baseline", "setnx2"}

// assertPacedSide checks one side of a pacedRun, by the prefix of its
// fields ("" or "baseline_"): every id delivered, none twice, batches well
// below -batch, and the messages taken those the stream carried.
func assertPacedSide(t *testing.T, res map[string]any, prefix string) {
	t.Helper()
	f := func(name string) float64 {
		v, ok := res[prefix+name].(float64)
		require.True(t, ok, "%s%s: %v", prefix, name, res[prefix+name])
		return v
	}
	assert.EqualValues(t, 1000, f("ids"), prefix)
	assert.EqualValues(t, 0, f("duplicates"), prefix)
	assert.EqualValues(t, 0, f("errors"), prefix)
	perBatch := f("messages_per_batch")
	assert.GreaterOrEqual(t, perBatch, 1.0, "%s: a call takes a message at least", prefix)
	assert.Less(t, perBatch, 25.0, "%s: a consumer that keeps up takes what arrived, well below -batch", prefix)
	assert.InDelta(t, f("ops")/f("batches"), perBatch, 1e-9, prefix)
	taken, arrived := f("taken"), f("arrived")
	assert.Equal(t, f("ops")-f("redelivered"), taken, "%s: the calls took the stream's messages, and what was not acknowledged came again on top", prefix)
	assert.LessOrEqual(t, taken, arrived, prefix)
	assert.Equal(t, behind(int64(arrived), int64(taken)), res[prefix+"fell_behind"], prefix)
	assert.InDelta(t, 0.2*taken, f("replays"), 0.05*taken,
		"%s: a fifth of the stream's messages redeliver ids, acknowledged without handling (and the baseline's failed messages come again so)", prefix)
}

// testPaced runs pacedRun on the server of args and checks both sides.
func testPaced(t *testing.T, check func(t *testing.T, res map[string]any), args ...string) {
	code, res, stderr := runJSON(t, append(args, pacedRun...)...)
	require.Equal(t, 0, code, stderr)
	assert.EqualValues(t, 2000, res["rate"])
	assertPacedSide(t, res, "")
	assertPacedSide(t, res, "baseline_")
	assert.EqualValues(t, 1000, res["executions"], "idem handles every id once")
	assert.EqualValues(t, 0, res["lost_ids"])
	check(t, res)
}

func TestMiniredisPaced(t *testing.T) {
	testPaced(t, func(t *testing.T, res map[string]any) {
		assert.EqualValues(t, 0, res["redis_cpu_usec_per_sec"], "miniredis has no INFO cpu")
		assert.NotContains(t, res["ratios"], "redis_cpu_usec_per_sec")
	})

	t.Run("text", func(t *testing.T) {
		var stdout, stderr bytes.Buffer
		args := []string{"-workload", "batch", "-batch", "100", "-c", "2", "-rate", "2000", "-messages", "300", "-baseline", "setnx"}
		require.Equal(t, 0, run(context.Background(), args, &stdout, &stderr), stderr.String())
		out := stdout.String()
		for _, want := range []string{
			"paced at 2000 messages/s (1000/s a caller)", "batches of at most 100 messages", "messages/call (mean)",
			"Redis CPU/s: n/a", "messages that arrived taken", "duplicates executed: 0",
		} {
			assert.Contains(t, out, want)
		}
	})

	t.Run("unpaced", func(t *testing.T) {
		code, res, stderr := runJSON(t, batchRun...)
		require.Equal(t, 0, code, stderr)
		for _, f := range []string{"rate", "messages_per_batch", "arrived", "taken", "baseline_messages_per_batch"} {
			assert.EqualValues(t, 0, res[f], "%s without -rate", f)
		}
		assert.Equal(t, false, res["fell_behind"])
	})

	t.Run("saturated", func(t *testing.T) {
		// Ten million messages a second: no consumer keeps up.
		code, res, stderr := runJSON(t, "-workload", "batch", "-batch", "50", "-c", "2", "-rate", "10000000", "-d", "200ms", "-baseline", "setnx")
		require.Equal(t, 0, code, stderr)
		assert.Equal(t, true, res["fell_behind"])
		assert.Equal(t, true, res["baseline_fell_behind"])
		assert.Greater(t, res["messages_per_batch"], 25.0, "saturated, a call takes -batch")
		assert.EqualValues(t, 0, res["duplicates"])
		assert.EqualValues(t, 0, res["lost_ids"])
	})
}

func TestRealRedisPaced(t *testing.T) {
	s := redistest.Start(t)
	testPaced(t, func(t *testing.T, res map[string]any) {
		assertRedisCPU(t, res)
		assert.Positive(t, res["redis_cpu_usec_per_sec"])
		assert.Positive(t, res["baseline_redis_cpu_usec_per_sec"])
		ratios, ok := res["ratios"].(map[string]any)
		require.True(t, ok)
		assert.InDelta(t, res["redis_cpu_usec_per_sec"].(float64)/res["baseline_redis_cpu_usec_per_sec"].(float64), ratios["redis_cpu_usec_per_sec"], 1e-9)
		// The server's CPU over the side's time is its CPU per message
		// times the messages a second.
		perSec := res["redis_cpu_usec_per_op"].(float64) * res["ops_per_sec"].(float64)
		assert.InDelta(t, perSec, res["redis_cpu_usec_per_sec"], perSec*1e-6+1e-6)
	}, "-redis", "redis://"+s.Addr)
}

// TestPacedText checks the report of a paced run's sides, the warning of
// one that fell behind, and the ratio of Redis CPU per second.
func TestPacedText(t *testing.T) {
	r := &Result{
		Workload: workloadBatch, Server: "redis 7.0.15", Concurrency: 3, BatchSize: 100, Rate: 400,
		Ops: 8000, Batches: 2000, DurationSec: 20, MessagesPerBatch: 4, RedisCPUUsecPerSec: 12340, Arrived: 8000, Taken: 7990,
		Baseline: baselineSetNX2, BaselineOps: 6000, BaselineBatches: 100, BaselineDurationSec: 20, BaselineMessagesPerBatch: 60,
		BaselineRedisCPUUsecPerSec: 10000, BaselineArrived: 8000, BaselineTaken: 6000, BaselineFellBehind: true,
		Ratios:        map[string]float64{"redis_cpu_usec_per_sec": 1.2345},
		redisMeasured: true,
	}
	var b bytes.Buffer
	printText(&b, r)
	out := b.String()
	for _, want := range []string{
		"paced at 400 messages/s (133.3/s a caller): 4.00 messages/call (mean); Redis CPU 12.34 ms/s (1.23% of a core; INFO cpu over 20.0s); 7990 of the 8000 messages that arrived taken",
		"paced at 400 messages/s (133.3/s a caller): 60.00 messages/call (mean); Redis CPU 10.00 ms/s",
		"WARNING: setnx2 fell behind the rate: it took 75.0% of the messages that arrived (under 95%)",
		"; Redis CPU/s 1.23x (paced)",
	} {
		assert.Contains(t, out, want)
	}
	assert.NotContains(t, out, "WARNING: idem")
}

// TestPreciseSleeper checks that a sleeper sleeps at least as long as
// asked, closed or not.
func TestPreciseSleeper(t *testing.T) {
	s := newPreciseSleeper()
	defer s.close()
	for _, d := range []time.Duration{0, -time.Second, 300 * time.Microsecond, 2 * time.Millisecond, 300 * time.Microsecond} {
		start := time.Now()
		s.sleep(d)
		assert.GreaterOrEqual(t, time.Since(start), d)
	}
	s.close()
	start := time.Now()
	s.sleep(time.Millisecond)
	assert.GreaterOrEqual(t, time.Since(start), time.Millisecond, "closed, it sleeps as time.Sleep does")
}
