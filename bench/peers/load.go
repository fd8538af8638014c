package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime/metrics"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/internal/histogram"
)

// The workloads.
const (
	workloadFirst  = "first"
	workloadReplay = "replay"
)

// keySource hands each call its key.
type keySource interface {
	next(r *rand.Rand) string
}

// freshKeys hands out keys never used before in the command.
type freshKeys struct{ last *atomic.Uint64 }

func (k freshKeys) next(*rand.Rand) string { return keyOf(k.last.Add(1)) }

// seededKeys hands out keys completed beforehand, at random.
type seededKeys []string

func (k seededKeys) next(r *rand.Rand) string { return k[r.IntN(len(k))] }

// load is what one cell measured, with the calls of its warm-up.
type load struct {
	hist    histogram.Histogram
	ops     int64         // successful calls measured
	elapsed time.Duration // from the start of the measurement to its last call's end
	calls   int64         // successful calls, warm-up included
	errors  int64         // failed calls, warm-up included
	// allocs counts the heap allocations of the whole process (callers,
	// clients and in-process servers) from the start of the measurement
	// to its planned end.
	allocs  uint64
	samples map[string]int
}

// callerLoad is one caller's share of a load, merged at its end.
type callerLoad struct {
	load
	last time.Time
}

// drive runs callers goroutines calling p with keys from ks: for warmup
// unmeasured, then for d measured. A call counts in the measurement when it
// starts in it; every result is checked against its key. A caller whose
// calls all started before the measurement (one call outlasted it: a stall
// of the shared machine) goes on until one call of its own is measured, for
// up to stragglerGrace more, so that a short cell measures something; the
// cell's rate is over the time to its last measured call.
func drive(ctx context.Context, p peer, ks keySource, callers int, warmup, d time.Duration) *load {
	start := time.Now().Add(warmup)
	end := start.Add(d)
	total := &load{samples: map[string]int{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	wg.Go(func() { total.allocs = allocsBetween(ctx, start, end) })
	for i := range callers {
		wg.Go(func() {
			cl := driveOne(ctx, p, ks, uint64(i), start, end)
			mu.Lock()
			defer mu.Unlock()
			total.merge(cl, start)
		})
	}
	wg.Wait()
	if total.elapsed <= 0 {
		total.elapsed = d
	}
	return total
}

// allocsBetween returns the heap allocations the process makes from start
// to end (0 if ctx ends first), read from runtime/metrics, which does not
// stop the world.
func allocsBetween(ctx context.Context, start, end time.Time) uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:objects"}}
	read := func(at time.Time) (uint64, bool) {
		select {
		case <-ctx.Done():
			return 0, false
		case <-time.After(time.Until(at)):
		}
		metrics.Read(s)
		return s[0].Value.Uint64(), true
	}
	a, ok := read(start)
	if !ok {
		return 0
	}
	b, ok := read(end)
	if !ok {
		return 0
	}
	return b - a
}

// stragglerGrace is how long past its end a cell waits for the first
// measured call of a caller that has none (see drive).
const stragglerGrace = 2 * time.Second

// driveOne is one caller of drive.
func driveOne(ctx context.Context, p peer, ks keySource, seed uint64, start, end time.Time) *callerLoad {
	cl := &callerLoad{}
	r := rand.New(rand.NewPCG(seed, uint64(start.UnixNano())))
	for ctx.Err() == nil {
		t0 := time.Now()
		if !t0.Before(end) && (cl.ops > 0 || !t0.Before(end.Add(stragglerGrace))) {
			break
		}
		key := ks.next(r)
		res, err := p.call(ctx, key)
		t1 := time.Now()
		if err == nil {
			err = checkResult(res, key)
		}
		if err != nil {
			cl.fail(err)
			continue
		}
		cl.calls++
		if !t0.Before(start) {
			cl.hist.Record(t1.Sub(t0))
			cl.ops++
			cl.last = t1
		}
	}
	return cl
}

func (l *load) fail(err error) {
	l.errors++
	if l.samples == nil {
		l.samples = map[string]int{}
	}
	if len(l.samples) < 5 {
		l.samples[err.Error()]++
	}
}

// merge adds a caller's load to l, whose measurement started at start.
func (l *load) merge(cl *callerLoad, start time.Time) {
	l.hist.Add(&cl.hist)
	l.ops += cl.ops
	l.calls += cl.calls
	l.errors += cl.errors
	for m, n := range cl.samples {
		if len(l.samples) < 5 {
			l.samples[m] += n
		}
	}
	if cl.ops > 0 {
		l.elapsed = max(l.elapsed, cl.last.Sub(start))
	}
}

// errorSamples returns up to five of the errors met, with how often.
func (l *load) errorSamples() []string {
	var out []string
	for m, n := range l.samples {
		out = append(out, fmt.Sprintf("%s (%d times)", m, n))
	}
	sort.Strings(out)
	return out
}

// seed completes n fresh keys through p, with up to parallel calls at once,
// and returns them, with what it met.
func seed(ctx context.Context, p peer, ks freshKeys, n, parallel int) (seededKeys, *load) {
	keys := make(seededKeys, n)
	for i := range keys {
		keys[i] = ks.next(nil)
	}
	total := &load{samples: map[string]int{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	var next atomic.Int64
	for range min(parallel, n) {
		wg.Go(func() {
			cl := &callerLoad{}
			for i := next.Add(1) - 1; i < int64(n) && ctx.Err() == nil; i = next.Add(1) - 1 {
				res, err := p.call(ctx, keys[i])
				if err == nil {
					err = checkResult(res, keys[i])
				}
				if err != nil {
					cl.fail(err)
					continue
				}
				cl.calls++
			}
			mu.Lock()
			defer mu.Unlock()
			total.merge(cl, time.Time{})
		})
	}
	wg.Wait()
	return keys, total
}
