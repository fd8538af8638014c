package idemwatermill

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/idemkit/idem"
)

// Middleware returns a watermill handler middleware that runs its handler
// at most once per message key (the UUID by default, see WithKeyFunc) and
// scope (the handler's name, see WithScope), with idem.Do, and answers every
// redelivery with the messages the first run produced:
//
//   - The first delivery of a key claims it in Redis, runs the handler with
//     the claim in the message's context (idem.ClaimFromContext: fencing
//     token, Recovered), stores the messages the handler returned (UUID,
//     metadata, payload, encoded by the Keeper's Codec, msgpack by default)
//     and returns them to the router, which publishes them and acknowledges
//     the message.
//   - A later delivery returns new messages equal to the stored ones (the
//     same UUIDs, so that consumers downstream can drop the copies), without
//     running the handler: the router publishes them again and acknowledges.
//     A first run whose output was never published (the publish failed, the
//     process died before it) has it published by the redelivery.
//   - A handler error releases the key and is returned as is, so the router
//     nacks the message and its redelivery runs the handler again. A panic
//     releases the key too, and panics again. An error wrapped with
//     idem.Final is stored instead, and every redelivery gets it back (an
//     *idem.FinalError): route those to a poison queue (see IsPermanent).
//   - A delivery while another one runs the key gets an error wrapping
//     idem.ErrInProgress (nacked: it comes again), or with
//     WithCallOptions(idem.WithWait(d)) waits for the first one's output.
//
// A message is refused, before the handler runs, with an error wrapping
// idem.ErrInvalidKey (no key, or the KeyFunc's error) or idem.ErrMismatch
// (the key was first used with another payload, see WithFingerprint); a
// store that cannot be reached gives an error wrapping idem.ErrUnavailable
// and the handler does not run. The router nacks each of these.
//
// If the handler succeeded but its output could not be stored
// (idem.ErrUnavailable), the output is returned all the same, so that it is
// published once: the side effect happened. The key then stays in progress
// until its lease runs out; a later delivery runs the handler again, with
// Claim.Recovered set. If the claim was lost meanwhile (idem.ErrLeaseLost:
// another delivery holds the key), the output is dropped and the error
// returned: that delivery's output stands.
//
// Redeliveries later than the Keeper's retention (by default 24 h,
// idem.DefaultRetention) run the handler again. Middleware refuses a nil
// Keeper or an empty WithMetadataKey with an error wrapping
// idem.ErrInvalidConfig. Place it inside watermill's Retry middleware, so
// that each retry is a delivery to it, and inside a poison queue.
func Middleware(k *idem.Keeper, opts ...Option) (message.HandlerMiddleware, error) {
	c, err := newConfig(k, opts)
	if err != nil {
		return nil, err
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return c.handle(k, h, msg)
		}
	}, nil
}

// handle runs h for msg once per key; see Middleware.
func (c *config) handle(k *idem.Keeper, h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	key, err := c.key(msg)
	switch {
	case err != nil:
		return nil, fmt.Errorf("idemwatermill: the key of message %q: %w", msg.UUID, errors.Join(idem.ErrInvalidKey, err))
	case key == "":
		return nil, fmt.Errorf("idemwatermill: message %q has no key: %w", msg.UUID, idem.ErrInvalidKey)
	}
	scope := message.HandlerNameFromCtx(msg.Context())
	if c.scope != nil {
		scope = *c.scope
	}
	opts := c.opts
	if c.fingerprint != nil {
		opts = append(opts[:len(opts):len(opts)], idem.WithFingerprint(c.fingerprint(msg)))
	}

	// Set by fn, which Do calls (if at all) on this goroutine before it
	// returns.
	var (
		ran, handled bool
		produced     []*message.Message
	)
	stored, err := idem.Do(msg.Context(), k, scope, key, func(ctx context.Context) (output, error) {
		ran = true
		outer := msg.Context()
		msg.SetContext(ctx)
		defer msg.SetContext(outer)
		msgs, err := h(msg)
		if err != nil {
			return nil, err
		}
		handled, produced = true, msgs
		return seal(msgs), nil
	}, opts...)
	switch {
	case !ran && err == nil:
		return stored.open(), nil
	case err == nil:
		return produced, nil
	case handled && errors.Is(err, idem.ErrUnavailable) && !errors.Is(err, idem.ErrLeaseLost):
		// The handler's side effect happened and only storing its output
		// failed: publish it now rather than never.
		return produced, nil
	}
	return nil, err
}

// IsPermanent reports whether err, returned by Middleware's handler, is one
// that every redelivery of the message gets again: no key, another
// fingerprint, a corrupt record, or a stored idem.Final error. It suits
// watermill's middleware.PoisonQueueWithFilter, placed outside Middleware.
// Other errors (the handler's own, ErrInProgress, ErrUnavailable,
// ErrLeaseLost) may clear on a redelivery.
func IsPermanent(err error) bool {
	var final *idem.FinalError
	return errors.Is(err, idem.ErrInvalidKey) || errors.Is(err, idem.ErrMismatch) ||
		errors.Is(err, idem.ErrCorrupt) || errors.As(err, &final)
}
