package idemkafka

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"time"

	"github.com/idemkit/idem"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Defaults of a Runner.
const (
	// DefaultBatch is the most records of one partition that one
	// idem.Consume call claims, handles and settles.
	DefaultBatch = 500
	// DefaultMaxInFlight is the most records a Runner holds at once: polled
	// from Kafka and not yet settled (handled, replayed or dead-lettered),
	// across every partition it owns.
	DefaultMaxInFlight = 2000
	// DefaultMaxDeliveries is how many times a Runner runs a record's
	// handler, each failing or panicking, before it dead-letters the record.
	DefaultMaxDeliveries = 5
	// DefaultRetryDelay is how long a partition waits before its first
	// unsettled record is tried again: after a handler's error, a batch
	// none of whose claims reached Redis, a dead-letter hook's error.
	DefaultRetryDelay = time.Second
	// MinInProgressDelay is the shortest wait before a record whose key
	// another consumer holds is tried again: the time left on that lease,
	// but never less than this.
	MinInProgressDelay = 100 * time.Millisecond
)

// Option configures a Runner (New). Every setting an option accepts works;
// one it cannot take is refused by New with an error wrapping
// idem.ErrInvalidConfig.
type Option func(*settings) error

// settings are a Runner's options once read.
type settings struct {
	key           func(*kgo.Record) string
	batch         int
	maxInFlight   int
	concurrency   int
	maxDeliveries int
	lease         time.Duration // 0: the Keeper's
	retryDelay    time.Duration
	onError       func(error)
	deadLetter    DeadLetterFunc // nil: deadTopic, or the error handler told
	deadTopic     string
}

func defaultSettings() settings {
	return settings{
		key: Position, batch: DefaultBatch, maxInFlight: DefaultMaxInFlight, concurrency: 1,
		maxDeliveries: DefaultMaxDeliveries, retryDelay: DefaultRetryDelay,
	}
}

// WithKey sets the key of a record: what makes two deliveries the same
// operation. A record whose key is empty, longer than 255 bytes or holds
// control characters is rejected (dead-lettered at once, WithDeadLetter).
// Default: Position, the record's place in its partition, so that every
// redelivery of a record is answered from its stored outcome, but a
// producer that sends the same message twice has it handled twice.
// RecordKey keys by the record's Kafka key, Header by a header the producer
// sets (its idempotency id): then a producer's duplicate, wherever it
// lands, is answered as handled before.
func WithKey(key func(*kgo.Record) string) Option {
	return func(s *settings) error {
		if key == nil {
			return fmt.Errorf("%w: idemkafka.WithKey: nil function", idem.ErrInvalidConfig)
		}
		s.key = key
		return nil
	}
}

// WithBatch sets the most records of one partition that one idem.Consume
// call claims, handles and settles (a poll may bring more; they wait for
// the next call). Default: 500 (DefaultBatch). It must be between 1 and
// 100,000.
func WithBatch(n int) Option {
	return func(s *settings) error {
		if n < 1 || n > 100_000 {
			return fmt.Errorf("%w: idemkafka.WithBatch: %d is not between 1 and 100000", idem.ErrInvalidConfig, n)
		}
		s.batch = n
		return nil
	}
}

// WithMaxInFlight sets the most records the Runner holds at once, across
// the partitions it owns: polled and not yet settled. Run polls no more
// while it holds that many. Default: 2000 (DefaultMaxInFlight). It must be
// between 1 and 1,000,000.
func WithMaxInFlight(n int) Option {
	return func(s *settings) error {
		if n < 1 || n > 1_000_000 {
			return fmt.Errorf("%w: idemkafka.WithMaxInFlight: %d is not between 1 and 1000000", idem.ErrInvalidConfig, n)
		}
		s.maxInFlight = n
		return nil
	}
}

// WithConcurrency sets how many handlers of one partition's batch run at
// once, started in the partition's order (idem.WithConcurrency). The
// partitions the Runner owns are handled side by side whatever this is.
// Default: 1, one after another in the order of the partition. It must be
// at least 1.
func WithConcurrency(n int) Option {
	return func(s *settings) error {
		if n < 1 {
			return fmt.Errorf("%w: idemkafka.WithConcurrency: %d is less than 1", idem.ErrInvalidConfig, n)
		}
		s.concurrency = n
		return nil
	}
}

