package idem

import (
	"context"
	"errors"
	"fmt"
)

// Consume handles a batch of messages at most once each per key, for a
// consumer of a queue that delivers at least once: it claims the keys of the
// whole batch at once (BeginBatch), runs handle for each message it claimed,
// keeps the batch's leases alive while the handlers run, stores or releases
// each outcome, and answers, for each message in the order of msgs, whether
// to acknowledge it and why.
//
// key gives a message's key (its id, or the producer's idempotency key).
// For each message:
//
//   - its key claimed: handle runs, its context carrying the Claim
//     (ClaimFromContext: fencing token, Recovered, Checkpoints). A nil error
//     completes the key (nothing is stored but the fact), and so does a Final
//     error, stored for the Keeper's error retention: both are acknowledged
//     (MessageHandled). Any other error releases the key, so that a
//     redelivery runs handle again, and is not acknowledged (MessageRetry).
//     A panic releases the key and the keys not yet run, settles the others,
//     and panics again in Consume's caller.
//   - handled before (a redelivery, a duplicate from the producer): handle
//     does not run; acknowledged (MessageReplayed). A message handled
//     within the marker retention is known by its marker, a few bytes in
//     Redis, after its record has gone (see WithMarkerRetention).
//   - its key earlier in the batch: handle does not run; acknowledged when
//     the first one is (MessageDuplicate).
//   - held by another consumer, the store unreachable, the lease lost: not
//     acknowledged, so that it comes again (MessageRetry).
//   - an invalid key, a fingerprint mismatch, a corrupt record: not
//     acknowledged, and a redelivery will be answered the same: send it to a
//     dead-letter queue (MessageRejected).
//
// The handlers run one after another in the order of msgs, or, with
// WithConcurrency(n), up to n at once, started in that order. Every third of
// the lease, one ExtendBatch renews the leases of the messages not yet
// settled, and the outcomes of the handlers that have returned by then are
// stored; the rest are stored when the last handler returns, the successes
// completed and the failures released in one pipeline. A batch of any size
// whose handlers take less than a third of the lease thus costs two round
// trips per Redis node: the claim and the completion. A process that dies
// mid-batch leaves the keys of the batch pending; their redelivery after the
// lease takes them over (Recovered) with the checkpoints recorded.
//
// On a RedisStore the claims are compact (see WithCompactClaims): a claim
// of a key that has no record is an entry of 16 bytes in an index, and a
// message handled without error leaves a marker, about 22 bytes of Redis
// memory at the index's scale (WithMarkerScale), kept for the marker
// retention (WithMarkerRetention, 7 days by default), where a record costs
// more than a hundred. The claims of one batch share one lease. A handler
// that records a Checkpoint, or whose outcome is a Final error, moves its
// claim to a record of its own. WithoutMarkers on the Keeper keeps every
// claim in a record.
//
// A holder knows its own lease: a claim whose answer came after its lease
// ran out, by this process's clock, never starts its handler
// (MessageRetry); one with less than a third of it left is renewed before
// any handler starts. A handler's context is cancelled, with a cause
// wrapping ErrLeaseLost, when the renewals find its lease lost, or when its
// lease runs out by this process's clock before a renewal got through,
// whatever a renewal in flight is doing; no renewal waits longer than the
// lease left, and one that fails is tried again within a third of what is
// left. The outcome of a handler whose lease was lost is not stored. The
// caller's cancellation reaches the handlers' contexts; once ctx is done no
// further handler starts, and the claims not run are released. The leases
// are renewed, and the outcomes stored, whatever happens to ctx, until the
// handlers have returned.
//
// Options that apply: WithConcurrency (1), WithFingerprints (none) and
// WithLease (the Keeper's lease), the lease of this call's claims. The
// error is non-nil only when nothing was done: nil key or handle, an option
// that does not apply or does not fit (ErrInvalidConfig), or ctx already
// done.
func Consume[M any](ctx context.Context, k *Keeper, scope string, msgs []M, key func(M) string, handle func(ctx context.Context, msg M) error, opts ...Option) ([]MessageResult, error) {
	if key == nil || handle == nil {
		return nil, fmt.Errorf("%w: Consume needs a key function and a handler", ErrInvalidConfig)
	}
	s, err := k.batchSettings(opts, toBatch|toConsume, "Consume", len(msgs))
	if err != nil {
		return nil, err
	}
	lease := k.policy.lease
	if s.policy.lease != 0 {
		lease = s.policy.lease
	}
	keys := make([]string, len(msgs))
	for i := range msgs {
		keys[i] = key(msgs[i])
	}
	claims, err := k.beginBatch(ctx, scope, keys, s.fingerprints, k.markers, lease)
	if err != nil {
		return nil, err
	}
	b := newConsumption(k, claims, lease)
	b.run(ctx, max(s.concurrency, 1), func(ctx context.Context, i int) error { return handle(ctx, msgs[i]) })
	return b.results, nil
}

// WithConcurrency makes Consume run up to n handlers at once, started in the
// order of the batch. Default: 1, one after another in order, for consumers
// whose messages must take effect in order. Applies to Consume.
func WithConcurrency(n int) Option {
	return Option{name: "WithConcurrency", to: toConsume, set: func(s *settings) { s.concurrency = n }}
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

// unclaimedResult is the result of a message whose key BeginBatch did not
// claim.
func unclaimedResult(r BatchResult) MessageResult {
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
