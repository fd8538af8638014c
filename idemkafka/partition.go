package idemkafka

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// errStopped is the error of a record whose handler did not start because
// its partition was revoked or lost, or Run's context ended: its key is
// released and the record left for the partition's next reader.
var errStopped = errors.New("idemkafka: stopped before the handler started")

// commitTimeout bounds one commit, which Run's end does not cut short.
const commitTimeout = 10 * time.Second

// partition is one partition the Runner owns, handled by one goroutine
// (work).
type partition struct {
	tp topicPartition
	// stop is done when the partition is revoked or lost, or Run ends: no
	// handler of it starts after that.
	stop   context.Context
	cancel context.CancelFunc
	// lost is set, before stop, when the partition was lost: nothing of it
	// is committed or dead-lettered after that.
	lost atomic.Bool
	// queue is the records polled and not yet settled, in offset order.
	// Guarded by the Runner's mu.
	queue []*pending
	// lag is how many records Kafka held past the partition's last poll
	// that brought records of it (its high watermark less the next
	// offset). Guarded by the Runner's mu.
	lag int64
	// wake is signalled (never blocks) when records are added to queue.
	wake chan struct{}
	// done is closed when the goroutine has ended.
	done chan struct{}
}

// pending is a record polled and not yet settled.
type pending struct {
	rec *kgo.Record
	// failures is how many times its handler failed or panicked here.
	failures int
	// dead is, once the record is to be given up on and its dead letter
	// failed, the reason; the next round tries the dead letter again
	// without handling it. Nil otherwise.
	dead error
}

func newPartition(ctx context.Context, tp topicPartition) *partition {
	stop, cancel := context.WithCancel(ctx)
	return &partition{tp: tp, stop: stop, cancel: cancel, wake: make(chan struct{}, 1), done: make(chan struct{})}
}

// signal wakes the partition's goroutine.
func (p *partition) signal() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// work handles the partition's records until it is stopped, then drops
// what it still holds (not committed: the partition's next reader reads
// it). ctx is Run's; the handlers, storing and commits do not end with it.
func (r *Runner) work(ctx context.Context, p *partition) {
	defer close(p.done)
	defer r.drop(p, -1)
	for {
		batch := r.take(p)
		if batch == nil {
			return
		}
		wait := r.round(ctx, p, batch)
		if wait > 0 && !sleep(p.stop, wait) {
			return
		}
	}
}

// take returns the first records of p's queue, up to the batch size, once
// there are some; nil once p is stopped.
func (r *Runner) take(p *partition) []*pending {
	for {
		if p.stop.Err() != nil {
			return nil
		}
		r.mu.Lock()
		n := min(len(p.queue), r.s.batch)
		batch := append([]*pending(nil), p.queue[:n]...)
		r.mu.Unlock()
		if n > 0 {
			return batch
		}
		select {
		case <-p.wake:
		case <-p.stop.Done():
		}
	}
}

// drop removes the first n records of p's queue (all, n < 0) and gives
// their room back.
func (r *Runner) drop(p *partition, n int) {
	r.mu.Lock()
	if n < 0 || n > len(p.queue) {
		n = len(p.queue)
	}
	clear(p.queue[:n])
	p.queue = p.queue[n:]
	r.held -= n
	r.mu.Unlock()
	select {
	case r.room <- struct{}{}:
	default:
	}
}

