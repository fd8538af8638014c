package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// consumerBaseline is a hand-written consumer of -workload batch: it dedups
// a batch with pipelined SET NX in a key space of its own, and runs the
// handler idem's side runs for the messages whose SET took. A message whose
// SET did not take is acknowledged as a duplicate: SET NX cannot tell a
// handled id from one whose handler failed, and the code a user writes does
// not ask. A message whose handler failed is not acknowledged, and comes
// again (see stream); by then the one-phase consumer's key has marked it
// handled, and the two-phase consumer's holds it until its lease runs out:
// both drop it, unless the lease ran out first.
type consumerBaseline struct {
	c baseClient
	// prefix starts the baseline's Redis keys: the run's scope and the
	// baseline's name; the message's key follows.
	prefix string
	// twoPhase is setnx2.
	twoPhase bool
	// ttl is -retention; lease the Keeper's lease, as PX milliseconds.
	ttl     time.Duration
	leaseMs string
}

// newConsumerBaseline returns the -workload batch baseline -baseline names,
// on c.
func newConsumerBaseline(o *options, scope string, lease time.Duration, c baseClient) (*side, error) {
	b := &consumerBaseline{
		c:       c,
		prefix:  scope + ":" + o.baseline + ":",
		ttl:     o.retention,
		leaseMs: strconv.FormatInt(lease.Milliseconds(), 10),
	}
	switch o.baseline {
	case baselineSetNX:
	case baselineSetNX2:
		b.twoPhase = true
	default:
		return nil, fmt.Errorf("-baseline %q: -workload batch has no such baseline", o.baseline)
	}
	s := newSide(b.consume, []string{"set"})
	s.ran = newBitset()
	s.streams = newStreams(o, s.ran)
	s.prefix = b.prefix
	s.prefill = b.prefillBatch
	return s, nil
}

// consume handles the caller's next batch as the hand-written consumer
// does: one round trip for the one-phase consumer, two for the two-phase one
// (one when no message was new). Under -rate it first waits for a message
// to arrive, as consumeOp does.
func (b *consumerBaseline) consume(ctx context.Context, wk *worker) {
	s := wk.stream
	msgs, ok := s.nextCall(ctx, wk.w.o, wk.end)
	if !ok {
		wk.stats.done.Add(-1) // no call: runSlice counts one
		return
	}
	start := time.Now()
	// Every command of a pipeline carries its own error: Pipelined's is
	// the first of them.
	claims, _ := b.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, m := range msgs {
			if b.twoPhase {
				p.Do(ctx, "set", b.prefix+m.key, "1", "px", b.leaseMs, "nx")
			} else {
				p.SetNX(ctx, b.prefix+m.key, "1", b.ttl)
			}
		}
		return nil
	})
	var handled []message
	for i, m := range msgs {
		took, err := setTook(claims[i])
		switch {
		case err != nil:
			wk.stats.fail(fmt.Errorf("%s baseline: %s: %w", wk.w.o.baseline, m.key, err))
		case !took:
			wk.stats.replayed++
		case s.handle(ctx, m) != nil:
			wk.stats.redelivered++
			s.redeliver(m)
		case b.twoPhase:
			handled = append(handled, m)
		default:
			wk.stats.executed++
		}
	}
	if len(handled) > 0 {
		b.complete(ctx, wk, handled)
	}
	wk.stats.batches++
	wk.stats.done.Add(int64(len(msgs) - 1))
	wk.stats.record(time.Since(start))
}

// complete is the two-phase consumer's second round trip: SET id 1 XX EX ttl
// for each message handled.
func (b *consumerBaseline) complete(ctx context.Context, wk *worker, handled []message) {
	cmds, _ := b.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, m := range handled {
			p.SetXX(ctx, b.prefix+m.key, "1", b.ttl)
		}
		return nil
	})
	for i, m := range handled {
		took, err := setTook(cmds[i])
		switch {
		case err != nil:
			wk.stats.fail(fmt.Errorf("%s baseline: %s: %w", baselineSetNX2, m.key, err))
		case !took:
			// The handler ran, but the lease ran out before the SET XX:
			// not what a run of this tool should meet.
			wk.stats.fail(fmt.Errorf("%s baseline: %s: SET XX did not take: the lease ran out", baselineSetNX2, m.key))
		default:
			wk.stats.executed++
		}
	}
}

// setTook reports whether a SET NX or SET XX took, from its reply.
func setTook(cmd redis.Cmder) (bool, error) {
	switch err := cmd.Err(); {
	case errors.Is(err, redis.Nil):
		return false, nil
	case err != nil:
		return false, err
	}
	switch c := cmd.(type) {
	case *redis.BoolCmd:
		return c.Val(), nil
	case *redis.Cmd:
		return true, nil
	}
	return false, fmt.Errorf("unexpected reply %T", cmd)
}
