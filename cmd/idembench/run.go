package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
)

// side is one half of a run: idem, or the baseline it is compared with.
type side struct {
	op func(context.Context, *worker)
	// commands are the Redis commands the side sends, whose usec in INFO
	// commandstats is its Redis CPU.
	commands []string
	stats    *stats
	cost     cost
	// cnt counts the commands and round trips of the side's client while
	// the side runs; nil where they are not counted.
	cnt *counter

	// With -workload batch: streams are the callers' shares of the queue,
	// which last from one slice to the next; ran marks the ids whose
	// handler succeeded on this side; prefix starts the side's Redis keys
	// (a baseline's: idem's are the Keeper's).
	streams []*stream
	ran     *bitset
	prefix  string
	// prefill handles a batch of -prefill's messages as the side's
	// measured run would; prefilled counts the ids it handled, and
	// prefillTime how long that took.
	prefill     func(context.Context, []message) error
	prefilled   int64
	prefillTime time.Duration
	// marks are the new ids the side had delivered at the start and the
	// end of each of its slices, from which liveIDs counts the ids
	// delivered since a moment.
	marks []idMark
}

func newSide(op func(context.Context, *worker), commands []string) *side {
	return &side{op: op, commands: commands, stats: newStats()}
}

// finished reports whether every caller of a batch side has delivered all it
// had to.
func (s *side) finished() bool {
	for _, st := range s.streams {
		if !st.done() {
			return false
		}
	}
	return s.streams != nil
}

// measure is the timed part of the run: slices of idem, and of the baseline
// if there is one, in turn, so that both see the same machine.
func (h *harness) measure(ctx context.Context, stdout io.Writer) error {
	o := h.o
	stopProfile, err := startCPUProfile(o.cpuprofile)
	if err != nil {
		return err
	}
	defer stopProfile()
	if o.messages > 0 {
		h.measureCount(ctx)
		return nil
	}
	slice := o.duration
	if h.base != nil {
		slice = sliceOf(o.duration)
	}
	var progress *progressLine
	if !o.json && o.duration > 3*time.Second && isTerminal(stdout) {
		progress = &progressLine{w: stdout, total: o.duration}
	}
	for done := time.Duration(0); done < o.duration && ctx.Err() == nil; {
		d := min(slice, o.duration-done)
		for _, sd := range h.sides() {
			if sd != h.idem {
				h.phase(ctx, sd, span{d: d}, nil)
				continue
			}
			h.phase(ctx, sd, span{d: d}, progress)
			s := sd.stats
			progress.show(s.elapsed, s.ops(), s.ops(), s.elapsed)
		}
		done += d
	}
	progress.clear()
	if o.workload == workloadBatch {
		// The time is up: no new id, but what was not acknowledged comes
		// again until it is, so that an id counts as lost only when no
		// redelivery could save it.
		for _, sd := range h.sides() {
			for _, st := range sd.streams {
				st.ended = true
			}
			h.phase(ctx, sd, span{}, nil)
		}
	}
	return nil
}

// sliceOf is how long each side's slices last in a run of two sides whose
// sides each run for d: a quarter of d, from 100ms to 1s.
func sliceOf(d time.Duration) time.Duration {
	return min(time.Second, max(d/4, 100*time.Millisecond))
}

// countSlices is how many slices of each side a run of -messages takes,
// about.
const countSlices = 20

// measureCount is the timed part of a run of -messages: slices of idem's
// side and the baseline's in turn, each of a number of batches per caller, so
// that the i-th slice of both sides carries the same batches of the stream;
// until every caller of both sides has delivered all it had to. Under
// -rate, whose batches are as large as what arrived, the slices are of
// time, as a run of -d's are, sized on the time the ids take to arrive; one
// slice, until the stream is delivered, without a baseline.
func (h *harness) measureCount(ctx context.Context) {
	o := h.o
	perCaller := (uint64(o.messages) + uint64(o.concurrency) - 1) / uint64(o.concurrency)
	batches := 1 + perCaller/uint64(max(o.batch-redelivered(o), 1))
	sl := span{batches: int(max(1, (batches+countSlices-1)/countSlices))}
	if o.rate > 0 {
		sl = span{}
		if len(h.sides()) > 1 {
			// The hour bounds the conversion; a slice is a second at most.
			arrive := min(float64(o.messages)/o.rate, 3600)
			sl.d = sliceOf(time.Duration(arrive * float64(time.Second)))
		}
	}
	for ctx.Err() == nil {
		ran := false
		for _, sd := range h.sides() {
			if !sd.finished() {
				h.phase(ctx, sd, sl, nil)
				ran = true
			}
		}
		if !ran {
			return
		}
	}
}

