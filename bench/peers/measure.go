package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/internal/histogram"
)

// seedParallel bounds how many calls at once complete the keys of a replay
// run.
const seedParallel = 16

// measureAll starts the servers the peers need, runs every cell of every
// peer, one after another, stops the servers, and returns the report.
// Progress goes to progress.
func measureAll(ctx context.Context, o *options, progress io.Writer) (*report, error) {
	e := &env{op: newOperation(), pool: o.pool, pgDesign: o.pgDesign}
	stop, err := startServers(ctx, o, e)
	if err != nil {
		return nil, err
	}
	defer stop()
	rep := newReport(o, e)
	m := &measurer{o: o, e: e, rep: rep, progress: progress}
	for round := range o.rounds {
		if o.rounds > 1 {
			fmt.Fprintf(progress, "peers: round %d of %d\n", round+1, o.rounds)
		}
		for _, name := range o.peers {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			m.measurePeer(ctx, specOf(name))
		}
	}
	rep.Cells = combineRounds(rep.Cells)
	if n := e.op.foreign.Load(); n > 0 {
		rep.problem("the operation ran %d times for a key that was not the call's", n)
	}
	rep.Targets = targetsOf(rep.Cells, o.callers)
	return rep, nil
}

// startServers starts what the peers of o need, and returns what stops them.
func startServers(ctx context.Context, o *options, e *env) (stop func(), err error) {
	need := needsOf(o.peers)
	stop = func() {
		if e.redis != nil {
			e.redis.stop()
		}
		if e.postgres != nil {
			e.postgres.stop()
		}
	}
	if need&needRedis != 0 {
		if e.redis, err = startRedis(ctx, o.redisServer); err != nil {
			return nil, err
		}
	}
	if need&needPostgres != 0 {
		if e.postgres, err = startPostgres(ctx, o.pgBin, max(100, 2*o.pool+10)); err != nil {
			stop()
			return nil, err
		}
	}
	return stop, nil
}

// measurer runs the cells of a command's run.
type measurer struct {
	o        *options
	e        *env
	rep      *report
	progress io.Writer
	// lastID is the id of the last key handed out.
	lastID atomic.Uint64
}

// measurePeer opens the peer and runs its cells: each workload at each
// number of callers, a replay run after completing its keys.
func (m *measurer) measurePeer(ctx context.Context, spec peerSpec) {
	p, err := spec.open(ctx, m.e)
	if err != nil {
		m.rep.problem("%s: opening: %v", spec.name, err)
		return
	}
	defer p.close()
	fresh := freshKeys{last: &m.lastID}
	for _, w := range m.o.workloads {
		var ks keySource = fresh
		if w == workloadReplay {
			keys, ok := m.seed(ctx, spec, p, fresh)
			if !ok {
				continue
			}
			ks = keys
		}
		for _, c := range m.o.callers {
			m.measureCell(ctx, spec, p, w, c, ks)
		}
	}
}

// seed completes the keys of the peer's replay cells, and says whether every
// one ran once.
func (m *measurer) seed(ctx context.Context, spec peerSpec, p peer, fresh freshKeys) (seededKeys, bool) {
	fmt.Fprintf(m.progress, "peers: %-15s completing %d keys for the replay runs\n", spec.name, m.o.keys)
	t := m.e.op.count()
	keys, l := seed(ctx, p, fresh, m.o.keys, min(seedParallel, m.o.pool))
	switch {
	case l.errors > 0:
		m.rep.problem("%s: completing the replay keys: %d calls failed: %s", spec.name, l.errors, strings.Join(l.errorSamples(), "; "))
	case t.executions.Load() != int64(len(keys)) || t.repeats.Load() != 0:
		m.rep.problem("%s: completing %d replay keys ran the operation %d times (%d for a key that had run)", spec.name, len(keys), t.executions.Load(), t.repeats.Load())
	default:
		return keys, true
	}
	return nil, false
}

// measureCell runs one cell, adds it to the report, and records what its
// checks found.
func (m *measurer) measureCell(ctx context.Context, spec peerSpec, p peer, w string, callers int, ks keySource) {
	fmt.Fprintf(m.progress, "peers: %-15s %-6s  %3d callers ...", spec.name, w, callers)
	t := m.e.op.count()
	l := drive(ctx, p, ks, callers, m.o.warmup, m.o.duration)
	c := newCellResult(spec, w, callers, l, t)
	fmt.Fprintf(m.progress, " %9.0f ops/s\n", c.OpsPerSec)
	m.rep.Cells = append(m.rep.Cells, c)
	for _, msg := range c.check(spec, l) {
		m.rep.problem("%s %s, %d callers: %s", spec.name, w, callers, msg)
	}
}

