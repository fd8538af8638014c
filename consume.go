package idem

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Consume handles a batch of messages at most once each per key, for a
// consumer of a queue that delivers at least once: it claims the keys of the
// whole batch at once, runs handle for each message it claimed,
// keeps the batch's leases alive while the handlers run, stores or releases
// each outcome, and answers, for each message in the order of msgs, whether
// to acknowledge it and why. docs/consumers.md says how it goes about each
// step, what a crash or an outage leaves, and what a batch costs.
//
// key gives a message's key (its id, or the producer's idempotency key).
// For each message:
//
//   - its key claimed: handle runs, its context carrying the Claim
//     (ClaimFromContext: fencing token, Recovered, Checkpointed). A nil error
//     completes the key, and so does a Final error, stored for the Keeper's
//     error retention: MessageHandled, acknowledged. Any other error
//     releases the key, so that a redelivery runs handle again:
//     MessageRetry. A panic releases the key and the keys not yet run,
//     settles the others, and panics again in Consume's caller.
//   - handled before (a redelivery, a producer's duplicate): handle does not
//     run; MessageReplayed, acknowledged. A message handled within the
//     marker retention (WithMarkerRetention) is known by its marker.
//   - its key earlier in the batch: handle does not run; MessageDuplicate,
//     acknowledged when the first one is.
//   - held by another consumer, the store unreachable, the lease lost:
//     MessageRetry, not acknowledged, so that it comes again.
//   - an invalid key, a fingerprint mismatch, a corrupt record:
//     MessageRejected, not acknowledged, and a redelivery is answered the
//     same: dead-letter it.
//
// The handlers run one after another in the order of msgs, or up to n at
// once with WithConcurrency(n), started in that order. Their outcomes are
// stored as they return, within the settle window (WithSettleWindow), while
// the other handlers go on, and the leases of the messages not yet settled
// are renewed every third of the lease. A storing that Redis cannot take
// (ErrUnavailable) is tried again until the claim's lease, by this
// process's clock, is about to run out, and for at most a lease after the
// last handler returned: an outage shorter than half a lease loses no
// outcome. A handler's context is cancelled, with a cause wrapping
// ErrLeaseLost, when its lease is found lost or runs out by this process's
// clock, and its outcome is not stored. Once ctx is done no handler
// starts and the claims not run are released; the handlers running finish
// and their outcomes are stored.
//
// A process that dies mid-batch leaves the keys it had not settled pending:
// once their lease has run out, their redelivery takes them over and runs
// them again, told Claim.Recovered. Those are the handlers that were
// running, those not yet started, and those that returned within the settle
// window before the death or whose storing waited for an unreachable Redis.
//
// With WithWait(d), a message whose key another consumer holds is claimed
// again, with backoff, for up to d once the other messages are settled:
// MessageReplayed when the holder completes, run here when it releases the
// key or its lease runs out. The Keeper's own WithWait does not apply.
//
// Options that apply, and their defaults: WithConcurrency (1),
// WithFingerprints (none), WithLease (the Keeper's lease), WithSettleWindow
// (10 ms, 128) and WithWait (0: no waiting). The error is nil when
// something was done. It is non-nil, with nil results, for a nil key or
// handle, an option that does not apply or does not fit
// (ErrInvalidConfig), or ctx already done. When no message's claim reached
// the store, every result is still returned, each MessageRetry, and the
// error wraps ErrUnavailable and the first cause: back off before the next
// batch.
func Consume[M any](ctx context.Context, k *Keeper, scope string, msgs []M, key func(M) string, handle func(ctx context.Context, msg M) error, opts ...Option) ([]MessageResult, error) {
	if key == nil || handle == nil {
		return nil, fmt.Errorf("%w: Consume needs a key function and a handler", ErrInvalidConfig)
	}
	s, err := k.batchSettings(opts, toBatch|toConsume, "Consume", len(msgs))
	if err != nil {
		return nil, err
	}
	keys := make([]string, len(msgs))
	for i := range msgs {
		keys[i] = key(msgs[i])
	}
	return k.consume(ctx, ctx, scope, keys, &s, func(ctx context.Context, i int) error { return handle(ctx, msgs[i]) })
}

