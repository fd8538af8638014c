package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The servers of the tests: started on first use, stopped at the end of the
// test that started them.
func redisFor(t *testing.T) *redisServer {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("IDEM_REQUIRE_REDIS") == "1" {
			t.Fatalf("redis-server not found on PATH and IDEM_REQUIRE_REDIS=1: %v", err)
		}
		t.Skipf("redis-server not found on PATH; install Redis to run this test (IDEM_REQUIRE_REDIS=1 makes this a failure)")
	}
	s, err := startRedis(t.Context(), "redis-server")
	require.NoError(t, err)
	return s
}

func postgresFor(t *testing.T, maxConns int) *postgresServer {
	t.Helper()
	if _, err := postgresBinDir(""); err != nil {
		if os.Getenv("IDEM_REQUIRE_POSTGRES") == "1" {
			t.Fatalf("%v, and IDEM_REQUIRE_POSTGRES=1", err)
		}
		t.Skipf("%v (IDEM_REQUIRE_POSTGRES=1 makes this a failure)", err)
	}
	s, err := startPostgres(t.Context(), "", maxConns)
	require.NoError(t, err)
	return s
}

// testOptions is a short run: two numbers of callers, both workloads.
func testOptions() *options {
	return &options{
		duration: 150 * time.Millisecond, warmup: 50 * time.Millisecond,
		callers: []int{1, 8}, rounds: 1, keys: 50, pool: 8, pgDesign: pgLookupFirst,
		workloads: []string{workloadFirst, workloadReplay},
	}
}

// envFor returns an env with the servers spec needs, stopped when t ends.
func envFor(t *testing.T, spec peerSpec, o *options) *env {
	e := &env{op: newOperation(), pool: o.pool, pgDesign: o.pgDesign}
	if spec.needs&needRedis != 0 {
		e.redis = redisFor(t)
		t.Cleanup(e.redis.stop)
	}
	if spec.needs&needPostgres != 0 {
		e.postgres = postgresFor(t, 50)
		t.Cleanup(e.postgres.stop)
	}
	return e
}

// TestEveryPeer runs each peer's four cells briefly and checks that each
// ran, met no error, ran the operation exactly once per key on a first
// execution, and never on a replay (except the peer without idempotency,
// which runs it on every call).
func TestEveryPeer(t *testing.T) {
	for _, spec := range peerSpecs {
		t.Run(spec.name, func(t *testing.T) { testPeer(t, spec, pgLookupFirst) })
		if spec.needs&needPostgres != 0 {
			t.Run(spec.name+"/claim-first", func(t *testing.T) { testPeer(t, spec, pgClaimFirst) })
		}
	}
}

func testPeer(t *testing.T, spec peerSpec, pgDesign string) {
	o := testOptions()
	o.pgDesign = pgDesign
	e := envFor(t, spec, o)
	rep := &report{Problems: []string{}}
	m := &measurer{o: o, e: e, rep: rep, progress: &bytes.Buffer{}}
	m.measurePeer(t.Context(), spec)
	require.Empty(t, rep.Problems)
	require.Len(t, rep.Cells, 4)
	for _, c := range rep.Cells {
		name := fmt.Sprintf("%s, %d callers", c.Workload, c.Callers)
		assert.Positive(t, c.Ops, name)
		assert.Positive(t, c.OpsPerSec, name)
		assert.Zero(t, c.Errors, name)
		switch {
		case c.Workload == workloadFirst:
			assert.GreaterOrEqual(t, c.Executions, c.Ops, name)
			assert.Zero(t, c.Repeats, name)
		case spec.idempotent:
			assert.Zero(t, c.Executions, name)
		default:
			assert.GreaterOrEqual(t, c.Executions, c.Ops, name)
		}
	}
	assert.Zero(t, e.op.foreign.Load())
}

// TestChecksCatchADoubleRun shows that the checks see a peer that runs the
// operation twice for a key, and one that runs it again on a replay.
func TestChecksCatchADoubleRun(t *testing.T) {
	o := testOptions()
	o.callers = []int{2}
	for _, tc := range []struct {
		name string
		make func(op *operation) peer
		want string
	}{
		{"twice per call", func(op *operation) peer { return twice{op} }, "for a key that had run"},
		{"no replay", func(op *operation) peer { return noReplay{op} }, "want 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := &env{op: newOperation(), pool: o.pool}
			rep := &report{Problems: []string{}}
			m := &measurer{o: o, e: e, rep: rep, progress: &bytes.Buffer{}}
			spec := peerSpec{name: "fake", idempotent: true, open: func(context.Context, *env) (peer, error) {
				return tc.make(e.op), nil
			}}
			m.measurePeer(t.Context(), spec)
			require.NotEmpty(t, rep.Problems)
			assert.Contains(t, strings.Join(rep.Problems, "\n"), tc.want)
		})
	}
}