// check returns what is wrong with a cell: failed calls, no calls, or an
// operation that did not run exactly as often as the workload says (once
// per call for a first execution, never for a replay, once per call on the
// peer without idempotency).
func (c *cellResult) check(spec peerSpec, l *load) []string {
	var out []string
	if c.Errors > 0 {
		out = append(out, fmt.Sprintf("%d calls failed: %s", c.Errors, strings.Join(c.ErrorSamples, "; ")))
	}
	if c.Ops == 0 {
		out = append(out, "no call completed")
	}
	want := l.calls
	if spec.idempotent && c.Workload == workloadReplay {
		want = 0
	}
	if c.Executions != want {
		out = append(out, fmt.Sprintf("the operation ran %d times for %d successful calls, want %d", c.Executions, l.calls, want))
	}
	if c.Workload == workloadFirst && c.Repeats > 0 {
		out = append(out, fmt.Sprintf("the operation ran %d times for a key that had run", c.Repeats))
	}
	return out
}

// cellResult is one cell of the table: a peer, a workload, a number of
// callers, and what it measured.
type cellResult struct {
	Peer     string `json:"peer"`
	Label    string `json:"label"`
	Workload string `json:"workload"`
	Callers  int    `json:"callers"`
	// Ops counts the successful calls measured, over Seconds.
	Ops       int64   `json:"ops"`
	Seconds   float64 `json:"seconds"`
	OpsPerSec float64 `json:"ops_per_sec"`
	P50us     float64 `json:"p50_us"`
	P99us     float64 `json:"p99_us"`
	// Errors counts failed calls, warm-up included; ErrorSamples quotes up
	// to five.
	Errors       int64    `json:"errors"`
	ErrorSamples []string `json:"error_samples,omitempty"`
	// Executions counts the operation's runs, warm-up included; Repeats
	// those for a key that had run before.
	Executions int64 `json:"executions"`
	Repeats    int64 `json:"repeats"`
	// Allocs counts the heap allocations of the whole process while the
	// cell measured (its callers and clients, and the HTTP peers' servers,
	// which run in it; not redis-server's or Postgres's), and AllocsPerOp
	// is that over Ops.
	Allocs      uint64  `json:"allocs"`
	AllocsPerOp float64 `json:"allocs_per_op"`
	// RoundsOpsPerSec lists each round's ops/s when there were several
	// (-rounds); OpsPerSec is then their median, the latencies are over
	// every round's calls, and the counts are sums.
	RoundsOpsPerSec []float64 `json:"rounds_ops_per_sec,omitempty"`

	hist *histogram.Histogram
}

func newCellResult(spec peerSpec, w string, callers int, l *load, t *tally) cellResult {
	return cellResult{
		Peer: spec.name, Label: spec.label, Workload: w, Callers: callers,
		Ops: l.ops, Seconds: l.elapsed.Seconds(), OpsPerSec: float64(l.ops) / max(l.elapsed, time.Nanosecond).Seconds(),
		P50us: l.hist.Quantile(0.50), P99us: l.hist.Quantile(0.99),
		Errors: l.errors, ErrorSamples: l.errorSamples(),
		Executions: t.executions.Load(), Repeats: t.repeats.Load(),
		Allocs: l.allocs, AllocsPerOp: float64(l.allocs) / float64(max(l.ops, 1)),
		hist: &l.hist,
	}
}

// combineRounds merges the cells of the same peer, workload and callers
// that several rounds measured, keeping the order of the first round.
func combineRounds(cells []cellResult) []cellResult {
	var out []cellResult
	at := map[[3]string]int{}
	for _, c := range cells {
		id := [3]string{c.Peer, c.Workload, strconv.Itoa(c.Callers)}
		i, ok := at[id]
		if !ok {
			at[id] = len(out)
			c.RoundsOpsPerSec = []float64{c.OpsPerSec}
			out = append(out, c)
			continue
		}
		out[i].add(c)
	}
	for i := range out {
		out[i].OpsPerSec = median(out[i].RoundsOpsPerSec)
		if len(out[i].RoundsOpsPerSec) == 1 {
			out[i].RoundsOpsPerSec = nil
		}
	}
	return out
}

// add merges another round's cell into c.
func (c *cellResult) add(o cellResult) {
	c.RoundsOpsPerSec = append(c.RoundsOpsPerSec, o.OpsPerSec)
	c.Ops += o.Ops
	c.Seconds += o.Seconds
	c.Errors += o.Errors
	c.ErrorSamples = append(c.ErrorSamples, o.ErrorSamples...)[:min(5, len(c.ErrorSamples)+len(o.ErrorSamples))]
	c.Executions += o.Executions
	c.Repeats += o.Repeats
	c.Allocs += o.Allocs
	c.AllocsPerOp = float64(c.Allocs) / float64(max(c.Ops, 1))
	c.hist.Add(o.hist)
	c.P50us, c.P99us = c.hist.Quantile(0.50), c.hist.Quantile(0.99)
}

// median returns the median of vs, which it sorts.
func median(vs []float64) float64 {
	slices.Sort(vs)
	n := len(vs)
	if n%2 == 1 {
		return vs[n/2]
	}
	return (vs[n/2-1] + vs[n/2]) / 2
}
