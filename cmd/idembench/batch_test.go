package main

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// batchRun is the run most batch tests make: 1000 ids, 500 a caller. Each
// caller delivers a first batch of 50 new ids, then 12 batches of 10
// redelivered ids and up to 40 new ones (450 = 11×40 + 10): 13 batches a
// caller, 240 redeliveries in all, 1240 messages.
var batchRun = []string{"-workload", "batch", "-batch", "50", "-dup", "0.2", "-c", "2", "-messages", "1000"}

const (
	runIDs, runMessages, runRedelivered, runBatches = 1000, 1240, 240, 26
)

// batchFields are the fields a batch run's JSON carries, on both sides.
var batchFields = []string{
	"messages", "fail", "seed", "ids", "lost_ids", "handler_failures", "redelivered", "batches", "round_trips_per_batch",
	"client_cpu_usec_per_op", "used_memory_per_id", "used_memory_bytes", "keys_added", "memory_method",
	"baseline_executions", "baseline_replays", "baseline_redelivered", "baseline_handler_failures", "baseline_ids",
	"baseline_lost_ids", "baseline_duplicates", "baseline_errors", "baseline_batches", "baseline_round_trips_per_batch",
	"baseline_commands_per_op", "baseline_client_cpu_usec_per_op", "baseline_used_memory_per_id",
	"baseline_used_memory_bytes", "baseline_keys_added", "baseline_duration_s", "ratios",
	"rate", "messages_per_batch", "redis_cpu_usec_per_sec", "arrived", "taken", "fell_behind",
	"baseline_messages_per_batch", "baseline_redis_cpu_usec_per_sec", "baseline_arrived", "baseline_taken", "baseline_fell_behind",
}

// expectedFailures returns, for ids 0 to n-1 under -fail share and -seed
// seed, how many ids fail their first handler call (what a baseline loses),
// and how many handler calls fail before every id succeeds (what idem, which
// delivers a failed message until its handler succeeds, meets).
func expectedFailures(n int, seed uint64, share float64) (firstCalls, untilSuccess int64) {
	f := newFailureChoice(seed, share)
	for id := range uint64(n) {
		if f.fails(id, 1) {
			firstCalls++
		}
		for attempt := uint32(1); f.fails(id, attempt); attempt++ {
			untilSuccess++
		}
	}
	return firstCalls, untilSuccess
}

// assertIdemBatchCounts checks idem's side of a batchRun with failures
// failing handler calls: every id handled once, none lost, each message not
// acknowledged delivered again.
func assertIdemBatchCounts(t *testing.T, res map[string]any, failures int64) {
	t.Helper()
	assert.EqualValues(t, runIDs, res["messages"])
	assert.EqualValues(t, runIDs, res["ids"])
	assert.EqualValues(t, runIDs, res["executions"], "every id handled once")
	assert.EqualValues(t, runRedelivered, res["replays"], "every redelivery of the stream acknowledged without handling")
	assert.EqualValues(t, 0, res["lost_ids"])
	assert.EqualValues(t, 0, res["duplicates"])
	assert.EqualValues(t, 0, res["errors"])
	assert.EqualValues(t, 0, res["in_progress"])
	assert.EqualValues(t, failures, res["handler_failures"])
	assert.GreaterOrEqual(t, res["redelivered"], float64(failures), "each failed message, and its repeats in the batch, comes again")
	assert.EqualValues(t, runMessages+res["redelivered"].(float64), res["ops"])
}