// sides returns the sides that run: idem's, and the baseline's if there
// is one; with -side, the one it names.
func (h *harness) sides() []*side {
	switch {
	case h.base == nil || h.o.side == sideIdem:
		return []*side{h.idem}
	case h.o.side == sideBaseline:
		return []*side{h.base}
	}
	return []*side{h.idem, h.base}
}

// span is how long a slice lasts: d, or, when d is 0, until each caller has
// run batches batches or has nothing left to deliver (-workload batch; with
// batches 0 too, until it has nothing left).
type span struct {
	d       time.Duration
	batches int
}

// phase runs one slice of s, and adds what it cost to s.
func (h *harness) phase(ctx context.Context, s *side, sl span, progress *progressLine) {
	before := h.meter.read(ctx, true)
	if s.cnt != nil {
		s.cnt.on.Store(true)
	}
	s.mark()
	runSlice(ctx, h.w, sl, s, progress)
	s.mark()
	if s.cnt != nil {
		s.cnt.on.Store(false)
	}
	s.cost.add(before, h.meter.read(ctx, false), s.commands)
}

// runSlice runs s's op on w's callers for the span sl, into s's stats.
func runSlice(ctx context.Context, w *workload, sl span, s *side, progress *progressLine) {
	var stop atomic.Bool
	end := make(chan struct{})
	var wg sync.WaitGroup
	locals := make([]*localStats, w.o.concurrency)
	start := time.Now()
	for _, st := range s.streams {
		if st.pace != nil {
			// The arrivals start again: none came while the slice did
			// not run.
			st.pace.restart(start)
		}
	}
	for i := range locals {
		locals[i] = &localStats{}
		wg.Add(1)
		go func(i int, ls *localStats) {
			defer wg.Done()
			wk := w.newWorker(ls)
			wk.end = end
			if s.streams != nil {
				wk.stream = s.streams[i]
			}
			for n := 0; !stop.Load(); n++ {
				if wk.stream != nil && (wk.stream.done() || sl.d == 0 && sl.batches > 0 && n >= sl.batches) {
					return
				}
				s.op(ctx, wk)
				ls.done.Add(1)
			}
		}(i, locals[i])
	}
	finished := make(chan struct{})
	go func() {
		wg.Wait()
		close(finished)
	}()
	var timeUp <-chan time.Time
	if sl.d > 0 {
		t := time.NewTimer(sl.d)
		defer t.Stop()
		timeUp = t.C
	}
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
loop:
	for {
		select {
		case <-timeUp:
			break loop
		case <-finished:
			break loop
		case <-ctx.Done():
			break loop
		case <-tick.C:
			if progress != nil {
				var n int64
				for _, ls := range locals {
					n += ls.done.Load()
				}
				progress.show(s.stats.elapsed+time.Since(start), s.stats.ops()+n, n, time.Since(start))
			}
		}
	}
	stop.Store(true)
	close(end)
	<-finished
	now := time.Now()
	s.stats.elapsed += now.Sub(start)
	for _, ls := range locals {
		s.stats.merge(ls)
	}
	for _, st := range s.streams {
		if st.pace != nil {
			st.pace.settle(now, st.hasNew())
		}
	}
}

// workload makes the operations of a run.
type workload struct {
	o     *options
	k     *idem.Keeper
	scope string
	body  []byte
	ran   *bitset
	// http is the server and client of -mode http; nil in -mode do.
	http *httpBench

	// fresh is the number of keys handed out; key i is "k<i>".
	fresh atomic.Uint64
}

