package idem

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// StreamConsumer is one consumer of a consumer group of a Redis stream: Run
// reads the group's entries with XREADGROUP, handles each batch with
// Consume, acknowledges with XACK what Consume says to, moves rejected
// entries to a dead-letter stream, and takes over with XAUTOCLAIM the
// entries that other consumers of the group (dead ones) left pending. Make
// one with NewStreamConsumer; it is safe to Run once at a time.
type StreamConsumer struct {
	k                   *Keeper
	client              redis.Cmdable
	stream, group, name string
	scope, deadLetter   string
	batch               int64
	minIdle             time.Duration
	consume             settings
}

// NewStreamConsumer returns the consumer named consumer of group on stream,
// handling entries with k. Its scope, the scope of its keys in k, is
// stream + " " + group, so that each group handles an entry once.
//
// Options that apply: WithBatchSize (100), the most entries read and
// handled at once; WithDeadLetter (stream + ":dead-letter"); and those of
// Consume: WithConcurrency (1), WithLease (the Keeper's), WithSettleWindow
// (10 ms, 128), and WithWait (default: the lease), how long a batch waits
// for the outcome of an entry whose key another consumer holds.
//
// Entries pending for longer than the lease, not acknowledged by the
// consumer they were delivered to, are taken over with XAUTOCLAIM (min-idle
// time: the lease). An entry is delivered, then its key claimed; the
// consumer renews its claim while it works and acknowledges once the outcome
// is stored. So an entry idle for a lease belongs to a consumer that died
// (its claim runs out at most a lease after its last renewal: the taker
// waits for that, up to its WithWait, and runs the handler, Recovered), or
// to one still working on a long batch (the taker waits, then leaves the
// entry pending; the holder acknowledges it).
func NewStreamConsumer(k *Keeper, client redis.Cmdable, stream, group, consumer string, opts ...Option) (*StreamConsumer, error) {
	if k == nil || client == nil || stream == "" || group == "" || consumer == "" {
		return nil, fmt.Errorf("%w: NewStreamConsumer needs a Keeper, a client, a stream, a group and a consumer name", ErrInvalidConfig)
	}
	s, err := k.batchSettings(opts, toStream, "a StreamConsumer", 0)
	if err != nil {
		return nil, err
	}
	if s.batchSize < 0 {
		return nil, fmt.Errorf("%w: WithBatchSize: %d is negative", ErrInvalidConfig, s.batchSize)
	}
	c := &StreamConsumer{
		k: k, client: client, stream: stream, group: group, name: consumer,
		scope: stream + " " + group, deadLetter: s.deadLetter, batch: int64(s.batchSize), consume: s,
	}
	if c.deadLetter == "" {
		c.deadLetter = stream + ":dead-letter"
	}
	if c.batch == 0 {
		c.batch = 100
	}
	lease := k.policy.lease
	if s.policy.lease != 0 {
		lease = s.policy.lease
	}
	c.minIdle = lease
	if !s.waitSet {
		c.consume.wait = lease
	}
	return c, nil
}

// WithBatchSize sets how many entries a StreamConsumer reads (XREADGROUP
// COUNT, XAUTOCLAIM COUNT) and handles at once. Default: 100. Applies to a
// StreamConsumer.
func WithBatchSize(n int) Option {
	return Option{name: "WithBatchSize", to: toStream, set: func(s *settings) { s.batchSize = n }}
}

// WithDeadLetter sets the stream to which a StreamConsumer moves the entries
// Consume rejects (MessageRejected: an invalid key, a fingerprint mismatch,
// a corrupt record): each is added there (XADD) with its fields and three
// more, idem-stream, idem-id (the entry's id) and idem-error, then
// acknowledged. Default: the stream's name + ":dead-letter". Applies to a
// StreamConsumer.
func WithDeadLetter(stream string) Option {
	return Option{name: "WithDeadLetter", to: toStream, set: func(s *settings) { s.deadLetter = stream }}
}

// streamBlock is how long one XREADGROUP waits for entries: it bounds how
// long Run takes to notice that its context is done while the stream is
// idle.
const streamBlock = time.Second

