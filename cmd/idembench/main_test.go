package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// runJSON runs the command with -json and returns its exit status and
// result.
func runJSON(t *testing.T, args ...string) (int, map[string]any, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), append(args, "-json"), &stdout, &stderr)
	var res map[string]any
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &res), "stdout: %s\nstderr: %s", stdout.String(), stderr.String())
	return code, res, stderr.String()
}

func assertSound(t *testing.T, res map[string]any) {
	t.Helper()
	for _, field := range []string{
		"mode", "ops_per_sec", "p50_us", "p95_us", "p99_us", "commands_per_op", "duplicates", "executions",
		"redis_usec_per_op", "redis_cpu_usec_per_op", "allocs_per_op",
		"baseline", "baseline_ops_per_sec", "baseline_redis_usec_per_op", "baseline_redis_cpu_usec_per_op", "baseline_allocs_per_op", "ratio",
	} {
		assert.Contains(t, res, field)
	}
	assert.Positive(t, res["ops"])
	assert.Positive(t, res["ops_per_sec"])
	assert.Positive(t, res["p50_us"])
	assert.LessOrEqual(t, res["p50_us"], res["p95_us"])
	assert.LessOrEqual(t, res["p95_us"], res["p99_us"])
	assert.Positive(t, res["allocs_per_op"])
	assert.EqualValues(t, 0, res["duplicates"])
	assert.EqualValues(t, 0, res["errors"])
}

// assertBaseline checks the figures of the baseline name.
func assertBaseline(t *testing.T, res map[string]any, name string) {
	t.Helper()
	assert.Equal(t, name, res["baseline"])
	assert.Positive(t, res["baseline_ops"])
	assert.Positive(t, res["baseline_ops_per_sec"])
	assert.Positive(t, res["baseline_p50_us"])
	assert.Positive(t, res["baseline_allocs_per_op"])
	assert.InDelta(t, res["ops_per_sec"].(float64)/res["baseline_ops_per_sec"].(float64), res["ratio"], 1e-9)
}

// assertRedisCPU checks the Redis CPU figures of a run on a real server: the
// baseline's are positive too unless it sends no command (bare).
func assertRedisCPU(t *testing.T, res map[string]any) {
	t.Helper()
	assert.Positive(t, res["redis_usec_per_op"])
	assert.Positive(t, res["redis_cpu_usec_per_op"])
	switch res["baseline"] {
	case "":
	case baselineBare:
		assert.EqualValues(t, 0, res["baseline_redis_usec_per_op"], "the bare handler sends Redis nothing")
	default:
		assert.Positive(t, res["baseline_redis_usec_per_op"])
		assert.Positive(t, res["baseline_redis_cpu_usec_per_op"])
	}
}

func TestMiniredisMixedWithBaseline(t *testing.T) {
	code, res, stderr := runJSON(t, "-d", "1s", "-c", "8", "-workload", "mixed", "-keys", "50", "-baseline", "setnx")
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, stderr, "miniredis", "the default server is said to be miniredis")
	assert.Equal(t, "miniredis (embedded)", res["server"])
	assert.Equal(t, "do", res["mode"])
	assertSound(t, res)
	assertBaseline(t, res, "setnx")
	assert.Positive(t, res["executions"])
	assert.Positive(t, res["replays"], "half the operations repeat one of 50 keys")
	assert.EqualValues(t, 0, res["redis_usec_per_op"], "miniredis has no INFO commandstats")
	assert.EqualValues(t, 0, res["baseline_redis_usec_per_op"])
}

// floors are the baselines of -mode do, each with the workload it is the
// floor of.
var floors = []struct{ baseline, workload string }{
	{"setnx", "first"},
	{"pair", "first"},
	{"get", "replay"},
}

func TestMiniredisBaselines(t *testing.T) {
	for _, f := range floors {
		t.Run(f.baseline, func(t *testing.T) {
			code, res, stderr := runJSON(t, "-d", "300ms", "-c", "8", "-keys", "100", "-workload", f.workload, "-baseline", f.baseline)
			require.Equal(t, 0, code, stderr)
			assertSound(t, res)
			assertBaseline(t, res, f.baseline)
			assert.EqualValues(t, 0, res["redis_usec_per_op"], "miniredis has no INFO commandstats")
		})
	}
}

