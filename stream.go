package idem

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// StreamConsumer is one consumer of a consumer group of a Redis stream: Run
// reads the group's entries with XREADGROUP, handles each batch with
// Consume, acknowledges with XACK what Consume says to, moves rejected
// entries and entries that failed too many deliveries to a dead-letter
// stream, and takes over with XAUTOCLAIM the entries that other consumers
// of the group (dead ones) left pending, and its own that failed. Make one
// with NewStreamConsumer; it is safe to Run once at a time.
type StreamConsumer struct {
	k                   *Keeper
	client              redis.Cmdable
	stream, group, name string
	scope, deadLetter   string
	batch               int64
	maxDeliveries       int64
	minIdle             time.Duration
	idleConsumers       time.Duration // 0: other consumers are not removed
	consume             settings
}

// NewStreamConsumer returns the consumer named consumer of group on stream,
// handling entries with k. Its scope, the scope of its keys in k, is
// stream + " " + group, so that each group handles an entry once.
//
// Options that apply: WithBatchSize (100), the most entries read and
// handled at once; WithDeadLetter (stream + ":dead-letter");
// WithMaxDeliveries (5), the deliveries of an entry before it is
// dead-lettered; WithIdleConsumerRemoval (the longer of an hour and ten
// leases), how long another consumer of the group that holds nothing must
// have been idle before its name is removed; and those of
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
	if s.maxDeliveriesSet && s.maxDeliveries < 1 {
		return nil, fmt.Errorf("%w: WithMaxDeliveries: %d is less than 1", ErrInvalidConfig, s.maxDeliveries)
	}
	if s.idleConsumersSet && s.idleConsumers < 0 {
		return nil, fmt.Errorf("%w: WithIdleConsumerRemoval: %s is negative", ErrInvalidConfig, s.idleConsumers)
	}
	c := &StreamConsumer{
		k: k, client: client, stream: stream, group: group, name: consumer,
		scope: stream + " " + group, deadLetter: s.deadLetter, batch: int64(s.batchSize),
		maxDeliveries: int64(s.maxDeliveries), consume: s,
	}
	c.consume.panicAsError = true
	if !s.maxDeliveriesSet {
		c.maxDeliveries = defaultMaxDeliveries
	}
	if c.deadLetter == "" {
		c.deadLetter = stream + deadLetterSuffix
	}
	if c.batch == 0 {
		c.batch = defaultStreamBatch
	}
	lease := k.policy.lease
	if s.policy.lease != 0 {
		lease = s.policy.lease
	}
	c.minIdle = lease
	c.idleConsumers = max(defaultIdleConsumers, idleConsumerLeases*lease)
	if s.idleConsumersSet {
		c.idleConsumers = s.idleConsumers
	}
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
// a corrupt record) and those whose deliveries ran out (WithMaxDeliveries):
// each is added there (XADD) with its fields and four more, idem-stream,
// idem-id (the entry's id), idem-error (why: the rejection, or the
// handler's last error) and idem-deliveries (how many times the group
// delivered it, XPENDING's counter; left out when the entry left the
// consumer's pending entries before it was counted), then acknowledged.
// Default: the stream's name + ":dead-letter". Applies to a StreamConsumer.
func WithDeadLetter(stream string) Option {
	return Option{name: "WithDeadLetter", to: toStream, set: func(s *settings) { s.deadLetter = stream }}
}

// WithMaxDeliveries sets how many times a StreamConsumer lets its group
// deliver an entry (XPENDING's delivery counter: XREADGROUP and XAUTOCLAIM
// count one each) before it gives up on it: an entry whose handler fails
// (an error that is not Final, or a panic) on its n-th delivery or later is
// moved to the dead-letter stream (WithDeadLetter) and acknowledged (unless
// its outcome could not be stored: ErrUnavailable), and an entry delivered
// more than n times (its earlier runs never reported a failure: the process
// died in them) is moved there without running its handler. Either needs this consumer to hold the entry's key: an entry
// whose key another consumer holds stays pending for that one to settle,
// and one handled already is acknowledged. Since a failed entry comes back
// after a lease idle (XAUTOCLAIM), a handler that keeps failing runs n
// times, about a lease apart. Default: 5; n must be at least 1. Applies to
// a StreamConsumer.
func WithMaxDeliveries(n int) Option {
	return Option{name: "WithMaxDeliveries", to: toStream, set: func(s *settings) { s.maxDeliveries, s.maxDeliveriesSet = n, true }}
}