// newRunTag returns four random letters that name a run: its scope, and
// in -workload batch the prefix of idem's keys.
func newRunTag() string {
	var tag [4]byte
	for i := range tag {
		tag[i] = "abcdefghijklmnopqrstuvwxyz"[rand.IntN(26)]
	}
	return string(tag[:])
}

func newWorkload(o *options, k *idem.Keeper) *workload {
	w := &workload{
		o:     o,
		k:     k,
		scope: "idembench-" + o.run,
		body:  make([]byte, o.body),
		ran:   newBitset(),
	}
	for i := range w.body {
		w.body[i] = 'a' + byte(i%26)
	}
	return w
}

// worker is one caller's state.
type worker struct {
	w     *workload
	rng   *rand.Rand
	stats *localStats
	buf   []byte
	// id is the key of the operation under way; ran is set by fn.
	id  uint64
	ran bool
	fn  func(ctx context.Context) ([]byte, error)
	// stream is the caller's share of the queue in -workload batch, nil
	// otherwise.
	stream *stream
	// end is closed when the slice under way ends, so that a caller
	// waiting for a message to arrive (-rate) stops waiting.
	end <-chan struct{}
}

func (w *workload) newWorker(s *localStats) *worker {
	wk := &worker{w: w, rng: rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())), stats: s, buf: make([]byte, 0, 32)}
	wk.fn = func(ctx context.Context) ([]byte, error) {
		wk.ran = true
		w.ran.mark(wk.id)
		return w.body, nil
	}
	return wk
}

// nextID returns the key of the next operation: a repeat of a recent key
// with probability dup, else a new one.
func (wk *worker) nextID() uint64 {
	w := wk.w
	if w.o.dup > 0 && (w.o.dup >= 1 || wk.rng.Float64() < w.o.dup) {
		if n := w.fresh.Load(); n > 0 {
			span := min(n, uint64(w.o.keys))
			return n - 1 - wk.rng.Uint64N(span)
		}
	}
	return w.fresh.Add(1) - 1
}

func (wk *worker) key(id uint64) string {
	return wk.keyWith("k", id)
}

// keyWith returns prefix followed by id.
func (wk *worker) keyWith(prefix string, id uint64) string {
	wk.buf = append(wk.buf[:0], prefix...)
	wk.buf = strconv.AppendUint(wk.buf, id, 10)
	return string(wk.buf)
}

// doOp runs one operation through idem.Do.
func (w *workload) doOp(ctx context.Context, wk *worker) {
	wk.id, wk.ran = wk.nextID(), false
	start := time.Now()
	_, err := idem.Do(ctx, w.k, w.scope, wk.key(wk.id), wk.fn)
	lat := time.Since(start)
	switch {
	case err == nil && wk.ran:
		wk.stats.executed++
	case err == nil:
		wk.stats.replayed++
	case errors.Is(err, idem.ErrInProgress):
		wk.stats.inProgress++
	default:
		wk.stats.fail(err)
		return
	}
	wk.stats.record(lat)
}

// seed completes keys 0 to keys-1 before a replay run: through idem.Do, or
// in -mode http through the middleware.
func (w *workload) seed(ctx context.Context) error {
	w.fresh.Store(uint64(w.o.keys))
	complete := func(ctx context.Context, wk *worker, id uint64) error {
		wk.id = id
		_, err := idem.Do(ctx, w.k, w.scope, wk.key(id), wk.fn)
		return err
	}
	if w.http != nil {
		complete = w.httpSeed
	}
	if err := w.forEachKey(ctx, w.o.keys, complete); err != nil {
		return fmt.Errorf("completing the keys of the replay run: %w", err)
	}
	return nil
}

// forEachKey calls do for ids 0 to n-1 from -c goroutines, each with a worker
// of its own, and returns the first error.
func (w *workload) forEachKey(ctx context.Context, n int, do func(context.Context, *worker, uint64) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, w.o.concurrency)
	for i := 0; i < w.o.concurrency; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wk := w.newWorker(&localStats{})
			for {
				id := next.Add(1) - 1
				if id >= int64(n) || ctx.Err() != nil {
					return
				}
				if err := do(ctx, wk, uint64(id)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return errors.Join(<-errs, ctx.Err())
}
