package idemjetstream

import (
	"fmt"
	"strconv"
	"time"

	"github.com/idemkit/idem"
	"github.com/nats-io/nats.go/jetstream"
)

// Defaults of a Runner.
const (
	// DefaultBatch is how many messages one Fetch asks for, and so the
	// largest batch one Consume call handles.
	DefaultBatch = 500
	// DefaultRetryDelay is the delay of NakWithDelay for a message that is
	// to come again for any reason but another holder's live lease (a
	// handler's error, Redis unreachable, a lease lost), and Run's pause
	// after a failed Fetch or a batch none of whose claims reached Redis.
	DefaultRetryDelay = time.Second
	// MinInProgressDelay is the shortest delay of NakWithDelay for a
	// message whose key another consumer holds: the time left on its lease,
	// but never less than this.
	MinInProgressDelay = 100 * time.Millisecond
)

// defaultAckWait is JetStream's AckWait when a consumer's config leaves it
// zero.
const defaultAckWait = 30 * time.Second

// idleWait is how long one pull request waits for a message when none is
// waiting; Run then asks again. ctx's end cuts it short.
const idleWait = 5 * time.Second

// backlogEvery is how often, at most, a Runner reads its consumer's info
// to report the backlog (idem.StepBacklog).
const backlogEvery = 10 * time.Second

// Option configures a Runner (New). Every setting an option accepts works;
// one it cannot take is refused by New with an error wrapping
// idem.ErrInvalidConfig.
type Option func(*settings) error

// settings are a Runner's options once read.
type settings struct {
	key         func(jetstream.Msg) string
	batch       int
	concurrency int
	lease       time.Duration // 0: the Keeper's
	retryDelay  time.Duration
	onError     func(error)
	deadLetter  DeadLetterFunc // nil: Term, and the error handler told
}

func defaultSettings() settings {
	return settings{key: MsgID, batch: DefaultBatch, concurrency: 1, retryDelay: DefaultRetryDelay}
}

// WithKey sets the key of a message: what makes two deliveries the same
// operation. A message whose key is empty, longer than 255 bytes or holds
// control characters is rejected (dead-lettered, WithDeadLetter, and Term).
// Default: MsgID, the Nats-Msg-Id header or, without one, the message's
// place in its stream, so that a message published twice without the
// header is handled twice; MsgIDRequired rejects such a message instead.
func WithKey(key func(jetstream.Msg) string) Option {
	return func(s *settings) error {
		if key == nil {
			return fmt.Errorf("%w: idemjetstream.WithKey: nil function", idem.ErrInvalidConfig)
		}
		s.key = key
		return nil
	}
}

// WithBatch sets how many messages one Fetch asks for: the largest batch
// one Consume call claims, handles and settles. Keep the consumer's
// MaxAckPending at least the batch times the number of runners, and its
// MaxRequestBatch, if set, at least the batch. Default: 500
// (DefaultBatch). It must be between 1 and 100,000.
func WithBatch(n int) Option {
	return func(s *settings) error {
		if n < 1 || n > 100_000 {
			return fmt.Errorf("%w: idemjetstream.WithBatch: %d is not between 1 and 100000", idem.ErrInvalidConfig, n)
		}
		s.batch = n
		return nil
	}
}

// WithConcurrency sets how many handlers of a batch run at once, started in
// the batch's order (idem.WithConcurrency). Default: 1, one after another
// in the order of the stream. It must be at least 1.
func WithConcurrency(n int) Option {
	return func(s *settings) error {
		if n < 1 {
			return fmt.Errorf("%w: idemjetstream.WithConcurrency: %d is less than 1", idem.ErrInvalidConfig, n)
		}
		s.concurrency = n
		return nil
	}
}