// WithIdleConsumerRemoval sets how long another consumer of a
// StreamConsumer's group must have been idle (XINFO CONSUMERS' idle: since
// its last read or claim), holding no pending entry, before the
// StreamConsumer removes its name from the group (XGROUP DELCONSUMER), so
// that the names of consumers that died or were renamed (a pod's name, a
// hostname) do not pile up. The check is made at the end of each sweep
// (every half lease), in one script that reads XINFO CONSUMERS and deletes
// in the same atomic step: a consumer that reads an entry can never lose it
// to the deletion (XGROUP DELCONSUMER drops the deleted consumer's pending
// entries), and a consumer holding pending entries is never removed,
// however long it has been idle (its entries wait for XAUTOCLAIM). A live
// consumer reads at least every second while it has nothing to do, and
// holds its batch's entries while it handles them, so it is idle that long
// only when every entry of a batch taking longer than d was taken over by
// others; removing it then costs nothing, as its next read adds its name
// again. The consumer never removes its own name. Default: the longer of
// an hour and ten leases; 0 turns removal off; d must not be negative.
// Applies to a StreamConsumer.
func WithIdleConsumerRemoval(d time.Duration) Option {
	return Option{name: "WithIdleConsumerRemoval", to: toStream, set: func(s *settings) { s.idleConsumers, s.idleConsumersSet = d, true }}
}

// streamForgetIdle removes the consumers of a group (ARGV[1]) of a stream
// (KEYS[1]) other than ARGV[2] that hold no pending entry and have been
// idle at least ARGV[3] milliseconds, in one atomic step: none can read an
// entry between the check and the deletion. It returns their names.
var streamForgetIdle = redis.NewScript(`
local removed = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] ~= ARGV[2] and tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    removed[#removed + 1] = f['name']
  end
end
return removed
`)

// forgetIdle removes the group's other consumers idle for longer than
// WithIdleConsumerRemoval that hold nothing (streamForgetIdle), and
// returns their names; a failure is reported to the Observer.
func (c *StreamConsumer) forgetIdle(ctx context.Context) []string {
	if c.idleConsumers <= 0 {
		return nil
	}
	names, err := streamForgetIdle.Run(ctx, c.client, []string{c.stream}, c.group, c.name, c.idleConsumers.Milliseconds()).StringSlice()
	if err != nil {
		err = storeError(ctx, "xgroup delconsumer", err)
		c.report(ctx, errorResult(err), err)
	}
	if c.k.observer != nil {
		for _, n := range names {
			c.k.observer.Observe(ctx, Event{Step: StepStream, Result: ResultRemoved, Scope: c.scope, ID: n})
		}
	}
	return names
}

// streamBacklog answers the pending entries and the lag of a group
// (ARGV[1]) of a stream (KEYS[1]), from XINFO GROUPS: {pending, lag}, lag
// -1 when the server does not give it (before Redis 7.0; null when Redis
// cannot count it) or gives it without the count it rests on (an
// entries-read of null once the group has read: miniredis, whose lag is
// then the stream's length); false when there is no such group.
var streamBacklog = redis.NewScript(streamBacklogSrc)

const streamBacklogSrc = `
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  if f['name'] == ARGV[1] then
    local lag = -1
    if type(f['lag']) == 'number' and (type(f['entries-read']) == 'number' or f['last-delivered-id'] == '0-0') then
      lag = f['lag']
    end
    return {f['pending'], lag}
  end
end
return false
`

