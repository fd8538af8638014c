package idemjetstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/idemkit/idem"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrMaxDeliveries is wrapped by the reason given to the dead-letter hook
// for a message whose deliveries ran out: it was at its last delivery
// (NumDelivered at least the consumer's MaxDeliver) and was not handled, so
// JetStream would not deliver it again. The reason also wraps why it was
// not handled (the handler's error, idem.ErrInProgress, idem.ErrUnavailable,
// ...).
var ErrMaxDeliveries = errors.New("idemjetstream: the message's deliveries ran out (the consumer's MaxDeliver)")

// DeadLetterFunc is told of a message the runner gives up on (WithDeadLetter):
// reason says why. It returns nil once the dead letter is kept (published,
// stored, logged); the runner then terminates the message (Term). An error
// keeps the message: it is Nak'ed with the retry delay, comes again and is
// given to the function again, unless it was at its last delivery (then it
// is terminated all the same and the error reported to WithErrorHandler).
type DeadLetterFunc func(ctx context.Context, msg jetstream.Msg, reason error) error

// WithDeadLetter sets the function told of each message the runner gives up
// on, before it terminates the message (Term):
//
//   - a message idem rejects (idem.MessageRejected): its key is invalid
//     (empty, longer than 255 bytes, control characters; reason wraps
//     idem.ErrInvalidKey), used with another fingerprint (idem.ErrMismatch)
//     or its record is corrupt (idem.ErrCorrupt);
//   - a message at its last delivery, NumDelivered at least the consumer's
//     MaxDeliver (as New read it from the consumer's cached info), that is
//     not handled: its handler failed or panicked, its key is held by
//     another consumer, Redis could not store its outcome, Run stopped
//     before its handler started. A Nak would let it vanish (JetStream
//     delivers a message at most MaxDeliver times); reason wraps
//     ErrMaxDeliveries and why it was not handled.
//
// The function is called before Term, so a process that dies between the
// two leaves the message unacknowledged: a rejected message comes again
// after the AckWait and is dead-lettered again (at least once). It runs on
// Run's goroutine with a context that Run's end does not cancel, and Run
// waits for it: it must return. It may be called from several goroutines
// at once when Run is. PublishDeadLetter returns one that publishes to a
// subject.
//
// Default: none; such a message is terminated and the error handler
// (WithErrorHandler) is given an error that names it and wraps reason.
func WithDeadLetter(f DeadLetterFunc) Option {
	return func(s *settings) error {
		s.deadLetter = f
		return nil
	}
}

// Headers of a dead letter published by PublishDeadLetter, beside those of
// the message.
const (
	// HeaderReason is why the message was given up on: the reason's text,
	// control characters replaced by spaces, at most 4096 bytes.
	HeaderReason = "Idem-Reason"
	// HeaderStream is the name of the message's stream.
	HeaderStream = "Idem-Stream"
	// HeaderStreamSeq is the message's sequence in its stream.
	HeaderStreamSeq = "Idem-Stream-Seq"
	// HeaderDeliveries is how many times the consumer delivered it
	// (NumDelivered).
	HeaderDeliveries = "Idem-Deliveries"
	// HeaderSubject is the subject the message was published on.
	HeaderSubject = "Idem-Subject"
	// HeaderMsgID is the message's Nats-Msg-Id, when it had one.
	HeaderMsgID = "Idem-Msg-Id"
)