// twice runs the operation twice for every call.
type twice struct{ op *operation }

func (p twice) call(_ context.Context, key string) ([]byte, error) {
	p.op.run(key)
	return p.op.run(key), nil
}
func (twice) close() {}

// noReplay runs the operation on every call, as if it kept nothing.
type noReplay struct{ op *operation }

func (p noReplay) call(_ context.Context, key string) ([]byte, error) { return p.op.run(key), nil }
func (noReplay) close()                                               {}

// TestInProgress shows that the patterns written here answer a key that
// another call holds as in progress, without running the operation.
func TestInProgress(t *testing.T) {
	for _, design := range []string{pgLookupFirst, pgClaimFirst} {
		t.Run("postgres/"+design, func(t *testing.T) {
			o := testOptions()
			o.pgDesign = design
			e := envFor(t, specOf("postgres"), o)
			p, err := openPostgresSync(t.Context(), e)
			require.NoError(t, err)
			defer p.close()
			key := keyOf(1)
			_, err = p.(*postgresPeer).db.Exec(t.Context(), "INSERT INTO idempotency_sync (key) VALUES ($1)", key)
			require.NoError(t, err)
			_, err = p.call(t.Context(), key)
			require.ErrorIs(t, err, errInProgress)
			assert.Zero(t, e.op.tally.Load().executions.Load())
		})
	}
	t.Run("redislock", func(t *testing.T) {
		e := envFor(t, specOf("redislock"), testOptions())
		p, err := openRedislock(t.Context(), e)
		require.NoError(t, err)
		defer p.close()
		key := keyOf(1)
		_, err = p.(*redislockPeer).locker.Obtain(t.Context(), "lock:"+key, time.Minute, nil)
		require.NoError(t, err)
		_, err = p.call(t.Context(), key)
		require.ErrorIs(t, err, errInProgress)
		assert.Zero(t, e.op.tally.Load().executions.Load())
	})
}

// TestServersStop shows that stopping a server ends its process and removes
// its directory.
func TestServersStop(t *testing.T) {
	t.Run("redis", func(t *testing.T) {
		s := redisFor(t)
		s.stop()
		assert.NoDirExists(t, s.dir)
		assert.NotNil(t, s.cmd.ProcessState)
	})
	t.Run("postgres", func(t *testing.T) {
		s := postgresFor(t, 20)
		assert.NotEmpty(t, s.version)
		s.stop()
		assert.NoDirExists(t, s.dir)
		assert.NotNil(t, s.cmd.ProcessState)
	})
}

// TestRunJSON runs the command on the peers that need no server and reads
// its JSON.
func TestRunJSON(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), []string{"-short", "-d", "100ms", "-c", "1,4", "-peers", "nethttp,fiber", "-json"}, &stdout, &stderr)
	require.Equal(t, 0, code, stderr.String())
	var rep report
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &rep))
	require.Len(t, rep.Cells, 8)
	assert.Equal(t, "fiber", rep.Cells[0].Peer, "peers run in the command's order")
	assert.Equal(t, "nethttp", rep.Cells[4].Peer)
	assert.Empty(t, rep.Problems)
	assert.Equal(t, 0.1, rep.Settings.SecondsPerCell)
	assert.Equal(t, shortKeys, rep.Settings.ReplayKeys)
	assert.Equal(t, 4, rep.Settings.Pool)
	assert.Empty(t, rep.Targets, "no pair of a target ran")
	assert.Contains(t, rep.Versions.Modules, "github.com/gofiber/fiber/v3")
}

// TestRunRounds runs two rounds and reads one cell per peer, workload and
// callers, with each round's ops/s.
func TestRunRounds(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), []string{"-short", "-d", "100ms", "-c", "2", "-rounds", "2", "-peers", "nethttp", "-json"}, &stdout, &stderr)
	require.Equal(t, 0, code, stderr.String())
	var rep report
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &rep))
	require.Len(t, rep.Cells, 2)
	for _, c := range rep.Cells {
		require.Len(t, c.RoundsOpsPerSec, 2)
		assert.InDelta(t, (c.RoundsOpsPerSec[0]+c.RoundsOpsPerSec[1])/2, c.OpsPerSec, 1e-6)
		assert.Positive(t, c.Seconds)
	}
	assert.Contains(t, stderr.String(), "round 2 of 2")
}