// backlog tells the Keeper's Observer the group's backlog (StepBacklog),
// or, when it cannot be read, that the store is unavailable (StepStream).
func (c *StreamConsumer) backlog(ctx context.Context) {
	started := c.k.now()
	v, err := streamBacklog.Run(ctx, c.client, []string{c.stream}, c.group).Int64Slice()
	if errors.Is(err, redis.Nil) {
		return // no group: Run creates it, or it was deleted
	}
	if err == nil && len(v) != 2 {
		err = fmt.Errorf("XINFO GROUPS answered %v", v)
	}
	if err != nil {
		err = storeError(ctx, "xinfo groups", err)
		c.report(ctx, errorResult(err), err)
		return
	}
	c.k.observer.Observe(ctx, Event{Step: StepBacklog, Result: ResultDone, Scope: c.scope,
		Pending: v[0], Lag: v[1], Took: c.k.now().Sub(started)})
}

// Run consumes entries until ctx is done, then returns ctx's error; or
// returns, before reading, an error from creating the group. key gives an
// entry's key (nil: the entry's id, which catches redeliveries but not a
// producer's duplicates; give the producer's idempotency key when there is
// one); handle handles an entry, as Consume's handler (its context carries
// the Claim).
//
// Run creates the group at the start of the stream (XGROUP CREATE ... 0
// MKSTREAM) if there is none. It first reads, once, the entries pending
// for this consumer's name (a restart): from "0", then from past the last
// entry each read returned, until one returns none; then new entries
// (">"). Every half lease it sweeps the group's entries idle for a lease
// with XAUTOCLAIM and handles them as a batch; at the end of each sweep it
// removes the group's other consumers that hold nothing and have been idle
// long (WithIdleConsumerRemoval). After each batch it
// acknowledges, in one pipeline, the entries Consume acknowledges and the
// rejected ones and those whose deliveries ran out (WithMaxDeliveries), the
// latter once added to the dead-letter stream (a crash between the two
// adds one again: the dead-letter stream is at least once). Entries
// answered MessageRetry stay pending, and are not read again by this
// consumer's first read of its own: they wait for the sweep of whichever
// consumer comes first, a lease after their delivery, so that a failing
// entry neither runs in a loop nor holds back new ones. A handler's panic
// is a failure of its entry (MessageRetry, with an error that holds the
// panic's value and stack), not of Run: the batch goes on.
//
// The Keeper's Observer, if any, is told, beside the steps of Consume:
// each entry moved to the dead-letter stream, once it is there
// (StepStream, ResultDeadLettered, Err why); each consumer name removed
// (StepStream, ResultRemoved, ID the name); and the group's backlog
// (StepBacklog: Lag, XINFO GROUPS' lag, -1 where the server does not give
// it; Pending, the group's pending entries), as Run starts and then every
// 10 seconds (by the Keeper's clock), in one read (XINFO GROUPS) that is
// not made without an Observer. A stream command or a Consume that fails
// with ErrUnavailable is reported to the Observer (StepStream,
// ResultUnavailable) and tried again after a pause that doubles from 10 ms
// up to a second. When ctx is done,
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
	backlog := "0" // this name's own pending entries first, read once: the id to read after; "" once read
	var sweepAt, backlogAt time.Time
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
		if now := c.k.now(); c.k.observer != nil && !now.Before(backlogAt) {
			backlogAt = now.Add(backlogEvery)
			c.backlog(hctx)
		}
		var msgs []redis.XMessage
		var err error
		redelivered := true // delivered before: their delivery counts are asked for
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
					c.forgetIdle(hctx)
				}
			}
		default:
			id := backlog
			if id == "" {
				id, redelivered = ">", false
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
			if err == nil && backlog != "" {
				backlog = ""
				if len(msgs) > 0 {
					backlog = msgs[len(msgs)-1].ID
				}
			}
		}
		var deliveries []int64
		if err == nil && len(msgs) > 0 && redelivered {
			deliveries, err = c.deliveries(hctx, msgs)
		}
		if err == nil && len(msgs) > 0 {
			err = c.handle(ctx, hctx, msgs, deliveries, key, handle)
		}
		if err != nil {
			c.report(hctx, ResultUnavailable, err)
			pause = min(max(2*pause, runPauseFirst), runPauseCap)
			continue
		}
		pause = 0
	}
	return ctx.Err()
}