// PublishDeadLetter returns a DeadLetterFunc that publishes each message
// given up on to subject through js, and waits for JetStream's
// acknowledgement (a stream must capture subject, or every dead letter
// fails and its message comes again). The dead letter has the message's
// data and headers, and HeaderReason, HeaderStream, HeaderStreamSeq,
// HeaderDeliveries, HeaderSubject and HeaderMsgID. Its Nats-Msg-Id is
// "dead-letter:" followed by the stream, the stream sequence and the time
// the message was stored, so that the dead-letter stream drops a copy
// published again within its Duplicates window (a process that died
// between the publish and the Term), and keeps two messages that shared a
// Nats-Msg-Id apart.
func PublishDeadLetter(js jetstream.JetStream, subject string) DeadLetterFunc {
	return func(ctx context.Context, m jetstream.Msg, reason error) error {
		d := nats.NewMsg(subject)
		d.Data = m.Data()
		for k, vs := range m.Headers() {
			for _, v := range vs {
				d.Header.Add(k, v)
			}
		}
		if id := d.Header.Get(jetstream.MsgIDHeader); id != "" {
			d.Header.Set(HeaderMsgID, id)
		}
		d.Header.Del(jetstream.MsgIDHeader)
		d.Header.Set(HeaderReason, headerValue(fmt.Sprint(reason)))
		d.Header.Set(HeaderSubject, m.Subject())
		if md, err := m.Metadata(); err == nil {
			d.Header.Set(HeaderStream, md.Stream)
			d.Header.Set(HeaderStreamSeq, strconv.FormatUint(md.Sequence.Stream, 10))
			d.Header.Set(HeaderDeliveries, strconv.FormatUint(md.NumDelivered, 10))
			d.Header.Set(jetstream.MsgIDHeader, "dead-letter:"+md.Stream+":"+
				strconv.FormatUint(md.Sequence.Stream, 10)+":"+strconv.FormatInt(md.Timestamp.UnixNano(), 10))
		}
		_, err := js.PublishMsg(ctx, d)
		return err
	}
}

// headerValue is s fit for a header: control characters replaced by
// spaces, at most 4096 bytes.
func headerValue(s string) string {
	if len(s) > 4096 {
		s = s[:4096]
	}
	return strings.Map(func(r rune) rune {
		if r < ' ' || r == 0x7f {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(s, "?"))
}

// deadLetter gives m up: it tells the dead-letter hook (or, without one,
// the error handler) why, then terminates m. last says m was at its last
// delivery; a hook's error then terminates it all the same, otherwise m is
// Nak'ed with the retry delay, for the hook to be tried again.
// Once Term is sent, the Keeper's Observer is told (idem.StepStream,
// idem.ResultDeadLettered).
func (r *Runner) deadLetter(ctx context.Context, m jetstream.Msg, reason error, last bool) error {
	if r.s.deadLetter == nil {
		r.report(fmt.Errorf("idemjetstream: terminated %s: %w", describe(m), reason))
		return r.term(ctx, m, reason)
	}
	if err := r.s.deadLetter(context.WithoutCancel(ctx), m, reason); err != nil {
		r.report(fmt.Errorf("idemjetstream: dead letter of %s: %w", describe(m), err))
		if !last {
			return nak(m, r.s.retryDelay)
		}
	}
	return r.term(ctx, m, reason)
}

// term terminates m, given up on for reason, and tells the Keeper's
// Observer once Term is sent.
func (r *Runner) term(ctx context.Context, m jetstream.Msg, reason error) error {
	if err := m.Term(); err != nil {
		return err
	}
	if o := r.observer(); o != nil {
		o.Observe(ctx, idem.Event{Step: idem.StepStream, Result: idem.ResultDeadLettered, Scope: r.scope, Err: reason})
	}
	return nil
}

// describe names m in a report: its stream, stream sequence and delivery.
func describe(m jetstream.Msg) string {
	md, err := m.Metadata()
	if err != nil {
		return "a message"
	}
	return fmt.Sprintf("message %d of stream %s (delivery %d)", md.Sequence.Stream, md.Stream, md.NumDelivered)
}

// lastDelivery tells a message JetStream will not deliver again: the
// consumer has a MaxDeliver and the message has been delivered that many
// times.
func (r *Runner) lastDelivery(m jetstream.Msg) (n uint64, last bool) {
	if r.maxDeliver <= 0 {
		return 0, false
	}
	md, err := m.Metadata()
	if err != nil {
		return 0, false
	}
	return md.NumDelivered, md.NumDelivered >= uint64(r.maxDeliver)
}