// consume is Consume once the keys and options are read: the handlers run
// with ctx, and once stop is done no further handler starts (Consume gives
// ctx for both; a StreamConsumer lets the handlers under way finish).
func (k *Keeper) consume(ctx, stop context.Context, scope string, keys []string, s *settings, handle func(ctx context.Context, i int) error) ([]MessageResult, error) {
	lease := k.policy.lease
	if s.policy.lease != 0 {
		lease = s.policy.lease
	}
	claims, err := k.beginBatch(ctx, scope, keys, s.fingerprints, k.markers, lease, true)
	if err != nil {
		return nil, err
	}
	unreachable := unreachableStore(claims)
	b := newConsumption(k, claims, lease, s)
	b.run(ctx, stop, max(s.concurrency, 1), handle)
	results := b.results
	if s.wait > 0 {
		k.awaitHolders(ctx, stop, scope, keys, results, s, lease, handle)
	}
	return results, unreachable
}

// unreachableStore returns an error wrapping ErrUnavailable when no claim
// of a batch reached the store: every key sent to it was answered
// ErrUnavailable. Nil when one was answered otherwise, or when none was
// sent (every key invalid).
func unreachableStore(claims []batchResult) error {
	var first error
	for i, r := range claims {
		switch {
		case r.First != i, errors.Is(r.Err, ErrInvalidKey):
			continue // not sent
		case r.Err == nil || !errors.Is(r.Err, ErrUnavailable), errors.Is(r.Err, ErrNotReplicated):
			return nil // the store answered (a claim not yet replicated was still made)
		case first == nil:
			first = r.Err
		}
	}
	if first == nil {
		return nil
	}
	return fmt.Errorf("idem: Consume: no claim reached the store: %w", first)
}

// awaitHolders claims again, with backoff, the messages of results that
// another consumer held (MessageRetry with an *InProgressError), until
// s.wait has passed or stop is done, and runs the handlers of those it
// claims; it updates results in place.
func (k *Keeper) awaitHolders(ctx, stop context.Context, scope string, keys []string, results []MessageResult, s *settings, lease time.Duration, handle func(ctx context.Context, i int) error) {
	deadline := k.now().Add(s.wait)
	backoff := holderRetryFirst
	for {
		var places []int
		hint := s.wait
		for i, r := range results {
			var ip *InProgressError
			if r.Status == MessageRetry && r.First == i && errors.As(r.Err, &ip) {
				places = append(places, i)
				if ip.RetryAfter > 0 {
					hint = min(hint, ip.RetryAfter)
				}
			}
		}
		left := deadline.Sub(k.now())
		if len(places) == 0 || left <= 0 {
			break
		}
		t := time.NewTimer(min(backoff, hint, left))
		backoff = min(2*backoff, holderRetryCap)
		select {
		case <-stop.Done():
			t.Stop()
			return
		case <-t.C:
		}
		sub := make([]string, len(places))
		var fps [][]byte
		if s.fingerprints != nil {
			fps = make([][]byte, len(places))
		}
		for j, i := range places {
			sub[j] = keys[i]
			if fps != nil {
				fps[j] = s.fingerprints[i]
			}
		}
		claims, err := k.beginBatch(ctx, scope, sub, fps, k.markers, lease, true)
		if err != nil {
			break
		}
		b := newConsumption(k, claims, lease, s)
		b.run(ctx, stop, max(s.concurrency, 1), func(ctx context.Context, j int) error { return handle(ctx, places[j]) })
		for j, r := range b.results {
			r.First = places[j]
			results[places[j]] = r
		}
	}
	for i := range results {
		if r := &results[i]; r.Status == MessageDuplicate {
			r.Ack = results[r.First].Ack
		}
	}
}