// Run consumes entries until ctx is done, then returns ctx's error; or
// returns, before reading, an error from creating the group. key gives an
// entry's key (nil: the entry's id, which catches redeliveries but not a
// producer's duplicates; give the producer's idempotency key when there is
// one); handle handles an entry, as Consume's handler (its context carries
// the Claim).
//
// Run creates the group at the start of the stream (XGROUP CREATE ... 0
// MKSTREAM) if there is none. It first reads the entries pending for this
// consumer's name (a restart), then new ones. Every half lease it sweeps
// the group's entries idle for a lease with XAUTOCLAIM and handles them as
// a batch. After each batch it acknowledges, in one pipeline, the entries
// Consume acknowledges and the rejected ones, the latter once added to the
// dead-letter stream (a crash between the two adds one again: the
// dead-letter stream is at least once). Entries answered MessageRetry stay
// pending, for the sweep of whichever consumer comes first.
//
// A stream command or a Consume that fails with ErrUnavailable is reported
// to the Keeper's Observer (StepStream, ResultUnavailable) and tried again
// after a pause that doubles from 10 ms up to a second. When ctx is done,
// no further entry is read nor handler started; the handlers under way run
// to the end with a context that is not cancelled, and their outcomes are
// stored and acknowledged; entries read but not started are released for
// redelivery.
func (c *StreamConsumer) Run(ctx context.Context, key func(redis.XMessage) string, handle func(ctx context.Context, msg redis.XMessage) error) error {
	if handle == nil {
		return fmt.Errorf("%w: StreamConsumer.Run needs a handler", ErrInvalidConfig)
	}
	if key == nil {
		key = func(m redis.XMessage) string { return m.ID }
	}
	err := c.client.XGroupCreateMkStream(ctx, c.stream, c.group, "0").Err()
	if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
		return fmt.Errorf("idem: StreamConsumer: creating group %q of %q: %w", c.group, c.stream, storeError(ctx, "xgroup create", err))
	}
	hctx := context.WithoutCancel(ctx)
	pause := time.Duration(0)
	backlog := true // this name's own pending entries first
	var sweepAt time.Time
	cursor := "0-0"
	for ctx.Err() == nil {
		if pause > 0 {
			t := time.NewTimer(pause)
			select {
			case <-ctx.Done():
				t.Stop()
				return ctx.Err()
			case <-t.C:
			}
		}
		var msgs []redis.XMessage
		var err error
		switch now := c.k.now(); {
		case !now.Before(sweepAt):
			var next string
			msgs, next, err = c.client.XAutoClaim(hctx, &redis.XAutoClaimArgs{
				Stream: c.stream, Group: c.group, Consumer: c.name, MinIdle: c.minIdle, Start: cursor, Count: c.batch,
			}).Result()
			if err == nil {
				cursor = next
				if cursor == "0-0" {
					sweepAt = now.Add(c.minIdle / 2)
				}
			}
		default:
			id := ">"
			if backlog {
				id = "0"
			}
			var streams []redis.XStream
			streams, err = c.client.XReadGroup(hctx, &redis.XReadGroupArgs{
				Group: c.group, Consumer: c.name, Streams: []string{c.stream, id}, Count: c.batch, Block: streamBlock,
			}).Result()
			if errors.Is(err, redis.Nil) {
				err = nil
			}
			for _, s := range streams {
				msgs = append(msgs, s.Messages...)
			}
			if err == nil && backlog && len(msgs) == 0 {
				backlog = false
			}
		}
		if err == nil && len(msgs) > 0 {
			err = c.handle(ctx, hctx, msgs, key, handle)
		}
		if err != nil {
			c.report(hctx, ResultUnavailable, err)
			pause = min(max(2*pause, 10*time.Millisecond), time.Second)
			continue
		}
		pause = 0
	}
	return ctx.Err()
}

// handle runs Consume on msgs and acknowledges or dead-letters them.
func (c *StreamConsumer) handle(stop, ctx context.Context, msgs []redis.XMessage, key func(redis.XMessage) string, handle func(context.Context, redis.XMessage) error) error {
	keys := make([]string, len(msgs))
	for i := range msgs {
		keys[i] = key(msgs[i])
	}
	s := c.consume
	res, err := c.k.consume(ctx, stop, c.scope, keys, &s, func(ctx context.Context, i int) error { return handle(ctx, msgs[i]) })
	if res == nil {
		return err
	}
	var ack []string
	pipe := c.client.Pipeline()
	for i, r := range res {
		switch {
		case r.Ack:
			ack = append(ack, msgs[i].ID)
		case r.Status == MessageRejected:
			values := make(map[string]any, len(msgs[i].Values)+3)
			for f, v := range msgs[i].Values {
				values[f] = v
			}
			values["idem-stream"], values["idem-id"], values["idem-error"] = c.stream, msgs[i].ID, fmt.Sprint(r.Err)
			pipe.XAdd(ctx, &redis.XAddArgs{Stream: c.deadLetter, Values: values})
			ack = append(ack, msgs[i].ID)
			c.report(ctx, errorResult(r.Err), r.Err)
		}
	}
	if len(ack) > 0 {
		pipe.XAck(ctx, c.stream, c.group, ack...)
	}
	if pipe.Len() > 0 {
		if _, perr := pipe.Exec(ctx); perr != nil {
			return errors.Join(err, storeError(ctx, "xack", perr))
		}
	}
	return err
}

// report tells the Keeper's Observer, if any, of a StepStream.
func (c *StreamConsumer) report(ctx context.Context, r Result, err error) {
	if c.k.observer != nil {
		c.k.observer.Observe(ctx, Event{Step: StepStream, Result: r, Scope: c.scope, Err: err})
	}
}
