package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

// prefillMinBatch is the least batch of -prefill: a run of smaller batches
// prefills in batches of this many messages, so that millions of ids take
// minutes, not hours.
const prefillMinBatch = 500

// prefillKey is the key of the prefill's id-th message: "p" and the id, in
// a space of its own, so that no id of the measured stream ("k" and its
// id) was prefilled.
func prefillKey(id uint64) string { return "p" + strconv.FormatUint(id, 10) }

// prefillShape returns the size of the prefill's batches and how many
// callers send them: the run's batches, or prefillMinBatch if larger; the
// run's callers, or twice the cores if more.
func prefillShape(o *options) (batch, callers int) {
	return max(o.batch, prefillMinBatch), max(o.concurrency, 2*runtime.GOMAXPROCS(0))
}

// prefill handles -prefill distinct ids on each side, before the clock
// starts, by the path the side's measured run takes (idem.Consume for
// idem, the baseline's pipelines for a baseline), so that the measured
// stream finds as many ids remembered as a consumer that has run for long.
// It is not measured: the meter, the counters and the stats read only the
// slices of the run; the memory probe, started before, counts the prefill's
// ids among the ids remembered. Progress goes to stderr.
func (h *harness) prefill(ctx context.Context, stderr io.Writer) error {
	n := uint64(h.o.prefill)
	if n == 0 {
		return nil
	}
	batch, callers := prefillShape(h.o)
	for _, s := range h.sides() {
		name := "idem"
		if s != h.idem {
			name = h.o.baseline
		}
		took, err := runPrefill(ctx, name, n, batch, callers, s.prefill, stderr)
		if err != nil {
			return fmt.Errorf("prefill of %s: %w", name, err)
		}
		s.prefilled, s.prefillTime = int64(n), took
	}
	return nil
}

// runPrefill calls do on ids 0 to n-1, in batches of batch messages from
// callers goroutines, and reports its progress to stderr every two seconds.
// It returns how long it took, and the first error.
func runPrefill(ctx context.Context, name string, n uint64, batch, callers int, do func(context.Context, []message) error, stderr io.Writer) (time.Duration, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var next, done atomic.Uint64
	var wg sync.WaitGroup
	start := time.Now()
	for range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msgs := make([]message, 0, batch)
			for ctx.Err() == nil {
				first := next.Add(uint64(batch)) - uint64(batch)
				if first >= n {
					return
				}
				msgs = msgs[:0]
				for id := first; id < min(first+uint64(batch), n); id++ {
					msgs = append(msgs, message{id: id, key: prefillKey(id)})
				}
				if err := do(ctx, msgs); err != nil {
					cancel(err)
					return
				}
				done.Add(uint64(len(msgs)))
			}
		}()
	}
	finished := make(chan struct{})
	go func() {
		wg.Wait()
		close(finished)
	}()
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for waiting := true; waiting; {
		select {
		case <-tick.C:
			d := done.Load()
			fmt.Fprintf(stderr, "idembench: prefill of %s: %d of %d ids, %.0f ids/s\n", name, d, n, rate(int64(d), time.Since(start)))
		case <-finished:
			waiting = false
		}
	}
	took := time.Since(start)
	if err := context.Cause(ctx); err != nil {
		return took, err
	}
	fmt.Fprintf(stderr, "idembench: prefill of %s: %d ids in %.1fs, %.0f ids/s\n", name, n, took.Seconds(), rate(int64(n), took))
	return took, nil
}

// prefillConsume handles msgs through idem.Consume, with a handler that
// does nothing: each must be handled, as a new id is.
func (w *workload) prefillConsume(ctx context.Context, msgs []message) error {
	results, err := idem.Consume(ctx, w.k, w.scope, msgs, messageKey, func(context.Context, message) error { return nil })
	if err != nil {
		return err
	}
	for i, r := range results {
		if r.Status != idem.MessageHandled || r.Err != nil {
			return fmt.Errorf("%s: %s, not handled: %v", msgs[i].key, r.Status, r.Err)
		}
	}
	return nil
}

// prefillBatch handles msgs as the hand-written consumer does, with a
// handler that does nothing: the pipelined SET NX (of the lease, for the
// two-phase consumer), then the two-phase consumer's pipelined SET XX. Each
// SET must take, as it does for a new id.
func (b *consumerBaseline) prefillBatch(ctx context.Context, msgs []message) error {
	cmds, _ := b.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, m := range msgs {
			if b.twoPhase {
				p.Do(ctx, "set", b.prefix+m.key, "1", "px", b.leaseMs, "nx")
			} else {
				p.SetNX(ctx, b.prefix+m.key, "1", b.ttl)
			}
		}
		return nil
	})
	if err := allTook(cmds, msgs); err != nil || !b.twoPhase {
		return err
	}
	cmds, _ = b.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, m := range msgs {
			p.SetXX(ctx, b.prefix+m.key, "1", b.ttl)
		}
		return nil
	})
	return allTook(cmds, msgs)
}

// allTook returns an error unless every SET of cmds, one for each of msgs,
// took.
func allTook(cmds []redis.Cmder, msgs []message) error {
	if len(cmds) != len(msgs) {
		return fmt.Errorf("%d replies to %d commands", len(cmds), len(msgs))
	}
	for i, c := range cmds {
		took, err := setTook(c)
		switch {
		case err != nil:
			return fmt.Errorf("%s: %w", msgs[i].key, err)
		case !took:
			return fmt.Errorf("%s: SET did not take: the id was not new", msgs[i].key)
		}
	}
	return nil
}

// idMark is how many new ids a side had delivered at a moment.
type idMark struct {
	at  time.Time
	ids int64
}

// mark notes the new ids a batch side has delivered now; it does nothing
// on another side.
func (s *side) mark() {
	if s.streams != nil {
		s.marks = append(s.marks, idMark{at: time.Now(), ids: deliveredIDs(s)})
	}
}

// liveIDs returns the new ids s delivered after since: all of them, less
// those delivered by then, which it reads from the marks taken around each
// slice, as if a slice delivered its ids at an even pace.
func (s *side) liveIDs(since time.Time) int64 {
	total := deliveredIDs(s)
	var before int64
	for i, m := range s.marks {
		if m.at.After(since) {
			if i > 0 {
				p := s.marks[i-1]
				part := float64(since.Sub(p.at)) / float64(m.at.Sub(p.at))
				before = p.ids + int64(part*float64(m.ids-p.ids))
			}
			return total - before
		}
		before = m.ids
	}
	return total - before
}