func TestMiniredisReplayCache(t *testing.T) {
	code, res, stderr := runJSON(t, "-d", "300ms", "-c", "8", "-keys", "100", "-workload", "replay", "-cache", "1000", "-baseline", "get")
	require.Equal(t, 0, code, stderr)
	assertSound(t, res)
	assert.EqualValues(t, 1000, res["cache_entries"])
	assert.Positive(t, res["cache_hits"])
	assert.EqualValues(t, 1, res["cache_hit_rate"], "every key was completed by this Keeper before the clock started")
	assert.Zero(t, res["commands_per_op"], "a hit sends Redis nothing")

	code, res, stderr = runJSON(t, "-d", "300ms", "-c", "8", "-keys", "100", "-workload", "replay")
	require.Equal(t, 0, code, stderr)
	assert.EqualValues(t, 0, res["cache_entries"])
	assert.EqualValues(t, 0, res["cache_hits"])
}

func TestMiniredisHTTP(t *testing.T) {
	t.Run("first", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-mode", "http", "-d", "300ms", "-c", "8", "-baseline", "bare")
		require.Equal(t, 0, code, stderr)
		assert.Equal(t, "http", res["mode"])
		assertSound(t, res)
		assertBaseline(t, res, "bare")
		assert.Equal(t, res["ops"], res["executions"], "every request is a first execution")
		assert.InDelta(t, 2, res["commands_per_op"], 0.01, "claim and complete")
	})
	t.Run("replay", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-mode", "http", "-d", "300ms", "-c", "8", "-workload", "replay", "-keys", "100", "-coalesce=false", "-baseline", "bare")
		require.Equal(t, 0, code, stderr)
		assertSound(t, res)
		assertBaseline(t, res, "bare")
		assert.EqualValues(t, 0, res["executions"], "the keys were completed before the clock started")
		assert.Equal(t, res["ops"], res["replays"], "every response carries the replayed header")
		assert.InDelta(t, 1, res["commands_per_op"], 0.01, "one script per replay")
	})
	t.Run("replay against bare-get", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-mode", "http", "-d", "300ms", "-c", "8", "-workload", "replay", "-keys", "100", "-baseline", "bare-get")
		require.Equal(t, 0, code, stderr)
		assertSound(t, res)
		assertBaseline(t, res, "bare-get")
	})
	t.Run("mixed", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-mode", "http", "-d", "300ms", "-c", "8", "-workload", "mixed", "-keys", "20")
		require.Equal(t, 0, code, stderr)
		assertSound(t, res)
		assert.Positive(t, res["executions"])
		assert.Positive(t, res["replays"])
	})
}

func TestRealRedis(t *testing.T) {
	s := redistest.Start(t)
	url := "redis://" + s.Addr
	t.Run("first", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-redis", url, "-d", "1s", "-c", "32", "-autopipeline", "-workload", "first", "-baseline", "setnx")
		require.Equal(t, 0, code, stderr)
		assert.NotContains(t, stderr, "miniredis")
		assert.Regexp(t, `^\S+ \d+\.\d+\.\d+$`, res["server"], "named with its version, not a Cluster")
		assertSound(t, res)
		assertBaseline(t, res, "setnx")
		assertRedisCPU(t, res)
		assert.Equal(t, res["ops"], res["executions"], "every operation is a first execution")
		assert.InDelta(t, 2, res["commands_per_op"], 0.01, "claim and complete")
	})
	t.Run("replay", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-redis", url, "-d", "1s", "-c", "32", "-workload", "replay", "-keys", "500", "-coalesce=false")
		require.Equal(t, 0, code, stderr)
		assertSound(t, res)
		assertRedisCPU(t, res)
		assert.EqualValues(t, 0, res["executions"], "the keys were completed before the clock started: nothing runs again")
		assert.Equal(t, res["ops"], res["replays"])
		assert.InDelta(t, 1, res["commands_per_op"], 0.01, "one script per replay")
		assert.Empty(t, res["baseline"])
		assert.EqualValues(t, 0, res["ratio"], "no baseline asked for")
		assert.EqualValues(t, 0, res["baseline_ops_per_sec"])
	})
	for _, f := range floors {
		t.Run("baseline "+f.baseline, func(t *testing.T) {
			code, res, stderr := runJSON(t, "-redis", url, "-d", "400ms", "-c", "16", "-keys", "500", "-workload", f.workload, "-baseline", f.baseline)
			require.Equal(t, 0, code, stderr)
			assertSound(t, res)
			assertBaseline(t, res, f.baseline)
			assertRedisCPU(t, res)
		})
	}
	t.Run("baseline autopipeline", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-redis", url, "-d", "400ms", "-c", "16", "-autopipeline", "-baseline", "pair", "-baseline-autopipeline")
		require.Equal(t, 0, code, stderr)
		assertSound(t, res)
		assertBaseline(t, res, "pair")
		assertRedisCPU(t, res)
		assert.Equal(t, true, res["baseline_autopipeline"])
	})
	t.Run("http replay against bare-get", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-redis", url, "-mode", "http", "-d", "400ms", "-c", "16", "-keys", "500", "-workload", "replay", "-baseline", "bare-get")
		require.Equal(t, 0, code, stderr)
		assertSound(t, res)
		assertBaseline(t, res, "bare-get")
		assertRedisCPU(t, res)
		assert.Positive(t, res["baseline_redis_usec_per_op"], "the bare-get handler sends one GET")
	})
	for _, workload := range []string{"first", "replay"} {
		t.Run("http "+workload, func(t *testing.T) {
			code, res, stderr := runJSON(t, "-redis", url, "-mode", "http", "-d", "400ms", "-c", "16", "-keys", "500", "-workload", workload, "-baseline", "bare")
			require.Equal(t, 0, code, stderr)
			assertSound(t, res)
			assertBaseline(t, res, "bare")
			assertRedisCPU(t, res)
		})
	}
}