func TestMedian(t *testing.T) {
	assert.Equal(t, 2.0, median([]float64{3, 1, 2}))
	assert.Equal(t, 2.5, median([]float64{4, 1, 2, 3}))
	assert.Equal(t, 7.0, median([]float64{7}))
}

// TestRunText checks the table's shape and the targets' lines.
func TestRunText(t *testing.T) {
	rep := &report{
		Settings: settings{SecondsPerCell: 5, WarmupSeconds: 1, ReplayKeys: 10, ResultBytes: resultSize, Pool: 64},
		Cells: []cellResult{
			{Peer: "idemhttp", Label: "idem middleware on net/http", Workload: workloadFirst, Callers: 64, OpsPerSec: 300},
			{Peer: "fiber", Label: "Fiber v3 idempotency middleware", Workload: workloadFirst, Callers: 64, OpsPerSec: 200},
		},
	}
	rep.Targets = targetsOf(rep.Cells, []int{1, 64})
	require.Len(t, rep.Targets, 1)
	assert.InDelta(t, 1.5, rep.Targets[0].Ratio, 1e-9)
	assert.True(t, rep.Targets[0].Met)
	var out bytes.Buffer
	printText(&out, rep)
	assert.Contains(t, out.String(), "idem middleware on net/http")
	assert.Contains(t, out.String(), "1.50x (want >= 1.2x): met")
}

// TestFlags checks what the command refuses, with status 2.
func TestFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-c", "0"},
		{"-c", "1,x"},
		{"-peers", "mysql"},
		{"-workloads", "mixed"},
		{"-d", "0s"},
		{"-keys", "0"},
		{"-pool", "-1"},
		{"-rounds", "0"},
		{"-pg-design", "upsert"},
		{"extra"},
	} {
		var stderr bytes.Buffer
		code := run(t.Context(), args, &bytes.Buffer{}, &stderr)
		assert.Equal(t, 2, code, "%v: %s", args, stderr.String())
		assert.Contains(t, stderr.String(), "peers:", "%v", args)
	}
	assert.Equal(t, 0, run(t.Context(), []string{"-h"}, &bytes.Buffer{}, &bytes.Buffer{}))
}

func TestFlagsDefaults(t *testing.T) {
	o, err := parseFlags([]string{"-peers", "idem,postgres", "-c", "64,1"}, &bytes.Buffer{})
	require.NoError(t, err)
	assert.Equal(t, []string{"postgres", "idem"}, o.peers, "the command's order")
	assert.Equal(t, []int{64, 1}, o.callers)
	assert.Equal(t, 64, o.pool, "one connection per caller")
	assert.Equal(t, 5*time.Second, o.duration)

	o, err = parseFlags([]string{"-short", "-keys", "7"}, &bytes.Buffer{})
	require.NoError(t, err)
	assert.Equal(t, shortDuration, o.duration)
	assert.Equal(t, 7, o.keys, "-short leaves what is given")
}

func TestKeysAndResults(t *testing.T) {
	for _, id := range []uint64{0, 1, 0xabc, 1<<48 - 1} {
		k := keyOf(id)
		assert.Len(t, k, keyLen)
		got, err := idOf(k)
		require.NoError(t, err)
		assert.Equal(t, id, got)
		res := resultOf(k)
		assert.Len(t, res, resultSize)
		assert.True(t, json.Valid(res), string(res))
		assert.NoError(t, checkResult(res, k))
		assert.Error(t, checkResult(res, keyOf(id+1)))
		assert.Error(t, checkResult(res[:resultSize-1], k))
	}
	_, err := idOf("not-a-key")
	assert.Error(t, err)
}

func TestOperationCounts(t *testing.T) {
	op := newOperation()
	tl := op.count()
	op.run(keyOf(1))
	op.run(keyOf(2))
	op.run(keyOf(1))
	op.run("foreign")
	assert.EqualValues(t, 3, tl.executions.Load())
	assert.EqualValues(t, 1, tl.repeats.Load())
	assert.EqualValues(t, 1, op.foreign.Load())
}