// assertBaselineBatchCounts checks a baseline's side of a batchRun in which
// lost ids failed their first handler call: the baseline handles the
// others, and drops each failed one when it comes again.
func assertBaselineBatchCounts(t *testing.T, res map[string]any, name string, lost int64) {
	t.Helper()
	assert.Equal(t, name, res["baseline"])
	assert.EqualValues(t, runIDs, res["baseline_ids"])
	assert.EqualValues(t, runIDs-lost, res["baseline_executions"])
	assert.EqualValues(t, runRedelivered+lost, res["baseline_replays"], "the stream's redeliveries, and the failed messages come again, whose SET NX does not take")
	assert.EqualValues(t, lost, res["baseline_redelivered"])
	assert.EqualValues(t, lost, res["baseline_handler_failures"])
	assert.EqualValues(t, lost, res["baseline_lost_ids"])
	assert.EqualValues(t, 0, res["baseline_duplicates"])
	assert.EqualValues(t, 0, res["baseline_errors"])
	assert.EqualValues(t, runMessages+lost, res["baseline_ops"])
}

// assertBatchFields checks that a batch run's JSON has every field.
func assertBatchFields(t *testing.T, res map[string]any) {
	t.Helper()
	for _, f := range batchFields {
		assert.Contains(t, res, f)
	}
	assert.Positive(t, res["client_cpu_usec_per_op"])
	assert.Positive(t, res["baseline_client_cpu_usec_per_op"])
	ratios, ok := res["ratios"].(map[string]any)
	require.True(t, ok, "ratios: %v", res["ratios"])
	assert.InDelta(t, res["ratio"], ratios["ops_per_sec"], 1e-9)
	assert.InDelta(t, res["round_trips_per_batch"].(float64)/res["baseline_round_trips_per_batch"].(float64), ratios["round_trips_per_batch"], 1e-9)
	assert.InDelta(t, res["client_cpu_usec_per_op"].(float64)/res["baseline_client_cpu_usec_per_op"].(float64), ratios["client_cpu_usec_per_op"], 1e-9)
}

// consumerBaselines are the baselines of -workload batch, with their round
// trips per batch when every batch carries a new message.
var consumerBaselines = []struct {
	name       string
	roundTrips float64
}{
	{baselineSetNX, 1},
	{baselineSetNX2, 2},
}

// testBatchBaselines runs batchRun against each baseline on the server of
// args, without and with failures, and checks the counts and round trips.
func testBatchBaselines(t *testing.T, check func(t *testing.T, res map[string]any), args ...string) {
	const seed, share = 7, 0.05
	lost, idemFailures := expectedFailures(runIDs, seed, share)
	require.Positive(t, lost, "the seed makes some first calls fail")
	require.Greater(t, idemFailures, lost, "the seed makes some second calls fail")
	for _, b := range consumerBaselines {
		t.Run(b.name, func(t *testing.T) {
			code, res, stderr := runJSON(t, append(append(args, batchRun...), "-baseline", b.name)...)
			require.Equal(t, 0, code, stderr)
			assertBatchFields(t, res)
			assertIdemBatchCounts(t, res, 0)
			assertBaselineBatchCounts(t, res, b.name, 0)
			assert.EqualValues(t, runBatches, res["batches"])
			assert.EqualValues(t, runBatches, res["baseline_batches"])
			assert.EqualValues(t, 2, res["round_trips_per_batch"], "idem: the claim and the completion")
			assert.EqualValues(t, b.roundTrips, res["baseline_round_trips_per_batch"])
			check(t, res)
		})
		t.Run(b.name+" with failures", func(t *testing.T) {
			code, res, stderr := runJSON(t, append(append(args, batchRun...), "-baseline", b.name, "-fail", fmt.Sprint(share), "-seed", fmt.Sprint(seed))...)
			require.Equal(t, 0, code, stderr)
			assertIdemBatchCounts(t, res, idemFailures)
			assertBaselineBatchCounts(t, res, b.name, lost)
			check(t, res)
		})
	}
}

func TestMiniredisBatchBaselines(t *testing.T) {
	testBatchBaselines(t, func(t *testing.T, res map[string]any) {
		assert.Contains(t, res["memory_method"], "not measured", "miniredis has no INFO memory")
		assert.EqualValues(t, 0, res["used_memory_per_id"])
		assert.EqualValues(t, 0, res["baseline_used_memory_per_id"])
	})
}

