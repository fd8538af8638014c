package main

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPrefill checks that the ids -prefill handles are remembered on both
// sides (idem answers a redelivery as handled before, the baseline's SET
// NX does not take), and that no figure of the run but the memory per id
// counts them.
func TestPrefill(t *testing.T) {
	t.Run("miniredis", func(t *testing.T) { testPrefill(t, false) })
	t.Run("redis", func(t *testing.T) {
		s := redistest.Start(t)
		testPrefill(t, true, "-redis", "redis://"+s.Addr)
	})
}

// testPrefill runs batchRun with a prefill on the server of args; memory
// says whether the server measures memory.
func testPrefill(t *testing.T, memory bool, args ...string) {
	const prefill = 1234 // not a whole number of the prefill's batches
	ctx := context.Background()
	o, err := parseFlags(append(append(args, batchRun...), "-baseline", "setnx2", "-prefill", "1234"), io.Discard)
	require.NoError(t, err)
	h, err := setup(ctx, o, io.Discard, io.Discard)
	require.NoError(t, err)
	defer h.close()
	require.NoError(t, h.measure(ctx, io.Discard))

	prefilled := make([]message, prefill)
	for i := range prefilled {
		prefilled[i] = message{id: uint64(i), key: prefillKey(uint64(i))}
	}
	ran := 0
	handler := func(context.Context, message) error { ran++; return nil }
	results, err := idem.Consume(ctx, h.k, h.w.scope, prefilled, messageKey, handler)
	require.NoError(t, err)
	assert.Zero(t, ran, "no prefilled id runs again")
	for i, r := range results {
		require.Equal(t, idem.MessageReplayed, r.Status, "%s: a redelivery of a prefilled id is answered as handled before", prefilled[i].key)
	}
	next := []message{{id: prefill, key: prefillKey(prefill)}}
	results, err = idem.Consume(ctx, h.k, h.w.scope, next, messageKey, handler)
	require.NoError(t, err)
	assert.Equal(t, idem.MessageHandled, results[0].Status, "the id after the prefill's last is new")
	for _, m := range []message{prefilled[0], prefilled[prefill-1]} {
		assert.ErrorContains(t, h.base.prefill(ctx, []message{m}), "not new", "%s: the baseline's key is there", m.key)
	}
	assert.NoError(t, h.base.prefill(ctx, next), "the baseline's id after the prefill's last is new")

	if h.memory != nil {
		h.idemMemory, h.baseMemory, h.memoryMethod = h.memory.finish(ctx, h.idem, h.base)
	}
	res := h.result()
	assert.EqualValues(t, prefill, res.Prefill)
	assert.Equal(t, prefillMinBatch, res.PrefillBatch)
	for _, side := range []struct {
		name                                           string
		ids, executions, replays, ops, batches, errors int64
		roundTrips                                     float64
	}{
		{"idem", res.IDs, res.Executions, res.Replays, res.Ops, res.Batches, res.Errors, res.RoundTripsPerBatch},
		{"setnx2", res.BaselineIDs, res.BaselineExecutions, res.BaselineReplays, res.BaselineOps, res.BaselineBatches, res.BaselineErrors, res.BaselineRoundTripsPerBatch},
	} {
		assert.EqualValues(t, runIDs, side.ids, side.name)
		assert.EqualValues(t, runIDs, side.executions, side.name)
		assert.EqualValues(t, runRedelivered, side.replays, side.name)
		assert.EqualValues(t, runMessages, side.ops, side.name)
		assert.EqualValues(t, runBatches, side.batches, side.name)
		assert.Zero(t, side.errors, side.name)
		assert.EqualValues(t, 2, side.roundTrips, "%s: the prefill's round trips are not the run's", side.name)
	}
	assert.Zero(t, res.Duplicates)
	if memory {
		assert.Positive(t, res.UsedMemoryPerID)
		assert.EqualValues(t, runIDs+prefill, res.MemoryIDs, "the memory per id counts the prefill's ids")
		assert.EqualValues(t, runIDs+prefill, res.BaselineMemoryIDs)
		assert.Contains(t, res.MemoryMethod, "prefill")
	}
}

// TestLiveIDs checks the count of the ids a side delivered after a moment,
// from the marks taken around its slices.
func TestLiveIDs(t *testing.T) {
	t0 := time.Unix(1000, 0)
	s := &side{streams: []*stream{{sent: 300}}}
	s.marks = []idMark{
		{t0, 0}, {t0.Add(10 * time.Second), 100}, // a slice of 100 ids
		{t0.Add(20 * time.Second), 100}, {t0.Add(30 * time.Second), 300}, // another, of 200, after a pause
	}
	for _, c := range []struct {
		since time.Duration
		want  int64
	}{
		{-time.Second, 300},
		{0, 300},
		{5 * time.Second, 250},
		{15 * time.Second, 200},
		{25 * time.Second, 100},
		{30 * time.Second, 0},
		{time.Minute, 0},
	} {
		assert.Equal(t, c.want, s.liveIDs(t0.Add(c.since)), "since %s", c.since)
	}
}

// TestMarkerRetentionSetsRetention checks that -marker-retention gives both
// sides its retention.
func TestMarkerRetentionSetsRetention(t *testing.T) {
	o, err := parseFlags([]string{"-workload", "batch", "-marker-retention", "45s"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 45*time.Second, o.retention)
}

// TestSide checks that -side runs one side alone, and that -on-measure's
// program is called once before the measured run and once after it.
func TestSide(t *testing.T) {
	for _, c := range []struct {
		side             string
		idemOps, baseOps float64
	}{
		{sideIdem, runMessages, 0},
		{sideBaseline, 0, runMessages},
	} {
		t.Run(c.side, func(t *testing.T) {
			dir := t.TempDir()
			hook := filepath.Join(dir, "hook")
			require.NoError(t, os.WriteFile(hook, []byte("#!/bin/sh\necho \"$1\" >> \""+dir+"/calls\"\n"), 0o755))
			code, res, stderr := runJSON(t, append(batchRun, "-baseline", "setnx2", "-prefill", "600", "-side", c.side, "-on-measure", hook)...)
			require.Equal(t, 0, code, stderr)
			assert.Equal(t, c.side, res["side"])
			assert.EqualValues(t, c.idemOps, res["ops"])
			assert.EqualValues(t, c.baseOps, res["baseline_ops"])
			assert.Zero(t, res["duplicates"])
			calls, err := os.ReadFile(filepath.Join(dir, "calls"))
			require.NoError(t, err)
			assert.Equal(t, "start\nstop\n", string(calls))
		})
	}
}
