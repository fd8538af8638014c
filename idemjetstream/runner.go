package idemjetstream

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/integration"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Runner consumes a JetStream pull consumer with idem.Consume: it fetches
// batches, handles each message at most once per key, and acknowledges,
// redelivers or terminates each message as Consume's result says. Make one
// with New; a Runner is safe for concurrent use, and its zero value is not
// usable.
//
// A message's key is by default its Nats-Msg-Id header (MsgID); one
// published without it is keyed by its stream sequence, so that a
// producer's duplicate of it is handled again (WithKey(MsgIDRequired)
// rejects such a message instead).
type Runner struct {
	keeper   *idem.Keeper
	scope    string
	consumer jetstream.Consumer
	handle   func(ctx context.Context, msg jetstream.Msg) error
	s        settings
	lease    time.Duration // the claims' lease: s.lease or the Keeper's
	ackWait  time.Duration // the consumer's AckWait when New read it
	// maxDeliver is the consumer's MaxDeliver when New read it; 0 or less:
	// no limit.
	maxDeliver int
	// backlogAt is when the backlog is next to be reported to the
	// Keeper's Observer (Unix nanoseconds; 0: at once), shared by the Runs
	// under way so that one of them reads it.
	backlogAt atomic.Int64
}

// New returns a Runner that handles the messages of consumer with handle,
// keyed by MsgID (or WithKey) under scope, on keeper.
//
// The default key is the Nats-Msg-Id header the producer set
// (jetstream.WithMsgID). A message published without it is keyed by its
// stream sequence: its redeliveries are handled once, but a producer that
// publishes it twice (a retried Publish) has it handled twice. Publish with
// a Nats-Msg-Id, and give WithKey(MsgIDRequired) to reject (dead-letter) a
// message without one rather than key it by its sequence.
//
// consumer must be a pull consumer that acknowledges each message
// (AckPolicy AckExplicitPolicy, JetStream's default for pull consumers),
// such as one returned by jetstream.Stream's CreateOrUpdateConsumer or
// Consumer; an ordered consumer, which acknowledges nothing, is refused.
// New reads the consumer's AckWait and MaxDeliver from its cached info: the
// runner sends InProgress for the messages of a batch every third of the
// AckWait, so that a batch whose handlers take longer than the AckWait is
// not redelivered while it runs; and it dead-letters (WithDeadLetter) a
// message that is not handled at its last delivery, which JetStream would
// not deliver again.
//
// One lease governs a message: the claims' (WithLease, by default the
// Keeper's, idem.DefaultLease: 30s) and the consumer's AckWait (JetStream's
// default, defaultAckWait: 30s), after which JetStream delivers again a
// message a dead runner left. New refuses a consumer whose AckWait, or any of
// whose BackOff durations, is shorter than the lease: after a crash,
// JetStream would redeliver each message while its claim is alive, to be
// Nak'ed (a delivery towards MaxDeliver spent for nothing). Set the AckWait
// equal to the lease, or a little longer: the longer of the two bounds how
// long a crash delays a message. New reads the consumer's cached info
// (jetstream.Consumer.CachedInfo), as the consumer was when it was created or
// last asked for its info; a consumer updated since is checked as it was
// then.
//
// handle must not acknowledge the message itself: the runner does, once
// the outcome is stored. Its context carries the idem.Claim
// (idem.ClaimFromContext); check Claim.Recovered to reconcile the side
// effects of an attempt that died.
//
// The error wraps idem.ErrInvalidConfig when keeper, consumer or handle is
// nil, the consumer does not acknowledge, its AckWait or BackOff is shorter
// than the lease, or an option refuses its setting.
func New(keeper *idem.Keeper, scope string, consumer jetstream.Consumer, handle func(ctx context.Context, msg jetstream.Msg) error, opts ...Option) (*Runner, error) {
	if keeper == nil || consumer == nil || handle == nil {
		return nil, fmt.Errorf("%w: idemjetstream.New needs a Keeper, a consumer and a handler", idem.ErrInvalidConfig)
	}
	info := consumer.CachedInfo()
	if info == nil || info.Config.AckPolicy != jetstream.AckExplicitPolicy {
		return nil, fmt.Errorf("%w: idemjetstream.New needs a pull consumer with AckPolicy AckExplicitPolicy (an ordered consumer acknowledges nothing)", idem.ErrInvalidConfig)
	}
	r := &Runner{keeper: keeper, scope: scope, consumer: consumer, handle: handle, s: defaultSettings()}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&r.s); err != nil {
			return nil, err
		}
	}
	r.lease = r.s.lease
	if r.lease == 0 {
		r.lease = integration.Lease(keeper)
	}
	r.ackWait = info.Config.AckWait
	r.maxDeliver = info.Config.MaxDeliver
	if r.ackWait <= 0 {
		r.ackWait = defaultAckWait
	}
	if r.ackWait < r.lease {
		return nil, fmt.Errorf("%w: idemjetstream.New: the consumer's AckWait %s is shorter than the lease %s: after a crash JetStream would redeliver a message while its claim is alive; set the AckWait at least the lease (or a shorter lease: WithLease, idem.WithLease on the Keeper)", idem.ErrInvalidConfig, r.ackWait, r.lease)
	}
	for _, d := range info.Config.BackOff {
		if d < r.lease {
			return nil, fmt.Errorf("%w: idemjetstream.New: the consumer's BackOff %s is shorter than the lease %s: after a crash JetStream would redeliver a message while its claim is alive", idem.ErrInvalidConfig, d, r.lease)
		}
	}
	return r, nil
}