// WithLease sets the lease of the runner's claims (idem.WithLease given to
// Consume): after a runner dies, its messages are handled again once both
// the consumer's AckWait and this lease have run out. New refuses a
// consumer whose AckWait (or a BackOff duration) is shorter than the lease.
// Default: the Keeper's lease. It must be between one millisecond and
// idem.MaxDuration.
func WithLease(d time.Duration) Option {
	return func(s *settings) error {
		if d < time.Millisecond || d > idem.MaxDuration {
			return fmt.Errorf("%w: idemjetstream.WithLease: %s is not between 1ms and idem.MaxDuration", idem.ErrInvalidConfig, d)
		}
		s.lease = d
		return nil
	}
}

// WithRetryDelay sets the delay of NakWithDelay for a message that is to
// come again because its handler failed, Redis could not answer or the
// lease was lost, and Run's pause after a Fetch that failed or a batch none
// of whose claims reached Redis. A message whose key another consumer holds
// is delayed by the time left on that lease instead. Zero redelivers at once
// (Nak), and Run then does not pause. Default: 1s (DefaultRetryDelay). It
// must not be negative.
func WithRetryDelay(d time.Duration) Option {
	return func(s *settings) error {
		if d < 0 {
			return fmt.Errorf("%w: idemjetstream.WithRetryDelay: %s is negative", idem.ErrInvalidConfig, d)
		}
		s.retryDelay = d
		return nil
	}
}

// WithErrorHandler sets a function told of every error Run does not
// return: a Fetch that failed, and a batch none of whose claims reached
// Redis (the error wraps idem.ErrUnavailable, or a timeout; the batch's
// messages are Nak'ed with the retry delay), after either of which Run
// pauses for the retry delay and fetches again; an Ack, Nak, Term or
// InProgress that could not be sent (the message then comes again after the
// AckWait, and is answered as handled before); a message terminated while
// no dead-letter hook is set (WithDeadLetter; the error names the message
// and wraps the reason), a dead-letter hook's error, and a request for the
// consumer's info, to report its backlog, that failed. It may be called from
// several goroutines at once, and must be quick. Default: none.
func WithErrorHandler(f func(err error)) Option {
	return func(s *settings) error {
		s.onError = f
		return nil
	}
}

// MsgID is the default key of a message: its Nats-Msg-Id header, the id
// the producer gave it (jetstream.WithMsgID), which JetStream also uses to
// drop duplicates published within the stream's Duplicates window. A
// message without that header is keyed by its place in the stream,
// "nats-seq:" followed by the stream's name, the stream sequence and the
// time the message was stored (nanoseconds since 1970): its redeliveries are
// then handled once, but a producer's duplicate (a Publish retried after a
// lost acknowledgement, a message sent again) is stored as another message
// and handled again. A message whose metadata cannot be read has the empty
// key, and is rejected. MsgIDRequired keys by the header alone.
func MsgID(m jetstream.Msg) string {
	if id := m.Headers().Get(jetstream.MsgIDHeader); id != "" {
		return id
	}
	md, err := m.Metadata()
	if err != nil {
		return ""
	}
	b := make([]byte, 0, 64)
	b = append(b, "nats-seq:"...)
	b = append(b, md.Stream...)
	b = append(b, ':')
	b = strconv.AppendUint(b, md.Sequence.Stream, 10)
	b = append(b, ':')
	b = strconv.AppendInt(b, md.Timestamp.UnixNano(), 10)
	return string(b)
}

// MsgIDRequired is a key function (WithKey) that keys a message by its
// Nats-Msg-Id header alone: a message without it has the empty key, and
// is rejected, its reason wrapping idem.ErrInvalidKey: dead-lettered
// (WithDeadLetter; PublishDeadLetter's letter then has no Idem-Msg-Id) and
// terminated, never handled. Use it when every producer sets the header
// (jetstream.WithMsgID), so that one that forgets it is caught rather than
// having its duplicates handled twice.
func MsgIDRequired(m jetstream.Msg) string {
	return m.Headers().Get(jetstream.MsgIDHeader)
}
