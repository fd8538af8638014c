package idemjetstream

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"github.com/idemkit/idem"
	"github.com/nats-io/nats.go/jetstream"
)

// errStopped is the error of a message whose handler did not start because
// Run's context ended: its key is released and the message Nak'ed at once.
var errStopped = errors.New("idemjetstream: stopped before the handler started")

// consume hands msgs to idem.Consume and settles each message as its result
// says. Consume is given a context that is not cancelled with ctx, so that
// the handlers that have started run to the end; a handler not started
// when ctx ends does not start.
//
// When no claim of the batch reached Redis (Consume's error wraps
// idem.ErrUnavailable, or is a timeout or cancellation while ctx is alive),
// each message is settled as its result says (MessageRetry: Nak'ed with the
// retry delay; every message is when there are no results), the error is
// given to the error handler, and backoff is true: Run pauses the retry
// delay before it fetches again. The error is Consume's refusal of the call
// (idem.ErrInvalidConfig): nothing was claimed, and every message is Nak'ed
// with the retry delay.
func (r *Runner) consume(ctx context.Context, msgs []jetstream.Msg) (backoff bool, _ error) {
	if ctx.Err() != nil {
		stopped := idem.MessageResult{Status: idem.MessageRetry, Err: errStopped}
		for _, m := range msgs {
			r.sent(r.settle(ctx, m, stopped, nil))
		}
		return false, nil
	}
	results, err := r.consumeInProgress(ctx, msgs)
	outage := err != nil && unreachable(ctx, err)
	if err != nil && (!outage || len(results) != len(msgs)) {
		none := idem.MessageResult{Status: idem.MessageRetry, Err: err}
		for _, m := range msgs {
			r.sent(r.settle(ctx, m, none, nil))
		}
	} else {
		for i, m := range msgs {
			r.sent(r.settle(ctx, m, results[i], results))
		}
	}
	switch {
	case err == nil:
		return false, nil
	case outage:
		r.report(fmt.Errorf("idemjetstream: consume: %w", err))
		return true, nil
	default:
		return false, fmt.Errorf("idemjetstream: consume: %w", err)
	}
}

// unreachable tells an error of Consume that says Redis could not be
// reached: one wrapping idem.ErrUnavailable, or a timeout or cancellation
// while ctx, Run's own, is alive.
func unreachable(ctx context.Context, err error) bool {
	if errors.Is(err, idem.ErrUnavailable) {
		return true
	}
	return ctx.Err() == nil && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled))
}

// consumeInProgress is idem.Consume of msgs, with InProgress sent for them
// while it runs. A handler's panic is recovered and is its message's
// failure: an error that holds the panic's value and stack.
func (r *Runner) consumeInProgress(ctx context.Context, msgs []jetstream.Msg) ([]idem.MessageResult, error) {
	defer r.keepInProgress(msgs)()
	return idem.Consume(context.WithoutCancel(ctx), r.keeper, r.scope, msgs, r.s.key,
		func(hctx context.Context, m jetstream.Msg) (err error) {
			if ctx.Err() != nil {
				return errStopped
			}
			defer func() {
				if p := recover(); p != nil {
					err = fmt.Errorf("idemjetstream: the handler panicked: %v\n%s", p, debug.Stack())
				}
			}()
			return r.handle(hctx, m)
		},
		idem.WithConcurrency(r.s.concurrency), idem.WithLease(r.lease))
}

// settle acknowledges, redelivers or gives up on m as res, its result in
// results, says (results nil: res is not of a batch). A rejected message,
// and one that would be redelivered but is at its last delivery, is
// dead-lettered (deadLetter) and terminated.
func (r *Runner) settle(ctx context.Context, m jetstream.Msg, res idem.MessageResult, results []idem.MessageResult) error {
	if res.Ack {
		return m.Ack()
	}
	if res.Status == idem.MessageDuplicate && res.First >= 0 && res.First < len(results) {
		res = results[res.First] // comes again, or is rejected, as the first
	}
	if res.Status == idem.MessageRejected {
		_, last := r.lastDelivery(m)
		return r.deadLetter(ctx, m, res.Err, last)
	}
	if n, last := r.lastDelivery(m); last {
		return r.deadLetter(ctx, m, fmt.Errorf("%w (delivery %d of %d): %w", ErrMaxDeliveries, n, r.maxDeliver, res.Err), true)
	}
	return nak(m, retryDelay(res.Err, r.s.retryDelay))
}

// retryDelay is the delay before a message whose result carries err comes
// again: none when Run stopped before its handler started; the time left on
// another holder's lease; the retry delay otherwise.
func retryDelay(err error, retry time.Duration) time.Duration {
	if errors.Is(err, errStopped) {
		return 0
	}
	if ip, ok := errors.AsType[*idem.InProgressError](err); ok {
		return max(ip.RetryAfter, MinInProgressDelay)
	}
	return retry
}

// nak redelivers m after d, at once when d is zero.
func nak(m jetstream.Msg, d time.Duration) error {
	if d <= 0 {
		return m.Nak()
	}
	return m.NakWithDelay(d)
}

// sent reports an acknowledgement that could not be sent.
func (r *Runner) sent(err error) {
	if err != nil {
		r.report(fmt.Errorf("idemjetstream: settle: %w", err))
	}
}

// keepInProgress tells JetStream every third of the consumer's AckWait
// that the messages of a batch are being worked on, until stop is called,
// so that none is redelivered while the batch runs.
func (r *Runner) keepInProgress(msgs []jetstream.Msg) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(max(r.ackWait/3, time.Millisecond))
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				for _, m := range msgs {
					select {
					case <-done:
						return
					default:
					}
					r.sent(m.InProgress())
				}
			}
		}
	})
	return func() {
		close(done)
		wg.Wait()
	}
}