// Run fetches and handles batches until ctx is done or fetching cannot go
// on.
//
// Each round takes the messages waiting, up to the batch size (WithBatch),
// or, when none is waiting, waits for one and then takes it with those
// that came with it; hands them to idem.Consume (so that the Keeper's
// Observer is told of every claim, completion, release and renewal, as
// for any Consume call); then settles each message as its
// idem.MessageResult says:
//
//   - Ack true (handled, handled before, a repeat of one that was): Ack.
//   - MessageRetry because another consumer holds the key
//     (idem.ErrInProgress): NakWithDelay by the time left on that lease
//     (at least MinInProgressDelay), after which the holder has finished
//     (the message is then acknowledged as handled before) or its lease has
//     run out (the message is then handled, Recovered).
//   - MessageRetry for any other reason (the handler's error, Redis
//     unreachable, the lease lost): NakWithDelay by the retry delay
//     (WithRetryDelay; DefaultRetryDelay, 1s).
//   - MessageRejected (an invalid key, another fingerprint, a corrupt
//     record): dead-lettered (WithDeadLetter), then Term. A repeat in the
//     batch of a message not acknowledged is settled as that message.
//
// Every Nak counts as a delivery towards the consumer's MaxDeliver, after
// which JetStream does not deliver the message again. So a message at its
// last delivery (NumDelivered at least MaxDeliver) that would be Nak'ed, for
// whatever reason, is dead-lettered instead, with a reason that wraps
// ErrMaxDeliveries and why, then terminated: it never vanishes untold. The
// dead-letter hook is called before Term, so a crash between the two
// repeats the dead letter (at least once).
//
// Redis unreachable does not stop Run. When no claim of a batch reached
// Redis (Consume's error wraps idem.ErrUnavailable, or is a timeout or
// cancellation while ctx is alive), no handler of it has run: its messages
// are settled as above (NakWithDelay by the retry delay; dead-lettered and
// Term'ed for an invalid key or at the last delivery), the error is given to the error handler (WithErrorHandler),
// and Run pauses for the retry delay before it fetches again, so that an
// outage costs one batch of deliveries per retry delay, not the whole
// backlog. A Fetch's error is handled the same way (reported, then a pause
// of the retry delay), unless fetching cannot go on.
//
// When ctx is done Run stops fetching; the handlers of the batch in hand
// that have started run to the end, their contexts not cancelled, and
// are settled as above; those not started do not start, their keys are
// released and their messages are Nak'ed without delay, for another
// consumer to take at once (dead-lettered at their last delivery). A handler that never returns keeps Run from
// returning. A pull request that was waiting for a message when ctx ended
// stays on the server until it expires (within 5s): a message JetStream
// gives it then comes again after the AckWait.
//
// Run returns only
//
//   - ctx's error, once ctx is done;
//   - the Fetch's error when fetching cannot go on: the connection is
//     closed, the consumer deleted (noticed at once by a waiting pull
//     request, otherwise after one wait of 5s that brought nothing);
//   - Consume's error, wrapping idem.ErrInvalidConfig, when it refuses a
//     batch (misuse): nothing is claimed, and its messages are Nak'ed with
//     the retry delay (dead-lettered at their last delivery).
//
// The Keeper's Observer, if any, is told, beside the steps of idem.Consume:
// each message dead-lettered and terminated, once Term is sent
// (idem.StepStream, idem.ResultDeadLettered, Err the reason); and the
// consumer's backlog (idem.StepBacklog: Lag, the consumer's NumPending,
// the messages of its stream not yet delivered to it; Pending, its
// NumAckPending, those delivered and not acknowledged), from the
// consumer's info: as Run starts, every 10 seconds while messages come
// (one request to the server, not made without an Observer), and after
// each wait of 5 seconds that brought none (the request that checks the
// consumer still exists). An info request that fails is given to the
// error handler.
//
// A handler's panic is a failure of its message, not of Run: it is
// recovered, its message settled as for a handler's error (an error that
// holds the panic's value and stack: NakWithDelay, or dead-lettered at its
// last delivery), and the batch goes on, as in idem's StreamConsumer.
//
// Run may be called from several goroutines at once: each fetches and
// handles its own batches.
func (r *Runner) Run(ctx context.Context) error {
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		r.backlog(ctx)
		msgs, err := r.fetch(ctx)
		backoff := false
		if len(msgs) > 0 {
			b, cerr := r.consume(ctx, msgs)
			if cerr != nil {
				return cerr
			}
			backoff = b
		}
		if err != nil {
			if fatal(err) {
				return err
			}
			r.report(fmt.Errorf("idemjetstream: fetch: %w", err))
			backoff = true
		}
		if backoff && !sleep(ctx, r.s.retryDelay) {
			return ctx.Err()
		}
	}
}