// assertBatch checks a run of -workload batch -batch 50 -dup 0.2: messages
// handled and redelivered, none run twice, and a batch costing at most
// three round trips on one node (claim, completion, and a renewal at most).
func assertBatch(t *testing.T, res map[string]any) {
	t.Helper()
	assertSound(t, res)
	assert.Equal(t, "batch", res["workload"])
	assert.EqualValues(t, 50, res["batch_size"])
	assert.Positive(t, res["batches"])
	assert.Positive(t, res["executions"])
	if res["batches"].(float64) > res["concurrency"].(float64) {
		assert.Positive(t, res["replays"], "some caller ran a second batch, a fifth of which is redelivered")
	}
	assert.EqualValues(t, 0, res["in_progress"], "a caller redelivers only keys its earlier batches settled")
	assert.Positive(t, res["round_trips_per_batch"])
	assert.LessOrEqual(t, res["round_trips_per_batch"], 3.0)
	assert.Less(t, res["commands_per_op"], 1.0, "a batch's commands are shared by its messages")
}

func TestMiniredisBatch(t *testing.T) {
	code, res, stderr := runJSON(t, "-workload", "batch", "-batch", "50", "-dup", "0.2", "-d", "500ms", "-c", "4")
	require.Equal(t, 0, code, stderr)
	assertBatch(t, res)
}

func TestRealRedisBatch(t *testing.T) {
	s := redistest.Start(t)
	code, res, stderr := runJSON(t, "-redis", "redis://"+s.Addr, "-workload", "batch", "-batch", "50", "-dup", "0.2", "-d", "1s", "-c", "8")
	require.Equal(t, 0, code, stderr)
	assertBatch(t, res)
	assertRedisCPU(t, res)

	var stdout, errOut bytes.Buffer
	require.Equal(t, 0, run(context.Background(), []string{"-redis", "redis://" + s.Addr, "-workload", "batch", "-d", "300ms", "-c", "2"}, &stdout, &errOut), errOut.String())
	for _, want := range []string{"messages/s", "batches of 100 messages", "round trips/batch", "duplicates executed: 0"} {
		assert.Contains(t, stdout.String(), want)
	}
}

// TestRedisCPUCountsScriptsOnce checks that a script's nested commands,
// which INFO commandstats lists apart from it, are not counted twice.
func TestRedisCPUCountsScriptsOnce(t *testing.T) {
	before := serverCPU{usec: map[string]int64{}}
	parseCommandstats("# Commandstats\r\ncmdstat_evalsha:calls=1,usec=60,usec_per_call=60.00,rejected_calls=0,failed_calls=0\r\n"+
		"cmdstat_set:calls=1,usec=7,usec_per_call=7.00\r\ncmdstat_config|resetstat:calls=1,usec=30\r\n", before.usec)
	assert.Equal(t, map[string]int64{"evalsha": 60, "set": 7, "config": 30}, before.usec)
	before.process = parseCPU("# CPU\r\nused_cpu_sys:1.500000\r\nused_cpu_user:0.250001\r\nused_cpu_sys_children:9.000000\r\n")
	assert.EqualValues(t, 1_750_001, before.process)

	after := serverCPU{usec: map[string]int64{"evalsha": 160, "set": 27, "config": 30, "info": 500}, process: 1_750_401}
	var c cost
	c.add(reading{cpu: before, redis: true, mallocs: 10, clientUsec: 1000, client: true},
		reading{cpu: after, redis: true, mallocs: 30, clientUsec: 1040, client: true}, scriptCommands)
	p := c.perOp(4)
	assert.InDelta(t, 25, p.commandUsec, 1e-9, "evalsha's 100µs over 4 operations; the nested SETs and INFO are not counted")
	assert.InDelta(t, 100, p.processUsec, 1e-9)
	assert.InDelta(t, 10, p.clientUsec, 1e-9)
	assert.InDelta(t, 5, p.allocs, 1e-9)

	c.add(reading{redis: false}, reading{redis: true, client: true}, scriptCommands)
	p = c.perOp(4)
	assert.Zero(t, p.commandUsec, "a phase that could not be read makes the figure unknown, not smaller")
	assert.Zero(t, p.clientUsec, "nor the process's")
}

