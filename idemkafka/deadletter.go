package idemkafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/idemkit/idem"
	"github.com/twmb/franz-go/pkg/kgo"
)

// ErrMaxDeliveries is wrapped by the reason a record is dead-lettered for
// when its handler failed WithMaxDeliveries times; the reason also wraps
// the last failure (the handler's error or panic).
var ErrMaxDeliveries = errors.New("idemkafka: the record's deliveries ran out (WithMaxDeliveries)")

// DeadLetterFunc is told of a record the Runner gives up on
// (WithDeadLetter); reason says why. It returns nil once the dead letter is
// kept (produced, stored, logged); the Runner then commits past the record.
// An error keeps the record: its partition waits the retry delay and the
// function is called again for it, so a partition never moves past a
// record that was neither handled nor kept.
type DeadLetterFunc func(ctx context.Context, rec *kgo.Record, reason error) error

// WithDeadLetter sets the function told of each record the Runner gives
// up on, before it commits past the record:
//
//   - a record idem rejects (idem.MessageRejected): its key is invalid
//     (empty, longer than 255 bytes, control characters; reason wraps
//     idem.ErrInvalidKey), used with another fingerprint (idem.ErrMismatch)
//     or its record in Redis is corrupt (idem.ErrCorrupt);
//   - a record whose handler failed or panicked WithMaxDeliveries times
//     (reason wraps ErrMaxDeliveries and the last failure).
//
// A process that dies between the hook and the commit calls it again for
// the record (at least once). It runs on a partition's goroutine with a
// context that Run's end does not cancel, and the partition waits for it:
// it must return. It may be called from several goroutines at once.
//
// Default: none, and no WithDeadLetterTopic: the record is given up on
// (committed past) and the error handler (WithErrorHandler) is given an
// error that names it and wraps the reason.
func WithDeadLetter(f DeadLetterFunc) Option {
	return func(s *settings) error {
		s.deadLetter = f
		return nil
	}
}

// WithDeadLetterTopic makes the Runner produce each record it gives up on
// (see WithDeadLetter) to topic, with the Runner's own client, and wait for
// Kafka's acknowledgement before it commits past the record. The dead
// letter has the record's key, value and headers, and HeaderReason,
// HeaderTopic, HeaderPartition and HeaderOffset. WithDeadLetter, when also
// given, takes precedence. Default: none.
func WithDeadLetterTopic(topic string) Option {
	return func(s *settings) error {
		if topic == "" {
			return fmt.Errorf("%w: idemkafka.WithDeadLetterTopic: empty topic", idem.ErrInvalidConfig)
		}
		s.deadTopic = topic
		return nil
	}
}

// Headers of a dead letter produced by WithDeadLetterTopic, beside those
// of the record.
const (
	// HeaderReason is why the record was given up on: the reason's text,
	// control characters replaced by spaces, at most 4096 bytes.
	HeaderReason = "idem-reason"
	// HeaderTopic is the topic the record was consumed from.
	HeaderTopic = "idem-topic"
	// HeaderPartition is its partition, in decimal.
	HeaderPartition = "idem-partition"
	// HeaderOffset is its offset, in decimal.
	HeaderOffset = "idem-offset"
)

// produceDeadLetter produces rec to the dead-letter topic with why it was
// given up on.
func (r *Runner) produceDeadLetter(ctx context.Context, rec *kgo.Record, reason error) error {
	d := &kgo.Record{Topic: r.s.deadTopic, Key: rec.Key, Value: rec.Value}
	d.Headers = append(d.Headers, rec.Headers...)
	d.Headers = append(d.Headers,
		kgo.RecordHeader{Key: HeaderReason, Value: []byte(headerValue(fmt.Sprint(reason)))},
		kgo.RecordHeader{Key: HeaderTopic, Value: []byte(rec.Topic)},
		kgo.RecordHeader{Key: HeaderPartition, Value: []byte(strconv.FormatInt(int64(rec.Partition), 10))},
		kgo.RecordHeader{Key: HeaderOffset, Value: []byte(strconv.FormatInt(rec.Offset, 10))},
	)
	return r.client.ProduceSync(ctx, d).FirstErr()
}

// headerValue is s fit for a header: control characters replaced by
// spaces, at most 4096 bytes.
func headerValue(s string) string {
	if len(s) > 4096 {
		s = s[:4096]
	}
	return strings.Map(func(c rune) rune {
		if c < ' ' || c == 0x7f {
			return ' '
		}
		return c
	}, strings.ToValidUTF8(s, "?"))
}

// deadLetter gives rec up for reason: it tells the dead-letter hook, or
// produces it to the dead-letter topic, or, with neither, tells the error
// handler. It returns the hook's (or the produce's) error: the record is
// then kept. Once given up on, the Keeper's Observer is told
// (idem.StepStream, idem.ResultDeadLettered).
func (r *Runner) deadLetter(ctx context.Context, rec *kgo.Record, reason error) error {
	ctx = context.WithoutCancel(ctx)
	var err error
	switch {
	case r.s.deadLetter != nil:
		err = r.s.deadLetter(ctx, rec, reason)
	case r.s.deadTopic != "":
		err = r.produceDeadLetter(ctx, rec, reason)
	default:
		r.report(fmt.Errorf("idemkafka: gave up on %s: %w", describe(rec), reason))
	}
	if err != nil {
		r.report(fmt.Errorf("idemkafka: dead letter of %s: %w", describe(rec), err))
		return err
	}
	if o := r.observer(); o != nil {
		o.Observe(ctx, idem.Event{Step: idem.StepStream, Result: idem.ResultDeadLettered, Scope: r.scope, Err: reason})
	}
	return nil
}

// describe names rec in a report: its topic, partition and offset.
func describe(rec *kgo.Record) string {
	return fmt.Sprintf("record %s/%d@%d", rec.Topic, rec.Partition, rec.Offset)
}