func TestRealRedisBatchBaselines(t *testing.T) {
	s := redistest.Start(t)
	ctx := context.Background()
	baseDB := redis.NewClient(&redis.Options{Addr: s.Addr, DB: 1})
	defer baseDB.Close()
	testBatchBaselines(t, func(t *testing.T, res map[string]any) {
		assertRedisCPU(t, res)
		assert.Positive(t, res["used_memory_per_id"])
		assert.Positive(t, res["baseline_used_memory_per_id"])
		assert.Positive(t, res["keys_added"])
		assert.EqualValues(t, runIDs, res["baseline_keys_added"], "one key an id")
		assert.Contains(t, res["memory_method"], "idem's keys on db 0 and the baseline's on db 1")
		assert.NotContains(t, res["memory_method"], "the baseline's db", "the baseline's database was empty before each run")
		n, err := baseDB.DBSize(ctx).Result()
		require.NoError(t, err)
		assert.Zero(t, n, "the baseline's keys are deleted after the run")
	}, "-redis", "redis://"+s.Addr)

	t.Run("markers", func(t *testing.T) {
		code, res, stderr := runJSON(t, append([]string{"-redis", "redis://" + s.Addr}, batchRun...)...)
		require.Equal(t, 0, code, stderr)
		assertIdemBatchCounts(t, res, 0)
		assert.Equal(t, true, res["markers"])
		assert.Less(t, res["keys_added"], float64(runIDs)/10, "markers: no key a message")

		code, res, stderr = runJSON(t, append([]string{"-redis", "redis://" + s.Addr, "-markers=false"}, batchRun...)...)
		require.Equal(t, 0, code, stderr)
		assertIdemBatchCounts(t, res, 0)
		assert.Equal(t, false, res["markers"])
		assert.EqualValues(t, runIDs+1, res["keys_added"], "without markers, a record a message, and the index key, which holds the calls' tokens")
	})

	t.Run("text", func(t *testing.T) {
		var stdout, stderr bytes.Buffer
		args := append([]string{"-redis", "redis://" + s.Addr, "-baseline", "setnx2", "-fail", "0.05"}, batchRun...)
		require.Equal(t, 0, run(ctx, args, &stdout, &stderr), stderr.String())
		out := stdout.String()
		for _, want := range []string{
			"messages/s", "round trips/batch", "ids: 1000 delivered, 0 lost", "duplicates executed: 0",
			"client CPU", "INFO cpu", "INFO commandstats", "two phases", "B/id", "db 1",
			"lost      ids whose handler never succeeded: idem 0, setnx2 ", "over setnx2 messages/s", "used_memory/id",
		} {
			assert.Contains(t, out, want)
		}
	})
}

// TestBatchBaselineForTime checks a run of -d against a baseline: the sides
// deliver what they manage in their slices, and when the time is up what
// they did not acknowledge, so that idem loses nothing.
func TestBatchBaselineForTime(t *testing.T) {
	code, res, stderr := runJSON(t, "-workload", "batch", "-batch", "20", "-dup", "0.2", "-c", "2", "-d", "400ms", "-fail", "0.1", "-baseline", "setnx")
	require.Equal(t, 0, code, stderr)
	assertSound(t, res)
	assertBaseline(t, res, "setnx")
	assert.EqualValues(t, 0, res["messages"])
	assert.Positive(t, res["ids"])
	assert.EqualValues(t, res["ids"], res["executions"], "every id delivered was handled once")
	assert.EqualValues(t, 0, res["lost_ids"])
	assert.Positive(t, res["handler_failures"])
	assert.Positive(t, res["baseline_lost_ids"])
	assert.Equal(t, res["baseline_handler_failures"], res["baseline_lost_ids"], "the one-phase consumer loses every id whose handler failed")
	assert.EqualValues(t, 1, res["baseline_round_trips_per_batch"])
}

func TestBatchFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-messages", "10"},
		{"-fail", "0.1"},
		{"-seed", "3"},
		{"-redis", "redis://127.0.0.1:1", "-baseline-db", "2"},
		{"-baseline", "setnx2"},
		{"-workload", "batch", "-batch", "0"},
		{"-workload", "batch", "-messages", "0"},
		{"-workload", "batch", "-messages", "-5"},
		{"-workload", "batch", "-messages", "4294967296"},
		{"-workload", "batch", "-messages", "100", "-d", "1s"},
		{"-workload", "batch", "-fail", "0.6"},
		{"-workload", "batch", "-fail", "-0.1"},
		{"-workload", "batch", "-fail", "x"},
		{"-workload", "batch", "-dup", "1", "-messages", "100"},
		{"-workload", "batch", "-baseline", "get"},
		{"-workload", "batch", "-baseline", "bare"},
		{"-workload", "batch", "-baseline", "setnx", "-autopipeline", "-baseline-autopipeline"},
		{"-workload", "batch", "-baseline", "setnx", "-baseline-db", "2"},
		{"-workload", "batch", "-baseline-db", "2", "-redis", "redis://127.0.0.1:1"},
		{"-workload", "batch", "-baseline", "setnx", "-baseline-db", "-1", "-redis", "redis://127.0.0.1:1"},
		{"-workload", "batch", "-baseline", "setnx", "-baseline-db", "3", "-redis", "redis://127.0.0.1:1/3"},
		{"-workload", "batch", "-baseline", "setnx", "-baseline-db", "2", "-cluster", "127.0.0.1:1"},
		{"-markers=false"},
		{"-workload", "batch", "-marker-scale", "1000"},
		{"-prefill", "10"},
		{"-marker-retention", "1m"},
		{"-workload", "batch", "-prefill", "-1"},
		{"-workload", "batch", "-marker-retention", "10s"},
		{"-workload", "batch", "-marker-retention", "1m", "-markers=false"},
		{"-workload", "batch", "-marker-retention", "1m", "-retention", "2m"},
		{"-workload", "batch", "-marker-retention", "1m", "-prefill", "10"},
		{"-rate", "100"},
		{"-workload", "mixed", "-rate", "100"},
		{"-workload", "first", "-rate", "0"},
		{"-mode", "http", "-rate", "100"},
		{"-workload", "batch", "-rate", "-1"},
		{"-workload", "batch", "-rate", "NaN"},
		{"-workload", "batch", "-rate", "+Inf"},
		{"-workload", "batch", "-rate", "x"},
	} {
		var stdout, stderr bytes.Buffer
		assert.Equal(t, 2, run(context.Background(), args, &stdout, &stderr), "%q", args)
		assert.NotEmpty(t, stderr.String(), "%q", args)
	}
	var stdout, stderr bytes.Buffer
	require.Equal(t, 2, run(context.Background(), []string{"-workload", "batch", "-messages", "100", "-d", "1s"}, &stdout, &stderr))
	assert.Contains(t, stderr.String(), "choose one")
	stdout.Reset()
	stderr.Reset()
	require.Equal(t, 2, run(context.Background(), []string{"-workload", "replay", "-rate", "100"}, &stdout, &stderr))
	assert.Contains(t, stderr.String(), "-rate: goes with -workload batch")
	stdout.Reset()
	stderr.Reset()
	require.Equal(t, 2, run(context.Background(), []string{"-workload", "batch", "-rate", "-5"}, &stdout, &stderr))
	assert.Contains(t, stderr.String(), "-rate -5: want messages a second")
}