// deliveries returns how many times the group delivered each of msgs,
// entries delivered before: XPENDING's counters over the range of their
// ids, for this consumer, in one call (a call more only when entries not
// in msgs, pending for it, lie between theirs); 0 for one no longer
// pending for this consumer. msgs are in id order, as Redis returns them.
func (c *StreamConsumer) deliveries(ctx context.Context, msgs []redis.XMessage) ([]int64, error) {
	at := make(map[string]int, len(msgs))
	for i, m := range msgs {
		at[m.ID] = i
	}
	n := make([]int64, len(msgs))
	start, end := msgs[0].ID, msgs[len(msgs)-1].ID
	count := int64(len(msgs)) + 1 // one more, so a range read on from its last id moves past it
	for len(at) > 0 {
		p, err := c.client.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: c.stream, Group: c.group, Start: start, End: end, Count: count, Consumer: c.name}).Result()
		if err != nil {
			return nil, storeError(ctx, "xpending", err)
		}
		for _, e := range p {
			if i, ok := at[e.ID]; ok {
				n[i] = e.RetryCount
				delete(at, e.ID)
			}
		}
		if int64(len(p)) < count {
			break
		}
		start = p[len(p)-1].ID
	}
	return n, nil
}

// handle runs Consume on msgs and acknowledges or dead-letters them.
// deliveries are their delivery counts; nil for entries read new (one
// delivery each).
func (c *StreamConsumer) handle(stop, ctx context.Context, msgs []redis.XMessage, deliveries []int64, key func(redis.XMessage) string, handle func(context.Context, redis.XMessage) error) error {
	keys := make([]string, len(msgs))
	for i := range msgs {
		keys[i] = key(msgs[i])
	}
	delivered := func(i int) int64 {
		if deliveries == nil {
			return 1
		}
		return deliveries[i]
	}
	s := c.consume
	res, err := c.k.consume(ctx, stop, c.scope, keys, &s, func(ctx context.Context, i int) error {
		if n := delivered(i); n > c.maxDeliveries {
			return fmt.Errorf("idem: not handled: delivered %d times, more than WithMaxDeliveries' %d", n, c.maxDeliveries)
		}
		return handle(ctx, msgs[i])
	})
	if res == nil {
		return err
	}
	var ack []string
	var dead []error // why each entry added to the dead-letter stream was
	pipe := c.client.Pipeline()
	deadLetter := func(i int, why error) {
		values := make(map[string]any, len(msgs[i].Values)+4)
		for f, v := range msgs[i].Values {
			values[f] = v
		}
		values["idem-stream"], values["idem-id"], values["idem-error"] = c.stream, msgs[i].ID, fmt.Sprint(why)
		if n := delivered(i); n > 0 {
			values["idem-deliveries"] = strconv.FormatInt(n, 10)
		}
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: c.deadLetter, Values: values})
		ack = append(ack, msgs[i].ID)
		dead = append(dead, why)
	}
	for i, r := range res {
		switch {
		case r.Ack:
			ack = append(ack, msgs[i].ID)
		case r.Status == MessageRejected:
			deadLetter(i, r.Err)
		case r.Status == MessageRetry && r.Ran && delivered(i) >= c.maxDeliveries &&
			!errors.Is(r.Err, ErrLeaseLost) && !errors.Is(r.Err, ErrUnavailable):
			// Its handler ran here, holding its key, and failed: its
			// deliveries have run out. (A lost lease leaves it to the new
			// holder; an outcome not stored, which may be a success, to
			// the next delivery.)
			deadLetter(i, r.Err)
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
	for _, why := range dead {
		c.report(ctx, ResultDeadLettered, why)
	}
	return err
}

// report tells the Keeper's Observer, if any, of a StepStream.
func (c *StreamConsumer) report(ctx context.Context, r Result, err error) {
	if c.k.observer != nil {
		c.k.observer.Observe(ctx, Event{Step: StepStream, Result: r, Scope: c.scope, Err: err})
	}
}
