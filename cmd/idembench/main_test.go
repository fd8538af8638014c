package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
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
	for _, field := range []string{"ops_per_sec", "p50_us", "p95_us", "p99_us", "commands_per_op", "duplicates", "executions", "baseline_ops_per_sec", "ratio"} {
		assert.Contains(t, res, field)
	}
	assert.Positive(t, res["ops_per_sec"])
	assert.Positive(t, res["p50_us"])
	assert.LessOrEqual(t, res["p50_us"], res["p95_us"])
	assert.LessOrEqual(t, res["p95_us"], res["p99_us"])
	assert.EqualValues(t, 0, res["duplicates"])
	assert.EqualValues(t, 0, res["errors"])
}

func TestMiniredisMixedWithBaseline(t *testing.T) {
	code, res, stderr := runJSON(t, "-d", "1s", "-c", "8", "-workload", "mixed", "-keys", "50", "-baseline")
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, stderr, "miniredis", "the default server is said to be miniredis")
	assert.Equal(t, "miniredis (embedded)", res["server"])
	assertSound(t, res)
	assert.Positive(t, res["executions"])
	assert.Positive(t, res["replays"], "half the operations repeat one of 50 keys")
	assert.Positive(t, res["baseline_ops_per_sec"])
	assert.InDelta(t, res["ops_per_sec"].(float64)/res["baseline_ops_per_sec"].(float64), res["ratio"], 1e-9)
}

func TestRealRedis(t *testing.T) {
	s := redistest.Start(t)
	url := "redis://" + s.Addr
	t.Run("first", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-redis", url, "-d", "1s", "-c", "32", "-autopipeline", "-workload", "first", "-baseline")
		require.Equal(t, 0, code, stderr)
		assert.NotContains(t, stderr, "miniredis")
		assert.True(t, strings.HasPrefix(res["server"].(string), "redis "), res["server"])
		assertSound(t, res)
		assert.Equal(t, res["ops"], res["executions"], "every operation is a first execution")
		assert.InDelta(t, 2, res["commands_per_op"], 0.01, "claim and complete")
		assert.Positive(t, res["ratio"])
	})
	t.Run("replay", func(t *testing.T) {
		code, res, stderr := runJSON(t, "-redis", url, "-d", "1s", "-c", "32", "-workload", "replay", "-keys", "500", "-coalesce=false")
		require.Equal(t, 0, code, stderr)
		assertSound(t, res)
		assert.EqualValues(t, 0, res["executions"], "the keys were completed before the clock started: nothing runs again")
		assert.Equal(t, res["ops"], res["replays"])
		assert.InDelta(t, 1, res["commands_per_op"], 0.01, "one script per replay")
		assert.EqualValues(t, 0, res["ratio"], "no baseline asked for")
		assert.EqualValues(t, 0, res["baseline_ops_per_sec"])
	})
}

func TestTextOutput(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"-d", "300ms", "-c", "4", "-baseline"}, &stdout, &stderr)
	require.Equal(t, 0, code, stderr.String())
	out := stdout.String()
	for _, want := range []string{"ops/s", "p50", "p99", "commands/op", "duplicates executed: 0", "baseline", "ratio"} {
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
		{"-redis", "redis://a", "-cluster", "b:1"},
		{"-retention", "1s"},
		{"extra"},
	} {
		var stdout, stderr bytes.Buffer
		assert.Equal(t, 2, run(context.Background(), args, &stdout, &stderr), "%q", args)
		assert.NotEmpty(t, stderr.String())
	}
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

func TestHistogramQuantiles(t *testing.T) {
	var h histogram
	for i := 1; i <= 1000; i++ {
		h.record(time.Duration(i) * time.Microsecond)
	}
	for q, want := range map[float64]float64{0.5: 500, 0.95: 950, 0.99: 990} {
		assert.InEpsilon(t, want, h.quantile(q), 0.04, "q%v", q)
	}
	var empty histogram
	assert.Zero(t, empty.quantile(0.5))
	h.record(time.Hour) // beyond the last bucket: counted in it
	assert.Positive(t, h.quantile(1))
}

func TestCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	code, res, stderr := runJSON(t, "-cluster", strings.Join(c.Addrs(), ","), "-d", "1s", "-c", "32", "-autopipeline", "-workload", "mixed", "-keys", "100", "-baseline")
	require.Equal(t, 0, code, stderr)
	assert.True(t, strings.HasPrefix(res["server"].(string), "redis cluster "), res["server"])
	assertSound(t, res)
	assert.Positive(t, res["replays"])
	assert.Positive(t, res["ratio"])
}