// WithSettleWindow sets how soon Consume stores the outcomes of the
// handlers that returned while the others go on: at most d after the
// first of them returned, or as soon as n have, in one call to the store
// (one pipeline per Redis node) each time. It bounds what a process that
// dies mid-batch runs again: the handlers that returned within the window
// before its death (see Consume). A shorter window costs more round trips
// per batch. Default: 10 ms and 128. d must not be negative (0: as soon as the store
// call under way, if any, has returned), n must be at least 1. Applies to
// Consume and to a StreamConsumer.
func WithSettleWindow(d time.Duration, n int) Option {
	return Option{name: "WithSettleWindow", to: toConsume | toStream, set: func(s *settings) { s.settleDelay, s.settleCount, s.settleSet = d, n, true }}
}

// WithConcurrency makes Consume run up to n handlers at once, started in the
// order of the batch. Default: 1, one after another in order, for consumers
// whose messages must take effect in order. Applies to Consume and to a
// StreamConsumer.
func WithConcurrency(n int) Option {
	return Option{name: "WithConcurrency", to: toConsume | toStream, set: func(s *settings) { s.concurrency = n }}
}

// MessageResult says what Consume did with one message.
type MessageResult struct {
	// Ack is true when the message needs no further delivery: acknowledge it
	// (commit its offset, delete it from the queue). True for MessageHandled,
	// MessageReplayed, and MessageDuplicate when the first message with the
	// key is acknowledged.
	Ack bool
	// Status says why.
	Status MessageStatus
	// Err is the handler's error (a Final one for MessageHandled and
	// MessageReplayed; any other for MessageRetry, joined with the store's
	// error if releasing failed), or what refused or stopped the message:
	// ErrInProgress, ErrUnavailable, ErrLeaseLost, the caller's cancellation,
	// ErrInvalidKey, ErrMismatch, ErrCorrupt, ErrDuplicate. Nil for a
	// message handled without error, or replayed from one.
	Err error
	// Ran is true when the handler ran for this message in this call: always
	// for MessageHandled, and for a MessageRetry whose handler failed, lost
	// its lease, or whose outcome could not be stored.
	Ran bool
	// First is the place in the batch of the first message with the same
	// key: the message's own place unless MessageDuplicate.
	First int
}

// MessageStatus is what became of a message given to Consume.
type MessageStatus uint8

// The statuses of MessageResult.
const (
	// MessageHandled: the handler ran and its outcome was stored. Ack.
	MessageHandled MessageStatus = iota + 1
	// MessageReplayed: the message had been handled before; the handler did
	// not run. Ack.
	MessageReplayed
	// MessageDuplicate: a message earlier in the batch had the same key; the
	// handler did not run for this one. Ack as the first.
	MessageDuplicate
	// MessageRetry: not settled by this call; a redelivery will try again.
	// Do not ack.
	MessageRetry
	// MessageRejected: the message cannot be handled under its key (invalid
	// key, fingerprint mismatch, corrupt record), and a redelivery will be
	// answered the same. Do not ack; dead-letter it.
	MessageRejected
)

var messageStatusNames = [...]string{
	MessageHandled: "handled", MessageReplayed: "replayed", MessageDuplicate: "duplicate",
	MessageRetry: "retry", MessageRejected: "rejected",
}

// String returns the status's name, such as "handled".
func (s MessageStatus) String() string {
	if int(s) < len(messageStatusNames) && messageStatusNames[s] != "" {
		return messageStatusNames[s]
	}
	return fmt.Sprintf("MessageStatus(%d)", uint8(s))
}

// unclaimedResult is the result of a message whose key batchBegin did not
// claim.
func unclaimedResult(r batchResult) MessageResult {
	m := MessageResult{Err: r.Err, First: r.First}
	switch {
	case r.Err == nil:
		m.Status, m.Ack, m.Err = MessageReplayed, true, r.Outcome.Err
	case errors.Is(r.Err, ErrResultExpired):
		// Handled before, longer ago than the retention: a marker.
		m.Status, m.Ack, m.Err = MessageReplayed, true, nil
	case errors.Is(r.Err, ErrDuplicate):
		m.Status = MessageDuplicate
	case errors.Is(r.Err, ErrInvalidKey), errors.Is(r.Err, ErrMismatch), errors.Is(r.Err, ErrCorrupt):
		m.Status = MessageRejected
	default:
		m.Status = MessageRetry
	}
	return m
}