func TestJSONBody(t *testing.T) {
	for n := 0; n < 300; n++ {
		b := jsonBody(n)
		require.Len(t, b, n)
		if n >= 2 {
			assert.True(t, json.Valid(b), "%d: %s", n, b)
		}
	}
	id, err := keyID("k42")
	require.NoError(t, err)
	assert.EqualValues(t, 42, id)
	_, err = keyID("x42")
	assert.Error(t, err)
}

func TestTextOutput(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"-d", "300ms", "-c", "4", "-baseline", "pair"}, &stdout, &stderr)
	require.Equal(t, 0, code, stderr.String())
	out := stdout.String()
	for _, want := range []string{"ops/s", "p50", "p99", "commands/op", "duplicates executed: 0", "allocs/op", "baseline", "SET NX PX", "ratio", "over pair ops/s"} {
		assert.Contains(t, out, want)
	}
	assert.NotContains(t, out, "\r", "no progress line when stdout is not a terminal")
}

func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-workload", "nope"},
		{"-dup", "1.5"},
		{"-dup", "-0.5"},
		{"-ap-batches", "0"},
		{"-c", "0"},
		{"-cache", "-1"},
		{"-redis", "redis://a", "-cluster", "b:1"},
		{"-retention", "1s"},
		{"-mode", "grpc"},
		{"-baseline", "nope"},
		{"-baseline"},
		{"-baseline", "bare"},
		{"-mode", "http", "-baseline", "get"},
		{"-baseline", "pair", "-baseline-autopipeline"},
		{"-autopipeline", "-baseline-autopipeline"},
		{"-batch", "10"},
		{"-workload", "batch", "-batch", "-1"},
		{"-workload", "batch", "-baseline", "pair"},
		{"-workload", "batch", "-mode", "http"},
		{"extra"},
	} {
		var stdout, stderr bytes.Buffer
		assert.Equal(t, 2, run(context.Background(), args, &stdout, &stderr), "%q", args)
		assert.NotEmpty(t, stderr.String())
	}
}

func TestFormerBaselineFlagIsExplained(t *testing.T) {
	var stdout, stderr bytes.Buffer
	require.Equal(t, 2, run(context.Background(), []string{"-baseline", "-json"}, &stdout, &stderr))
	assert.Contains(t, stderr.String(), "-baseline setnx")
}

func TestBitsetCountsDuplicates(t *testing.T) {
	b := newBitset()
	for _, id := range []uint64{0, 63, 64, 65535, 65536, 1 << 31} {
		assert.True(t, b.mark(id), "first run of %d", id)
	}
	assert.False(t, b.mark(64))
	assert.False(t, b.mark(1<<31))
	assert.True(t, b.mark(1))
	assert.EqualValues(t, 2, b.duplicates.Load())
}

// TestDescribeServer: a server is named by its own name and version, and
// as a Cluster by what CLUSTER INFO said, whatever Redis version it
// reports: Valkey 8.0.1 says redis_version 7.2.4 and has no redis_mode.
func TestDescribeServer(t *testing.T) {
	redis70 := "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\nredis_mode:standalone\r\nos:Linux\r\n"
	valkey80 := "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:8.0.1\r\nserver_mode:cluster\r\n"
	for _, c := range []struct {
		info    string
		cluster bool
		want    string
	}{
		{redis70, false, "redis 7.0.15"},
		{redis70, true, "redis cluster 7.0.15"},
		{valkey80, false, "valkey 8.0.1"},
		{valkey80, true, "valkey cluster 8.0.1"},
		{"# Server\r\nredis_mode:cluster\r\n", false, "redis"},
		{"", false, "redis"},
	} {
		assert.Equal(t, c.want, describeServer(c.info, c.cluster), "%q, cluster %v", c.info, c.cluster)
	}
}

func TestCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	t.Run("mixed against pair", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-cluster", strings.Join(c.Addrs(), ","), "-d", "1s", "-c", "32", "-autopipeline", "-workload", "mixed", "-keys", "100", "-baseline", "pair")
		require.Equal(t, 0, code, stderr)
		assert.Regexp(t, `^\S+ cluster \d+\.\d+\.\d+$`, res["server"], "named a Cluster, with its version")
		assertSound(t, res)
		assertBaseline(t, res, "pair")
		assert.Positive(t, res["replays"])
		assertRedisCPU(t, res)
	})

	t.Run("batch against setnx2", func(t *testing.T) {
		// Keys placed by their own digests: -scope-shards 0, not the
		// Cluster's default.
		// indexKeys counts the index keys on the masters: a slot's
		// index key holds the tokens of its calls, records mode too.
		indexKeys := func() int {
			var n int
			for _, addr := range c.Addrs() {
				node := redis.NewClient(&redis.Options{Addr: addr})
				keys, err := node.Keys(context.Background(), "*}i3").Result()
				node.Close()
				require.NoError(t, err)
				n += len(keys)
			}
			return n
		}
		before := indexKeys()
		code, res, stderr := runJSON(t, append([]string{"-cluster", strings.Join(c.Addrs(), ","), "-baseline", "setnx2", "-scope-shards", "0"}, batchRun...)...)
		require.Equal(t, 0, code, stderr)
		index := indexKeys() - before
		assert.Positive(t, index)
		assertIdemBatchCounts(t, res, 0)
		assertBaselineBatchCounts(t, res, "setnx2", 0)
		assertRedisCPU(t, res)
		assert.Contains(t, res["memory_method"], "summed over the Cluster's masters")
		assert.Positive(t, res["used_memory_per_id"])
		assert.Positive(t, res["baseline_used_memory_per_id"])
		assert.Positive(t, res["keys_added"])
		assert.EqualValues(t, runIDs+index, res["keys_added"], "a slot's share of a batch is one or two messages, kept in records; and the slot's index key")
		assert.EqualValues(t, runIDs, res["baseline_keys_added"], "one key an id")
		for _, addr := range c.Addrs() {
			node := redis.NewClient(&redis.Options{Addr: addr})
			left, err := node.Keys(context.Background(), "*:setnx2:*").Result()
			node.Close()
			require.NoError(t, err)
			assert.Empty(t, left, "the baseline's keys are deleted after the run")
		}
	})

	t.Run("batch, the Cluster's default placement", func(t *testing.T) {
		// Without -scope-shards the run's scope is in
		// idem.ClusterScopeShards shards: a batch of 500 costs a script
		// call a shard a step, where -scope-shards 0 costs one a slot, a
		// message or so.
		cmds := map[string]float64{}
		for _, shards := range []string{"", "0"} {
			run := []string{"-cluster", strings.Join(c.Addrs(), ","), "-workload", "batch", "-batch", "500", "-dup", "0.2", "-c", "2", "-messages", "2000"}
			if shards != "" {
				run = append(run, "-scope-shards", shards)
			}
			code, res, stderr := runJSON(t, run...)
			require.Equal(t, 0, code, stderr)
			assert.EqualValues(t, 2000, res["ids"], "-scope-shards %q", shards)
			assert.EqualValues(t, 2000, res["executions"], "-scope-shards %q: every id handled once", shards)
			assert.EqualValues(t, 0, res["duplicates"], "-scope-shards %q", shards)
			assert.EqualValues(t, 0, res["errors"], "-scope-shards %q", shards)
			cmds[shards] = res["commands_per_op"].(float64)
		}
		t.Logf("commands a message: %v by default, %v with -scope-shards 0", cmds[""], cmds["0"])
		assert.Less(t, cmds[""]*4, cmds["0"], "the default's batches cost a few script calls")
	})

	t.Run("every master", func(t *testing.T) {
		ctx := context.Background()
		var want int64
		for _, addr := range c.Addrs() {
			node := redis.NewClient(&redis.Options{Addr: addr})
			defer node.Close()
			for range 200 {
				require.NoError(t, node.Echo(ctx, "x").Err())
			}
			one, err := readServerCPU(ctx, node)
			require.NoError(t, err)
			require.Positive(t, one.usec["echo"])
			want += one.usec["echo"]
		}
		all, err := readServerCPU(ctx, c.Client(t, nil))
		require.NoError(t, err)
		assert.Equal(t, want, all.usec["echo"], "the cluster's figure sums every master's")
	})
}