// fatal tells a Fetch error after which fetching cannot go on.
func fatal(err error) bool {
	return errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, jetstream.ErrConnectionClosed) ||
		errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound)
}

// report gives err to the error handler, if there is one.
func (r *Runner) report(err error) {
	if r.s.onError != nil {
		r.s.onError(err)
	}
}

// sleep waits d, or until ctx is done; it tells whether ctx is still
// alive.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// observer returns the Keeper's Observer, nil when there is none (or no
// Keeper: a Runner made by a test of settling).
func (r *Runner) observer() idem.Observer {
	if r.keeper == nil {
		return nil
	}
	return integration.Observer(r.keeper)
}

// backlog reports the consumer's backlog to the Keeper's Observer when it
// is due (backlogEvery since the last report), reading the consumer's
// info; one of several Runs under way reads it.
func (r *Runner) backlog(ctx context.Context) {
	if r.observer() == nil {
		return
	}
	started := time.Now()
	next := r.backlogAt.Load()
	if started.UnixNano() < next || !r.backlogAt.CompareAndSwap(next, started.Add(backlogEvery).UnixNano()) {
		return
	}
	ictx, cancel := context.WithTimeout(ctx, idleWait)
	info, err := r.consumer.Info(ictx)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			r.report(fmt.Errorf("idemjetstream: consumer info: %w", err))
		}
		return
	}
	r.observeBacklog(ctx, info, time.Since(started))
}

// observeBacklog tells the Keeper's Observer, if any, the backlog in info,
// read in took, and puts the next report backlogEvery later.
func (r *Runner) observeBacklog(ctx context.Context, info *jetstream.ConsumerInfo, took time.Duration) {
	o := r.observer()
	if o == nil {
		return
	}
	r.backlogAt.Store(time.Now().Add(backlogEvery).UnixNano())
	o.Observe(ctx, idem.Event{
		Step: idem.StepBacklog, Result: idem.ResultDone, Scope: r.scope,
		Lag: int64(min(info.NumPending, math.MaxInt64)), Pending: int64(info.NumAckPending), Took: took,
	})
}