// WithMaxDeliveries sets how many times the Runner runs a record's handler,
// each one failing (an error that is not idem's Final, a panic, a lease
// lost), before it gives the record up: dead-lettered (WithDeadLetter) and
// its offset committed, so that its partition goes on. The count is kept
// by the Runner while it owns the partition: Kafka keeps none, so a record
// that comes again after a rebalance or a restart starts from zero. A
// record whose key another consumer holds, or whose claim did not reach
// Redis, is tried again without counting. Default: 5
// (DefaultMaxDeliveries). It must be at least 1.
func WithMaxDeliveries(n int) Option {
	return func(s *settings) error {
		if n < 1 {
			return fmt.Errorf("%w: idemkafka.WithMaxDeliveries: %d is less than 1", idem.ErrInvalidConfig, n)
		}
		s.maxDeliveries = n
		return nil
	}
}

// WithLease sets the lease of the runner's claims (idem.WithLease given to
// Consume): after a runner dies, the records it was handling are handled
// again, told Recovered, once the new owner of their partition reads them
// and the lease has run out. Default: the Keeper's lease. It must be
// between one millisecond and idem.MaxDuration.
func WithLease(d time.Duration) Option {
	return func(s *settings) error {
		if d < time.Millisecond || d > idem.MaxDuration {
			return fmt.Errorf("%w: idemkafka.WithLease: %s is not between 1ms and idem.MaxDuration", idem.ErrInvalidConfig, d)
		}
		s.lease = d
		return nil
	}
}

// WithRetryDelay sets how long a partition waits before its first
// unsettled record is tried again, after its handler failed, a batch none
// of whose claims reached Redis, or a dead-letter hook's error. A record
// whose key another consumer holds waits for the time left on that lease
// instead (at least MinInProgressDelay). Zero tries again at once.
// Default: 1s (DefaultRetryDelay). It must not be negative.
func WithRetryDelay(d time.Duration) Option {
	return func(s *settings) error {
		if d < 0 {
			return fmt.Errorf("%w: idemkafka.WithRetryDelay: %s is negative", idem.ErrInvalidConfig, d)
		}
		s.retryDelay = d
		return nil
	}
}

// WithErrorHandler sets a function told of every error Run does not
// return: a poll's error, a batch none of whose claims reached Redis (the
// error wraps idem.ErrUnavailable), a commit that failed (its records are
// settled in Redis all the same, and a redelivery is answered as handled
// before), a record given up on while no dead-letter hook or topic is set
// (the error names the record and wraps the reason), and a dead-letter
// hook's error. It may be called from several goroutines at once, and must
// be quick. Default: none.
func WithErrorHandler(f func(err error)) Option {
	return func(s *settings) error {
		s.onError = f
		return nil
	}
}

// Position is the default key of a record (WithKey): its place in Kafka,
// "kafka:" followed by the topic, the partition, the offset and the
// record's timestamp (nanoseconds since 1970), so that a topic deleted and
// made again, whose offsets start again at zero, is not answered from the
// old one's outcomes. A topic name that would make the key longer than 255
// bytes is replaced by a digest of it. Every redelivery of a record
// (a rebalance, a restart, a commit that did not land) is answered from its
// stored outcome; a producer's duplicate (a send retried by the
// application, not by an idempotent producer, which Kafka itself drops) is
// another record at another offset, and is handled again. Key by RecordKey
// or Header when the producer gives each message an id.
func Position(r *kgo.Record) string {
	topic := r.Topic
	if len(topic) > 160 {
		sum := sha256.Sum256([]byte(topic))
		topic = "sha256-" + hex.EncodeToString(sum[:16])
	}
	b := make([]byte, 0, 32+len(topic))
	b = append(b, "kafka:"...)
	b = append(b, topic...)
	b = append(b, ':')
	b = strconv.AppendInt(b, int64(r.Partition), 10)
	b = append(b, ':')
	b = strconv.AppendInt(b, r.Offset, 10)
	b = append(b, ':')
	b = strconv.AppendInt(b, r.Timestamp.UnixNano(), 10)
	return string(b)
}

// RecordKey is a key function (WithKey) that keys a record by its Kafka
// key, as bytes. Use it only when the key is the message's own id: a key
// that names an entity (a customer, an order) is shared by many messages,
// and all but the first of them would be answered as handled before. A
// record without a key, or whose key is longer than 255 bytes or holds
// control characters, is rejected (dead-lettered).
func RecordKey(r *kgo.Record) string { return string(r.Key) }

// Header returns a key function (WithKey) that keys a record by the value
// of its first header named name (a producer's idempotency id): a
// producer's duplicate is then answered as handled before, whichever
// partition or topic of the Runner it lands in. A record without the
// header is rejected (dead-lettered).
func Header(name string) func(*kgo.Record) string {
	return func(r *kgo.Record) string {
		for _, h := range r.Headers {
			if h.Key == name {
				return string(h.Value)
			}
		}
		return ""
	}
}