// round handles batch, the first records of p's queue, commits past those
// settled in an unbroken run from the first, removes them from the queue,
// and returns how long to wait before the rest is tried again (0: go on).
func (r *Runner) round(ctx context.Context, p *partition, batch []*pending) (wait time.Duration) {
	results, err := r.consume(ctx, p, batch)
	if err != nil {
		if results == nil {
			r.report(fmt.Errorf("idemkafka: consume %s/%d: %w", p.tp.topic, p.tp.partition, err))
			if errors.Is(err, idem.ErrInvalidConfig) {
				r.fail(fmt.Errorf("idemkafka: consume: %w", err))
				<-p.stop.Done() // Run ends, and stops p
				return 0
			}
			return r.s.retryDelay
		}
		r.report(fmt.Errorf("idemkafka: consume %s/%d: %w", p.tp.topic, p.tp.partition, err))
		wait = r.s.retryDelay
	}
	for i, res := range results {
		if counts(res) {
			batch[i].failures++
		}
	}
	settled := 0
	var last *kgo.Record
	for i, pd := range batch {
		if p.lost.Load() {
			break
		}
		reason := pd.dead
		if reason == nil && results == nil {
			break // after the records only to be dead-lettered again
		}
		if reason == nil {
			res := results[i]
			if res.Status == idem.MessageDuplicate && !res.Ack && res.First >= 0 && res.First < len(results) {
				res = results[res.First] // comes again, or is rejected, as the first
			}
			switch {
			case res.Ack:
			case res.Status == idem.MessageRejected:
				reason = res.Err
			case counts(res) && pd.failures >= r.s.maxDeliveries:
				reason = fmt.Errorf("%w (%d failures): %w", ErrMaxDeliveries, pd.failures, res.Err)
			default:
				wait = max(wait, r.retryDelay(res.Err))
			}
			if !res.Ack && reason == nil {
				break
			}
		}
		if reason != nil {
			if r.deadLetter(ctx, pd.rec, reason) != nil {
				pd.dead = reason
				wait = max(wait, r.s.retryDelay)
				break
			}
		}
		settled, last = i+1, pd.rec
	}
	if last != nil && !p.lost.Load() {
		r.commit(ctx, last)
	}
	r.drop(p, settled)
	if settled == len(batch) {
		return 0
	}
	return wait
}

// consume hands batch to idem.Consume, unless every record of it is to be
// dead-lettered again (results nil, no error). A handler's panic is
// recovered and is its record's failure; a handler not started once p is
// stopped does not start.
func (r *Runner) consume(ctx context.Context, p *partition, batch []*pending) ([]idem.MessageResult, error) {
	if batch[0].dead != nil {
		return nil, nil
	}
	recs := make([]*kgo.Record, len(batch))
	for i, pd := range batch {
		recs[i] = pd.rec
	}
	return idem.Consume(context.WithoutCancel(ctx), r.keeper, r.scope, recs, r.s.key,
		func(hctx context.Context, rec *kgo.Record) (err error) {
			if p.stop.Err() != nil {
				return errStopped
			}
			defer func() {
				if v := recover(); v != nil {
					err = fmt.Errorf("idemkafka: the handler panicked: %v\n%s", v, debug.Stack())
				}
			}()
			return r.handle(hctx, rec)
		},
		idem.WithConcurrency(r.s.concurrency), idem.WithLease(r.lease))
}

// counts tells a result that is a delivery towards WithMaxDeliveries: its
// handler ran and failed, panicked or lost its lease; not a record stopped
// before its handler started, nor one whose outcome could not be stored
// for want of Redis.
func counts(res idem.MessageResult) bool {
	return res.Ran && !res.Ack && !errors.Is(res.Err, errStopped) && !errors.Is(res.Err, idem.ErrUnavailable)
}

// retryDelay is the wait before a record whose result carries err is tried
// again: none when it was stopped; the time left on another holder's
// lease; the retry delay otherwise.
func (r *Runner) retryDelay(err error) time.Duration {
	if errors.Is(err, errStopped) {
		return 0
	}
	if ip, ok := errors.AsType[*idem.InProgressError](err); ok {
		return max(ip.RetryAfter, MinInProgressDelay)
	}
	return r.s.retryDelay
}

// commit commits the partition of rec past rec, and reports a failure.
func (r *Runner) commit(ctx context.Context, rec *kgo.Record) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	offsets := map[string]map[int32]kgo.EpochOffset{rec.Topic: {rec.Partition: {Epoch: rec.LeaderEpoch, Offset: rec.Offset + 1}}}
	var err error
	r.client.CommitOffsetsSync(cctx, offsets, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, cerr error) {
		if cerr != nil {
			err = cerr
			return
		}
		for _, t := range resp.Topics {
			for _, pp := range t.Partitions {
				if perr := kerr.ErrorForCode(pp.ErrorCode); perr != nil && err == nil {
					err = perr
				}
			}
		}
	})
	if err != nil {
		r.report(fmt.Errorf("idemkafka: commit %s: %w", describe(rec), err))
	}
}