// TestStreamIsTheSameOnBothSides checks the stream of one caller: the same
// batches on every side of the seed, whatever each side redelivers; its ids
// its own partition, each delivered once as new; what was not acknowledged
// first in the next batch.
func TestStreamIsTheSameOnBothSides(t *testing.T) {
	o := &options{concurrency: 3, messages: 100, batch: 10, dup: 0.3, keys: 5, seed: 9}
	a, b := newStream(o, 1, newBitset()), newStream(o, 1, newBitset())
	seen := map[uint64]bool{}
	var batches int
	for !a.done() {
		batches++
		require.Less(t, batches, 100)
		ma := append([]message(nil), a.nextBatch(o)...)
		mb := b.nextBatch(o)
		if batches == 3 {
			// b did not acknowledge a message of this batch.
			b.redeliver(message{id: 4, key: "k4"})
		}
		if batches == 4 {
			require.Equal(t, message{id: 4, key: "k4"}, mb[0], "what was not acknowledged comes first")
			mb = mb[1:]
		}
		assert.Equal(t, ma, mb, "batch %d", batches)
		if batches > 1 {
			require.GreaterOrEqual(t, len(ma), 3)
			for _, m := range ma[:3] {
				assert.True(t, seen[m.id], "batch %d redelivers %d, an id of an earlier batch", batches, m.id)
			}
			ma = ma[3:]
		}
		for _, m := range ma {
			assert.False(t, seen[m.id], "%d is new once", m.id)
			assert.EqualValues(t, 1, m.id%3, "the caller's own ids")
			assert.Less(t, m.id, uint64(100))
			assert.Equal(t, fmt.Sprintf("k%d", m.id), m.key)
			seen[m.id] = true
		}
	}
	assert.Len(t, seen, 33, "ids 1, 4, ..., 97")
	assert.True(t, b.done())
	b.redeliver(message{id: 7, key: "k7"})
	assert.False(t, b.done(), "a message not acknowledged is still to deliver")
	assert.Equal(t, []message{{id: 7, key: "k7"}}, b.nextBatch(o), "once the ids ran out, a batch of what was not acknowledged alone")
	assert.True(t, b.done())
}

func TestFailureChoice(t *testing.T) {
	assert.False(t, newFailureChoice(1, 0).fails(3, 1))
	f, g := newFailureChoice(1, 0.01), newFailureChoice(2, 0.01)
	var n, again, other int
	for id := range uint64(100_000) {
		if f.fails(id, 1) {
			n++
			if f.fails(id, 2) {
				again++
			}
		}
		if f.fails(id, 1) != newFailureChoice(1, 0.01).fails(id, 1) {
			t.Fatalf("the choice of %d is not the same twice", id)
		}
		if f.fails(id, 1) && g.fails(id, 1) {
			other++
		}
	}
	assert.InDelta(t, 1000, n, 150, "about 1%% of first calls fail")
	assert.Less(t, again, 40, "a second call fails about as often, on its own")
	assert.Less(t, other, 40, "another seed picks other calls")
	half := newFailureChoice(1, maxFail)
	n = 0
	for id := range uint64(1000) {
		if half.fails(id, 1) {
			n++
		}
	}
	assert.InDelta(t, 500, n, 60)
}

func TestBitsetCount(t *testing.T) {
	b := newBitset()
	for _, id := range []uint64{0, 1, 63, 64, 65536, 1 << 31, 1} {
		b.mark(id)
	}
	assert.EqualValues(t, 6, b.count())
	assert.EqualValues(t, 1, b.duplicates.Load())
}

func TestMemoryInfo(t *testing.T) {
	s := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
	defer c.Close()
	m, err := readMemory(context.Background(), c)
	require.NoError(t, err)
	assert.Positive(t, m.used)
	assert.Positive(t, m.clients, "this client's connection")
	assert.Less(t, m.data(), m.used)
	for range 1000 {
		require.NoError(t, c.Set(context.Background(), fmt.Sprint(rand.Uint64()), "1", 0).Err())
	}
	more, err := readMemory(context.Background(), c)
	require.NoError(t, err)
	assert.Greater(t, more.data(), m.data()+1000*50, "1000 keys take more than 50 bytes each")

	_, err = readMemory(context.Background(), redistest.Miniredis(t).Client)
	assert.Error(t, err, "miniredis has no INFO memory")
}
