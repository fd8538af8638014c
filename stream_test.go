package idem

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStreamConsumerDeadLettersAndTakesOver: an entry whose key is invalid
// goes to the dead-letter stream, acknowledged; an entry a dead consumer
// read and never acknowledged is taken over once idle for the lease, and
// its handler told Recovered when the dead consumer had claimed it.
func TestStreamConsumerDeadLettersAndTakesOver(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		c := b.Client
		lease := 300 * time.Millisecond
		rec := &recorder{}
		k := newKeeper(t, b, WithLease(lease), WithRetention(time.Hour), WithObserver(rec))
		add := func(id string) {
			require.NoError(t, c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": id}}).Err())
		}
		add("dead-held")
		require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())
		// A consumer that read the entry, claimed its key, and died.
		got, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "dead", Streams: []string{"s", ">"}, Count: 1}).Result()
		require.NoError(t, err)
		require.Len(t, got[0].Messages, 1)
		out, err := k.batchBegin(ctx, "s g", []string{"dead-held"})
		require.NoError(t, err)
		require.NotNil(t, out[0].Outcome.Claim)
		add("") // an invalid key
		add("fine")
		add("fine") // a producer's duplicate

		sc, err := NewStreamConsumer(k, c, "s", "g", "live")
		require.NoError(t, err)
		var handled, recovered atomic.Int32
		stop := runStream(sc, entryID, func(ctx context.Context, m redis.XMessage) error {
			handled.Add(1)
			if c, _ := ClaimFromContext(ctx); c.Recovered() {
				recovered.Add(1)
			}
			return nil
		})
		deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
		for {
			p, err := c.XPending(ctx, "s", "g").Result()
			require.NoError(t, err)
			if p.Count == 0 && handled.Load() == 2 {
				break
			}
			if !b.Real {
				b.Advance(50 * time.Millisecond) // miniredis's idle times and leases move with its clock
			}
			require.True(t, time.Now().Before(deadline), "pending %d, handled %d", p.Count, handled.Load())
			time.Sleep(10 * time.Millisecond)
		}
		require.ErrorIs(t, stop(), context.Canceled)
		assert.EqualValues(t, 2, handled.Load(), "fine once, dead-held once")
		assert.EqualValues(t, 1, recovered.Load(), "dead-held taken over")
		dl, err := c.XRange(ctx, "s:dead-letter", "-", "+").Result()
		require.NoError(t, err)
		require.Len(t, dl, 1)
		assert.Equal(t, "", dl[0].Values["id"])
		assert.Contains(t, dl[0].Values["idem-error"], "key")
		evs := rec.of(StepStream, ResultDeadLettered)
		require.Len(t, evs, 1, "the Observer is told of the dead letter")
		assert.ErrorIs(t, evs[0].Err, ErrInvalidKey)
		assert.Equal(t, "s g", evs[0].Scope)
	})
}

// TestStreamConsumerWithDeadLetter: WithDeadLetter names the stream the
// rejected entries go to, with the fields the default one gets; the default
// stream is not written, and the entries are acknowledged.
func TestStreamConsumerWithDeadLetter(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		c := b.Client
		k := newKeeper(t, b, WithLease(time.Second), WithRetention(time.Hour))
		require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())
		for _, id := range []string{"", "fine"} { // "": an invalid key
			require.NoError(t, c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": id, "body": "b-" + id}}).Err())
		}
		sc, err := NewStreamConsumer(k, c, "s", "g", "live", WithDeadLetter("rejects"))
		require.NoError(t, err)
		var handled atomic.Int32
		stop := runStream(sc, entryID, func(context.Context, redis.XMessage) error {
			handled.Add(1)
			return nil
		})
		deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
		for {
			p, err := c.XPending(ctx, "s", "g").Result()
			require.NoError(t, err)
			n, err := c.XLen(ctx, "rejects").Result()
			require.NoError(t, err)
			if p.Count == 0 && handled.Load() == 1 && n == 1 {
				break
			}
			require.True(t, time.Now().Before(deadline), "pending %d, handled %d, dead-lettered %d", p.Count, handled.Load(), n)
			time.Sleep(10 * time.Millisecond)
		}
		require.ErrorIs(t, stop(), context.Canceled)
		dl, err := c.XRange(ctx, "rejects", "-", "+").Result()
		require.NoError(t, err)
		require.Len(t, dl, 1)
		assert.Equal(t, "", dl[0].Values["id"])
		assert.Equal(t, "b-", dl[0].Values["body"], "the entry's own fields are kept")
		assert.Contains(t, dl[0].Values["idem-error"], "key")
		exists, err := c.Exists(ctx, "s:dead-letter").Result()
		require.NoError(t, err)
		assert.Zero(t, exists, "the default dead-letter stream is not written")
		assert.EqualValues(t, 1, handled.Load(), "the valid entry is handled, the rejected one is not")
	})
}

func TestStreamConsumerRefusesMisuse(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	for name, opts := range map[string][]Option{
		"WithFingerprints":    {WithFingerprints(nil)},
		"negative batch":      {WithBatchSize(-1)},
		"negative wait":       {WithWait(-time.Second)},
		"WithSettleWindow 0":  {WithSettleWindow(0, 0)},
		"WithMaxDeliveries 0": {WithMaxDeliveries(0)},
		"negative deliveries": {WithMaxDeliveries(-1)},
		"negative idle":       {WithIdleConsumerRemoval(-time.Second)},
	} {
		_, err := NewStreamConsumer(k, b.Client, "s", "g", "c", opts...)
		assert.ErrorIs(t, err, ErrInvalidConfig, name)
	}
	_, err := NewStreamConsumer(k, b.Client, "s", "", "c")
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = NewStreamConsumer(k, b.Client, "s", "g", "c", WithMaxDeliveries(1))
	assert.NoError(t, err, "one delivery is a limit")
	sc, err := NewStreamConsumer(k, b.Client, "s", "g", "c")
	require.NoError(t, err)
	assert.EqualValues(t, 5, sc.maxDeliveries, "WithMaxDeliveries' default")
	assert.Equal(t, time.Hour, sc.idleConsumers, "WithIdleConsumerRemoval's default at a 30s lease")
	sc, err = NewStreamConsumer(k, b.Client, "s", "g", "c", WithLease(10*time.Minute))
	require.NoError(t, err)
	assert.Equal(t, 100*time.Minute, sc.idleConsumers, "WithIdleConsumerRemoval's default: ten leases when longer than an hour")
	sc, err = NewStreamConsumer(k, b.Client, "s", "g", "c", WithIdleConsumerRemoval(0))
	require.NoError(t, err)
	assert.Empty(t, sc.forgetIdle(context.Background()), "0 turns removal off")
}

// consumerNames returns the names of group g of stream s, and how many
// entries each holds pending.
func consumerNames(t *testing.T, c *redis.Client) map[string]int64 {
	t.Helper()
	cs, err := c.XInfoConsumers(context.Background(), "s", "g").Result()
	require.NoError(t, err)
	names := map[string]int64{}
	for _, x := range cs {
		names[x.Name] = x.Pending
	}
	return names
}

// TestStreamConsumerRemovesIdleConsumers: the names of the group's other
// consumers that hold nothing and have been idle for WithIdleConsumerRemoval
// are removed; one that holds a pending entry, however idle, one that was
// active lately, and the consumer's own are kept. Run removes them at the
// end of its sweep.
func TestStreamConsumerRemovesIdleConsumers(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		c := b.Client
		const idle = 1500 * time.Millisecond
		rec := &recorder{}
		k := newKeeper(t, b, WithLease(10*time.Second), WithRetention(time.Hour), WithObserver(rec))
		removed := func() []string {
			var names []string
			for _, ev := range rec.of(StepStream, ResultRemoved) {
				assert.Equal(t, "s g", ev.Scope)
				names = append(names, ev.ID)
			}
			return names
		}
		require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())
		read := func(consumer string, ack bool) {
			require.NoError(t, c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": consumer}}).Err())
			got, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: consumer, Streams: []string{"s", ">"}, Count: 1}).Result()
			require.NoError(t, err)
			require.Len(t, got[0].Messages, 1)
			if ack {
				require.NoError(t, c.XAck(ctx, "s", "g", got[0].Messages[0].ID).Err())
			}
			if !b.Real {
				// miniredis's XINFO CONSUMERS answers idle -1 (never
				// removed) for a consumer XREADGROUP made; XCLAIM of no
				// entry sets it, as XREADGROUP does on redis-server.
				require.NoError(t, c.XClaim(ctx, &redis.XClaimArgs{Stream: "s", Group: "g", Consumer: consumer, Messages: []string{"0-1"}}).Err())
			}
		}
		read("gone", true)      // died holding nothing
		read("holder", false)   // died holding an entry: never removed
		read("c", true)         // this consumer's own name
		read("restarted", true) // reads again below
		b.Advance(idle + 100*time.Millisecond)
		read("restarted", true)

		sc, err := NewStreamConsumer(k, c, "s", "g", "c", WithIdleConsumerRemoval(idle))
		require.NoError(t, err)
		assert.Equal(t, []string{"gone"}, sc.forgetIdle(ctx))
		assert.Equal(t, []string{"gone"}, removed(), "the Observer is told of the removal, by name")
		assert.Equal(t, map[string]int64{"holder": 1, "c": 0, "restarted": 0}, consumerNames(t, c),
			"the holder keeps its pending entry; the others are kept")

		// Run removes them at the end of its sweep, the first thing it does.
		read("gone-too", true)
		b.Advance(idle + 100*time.Millisecond)
		read("restarted", true)
		stop := runStream(sc, nil, func(ctx context.Context, m redis.XMessage) error { return nil })
		deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
		for {
			names := consumerNames(t, c)
			if _, ok := names["gone-too"]; !ok {
				assert.Equal(t, map[string]int64{"holder": 1, "c": 0, "restarted": 0}, names)
				break
			}
			require.True(t, time.Now().Before(deadline), "gone-too still in the group: %v", names)
			time.Sleep(10 * time.Millisecond)
		}
		require.ErrorIs(t, stop(), context.Canceled)
		assert.Equal(t, []string{"gone", "gone-too"}, removed())
	})
}

// TestStreamConsumerReadsItsBacklogOnce: a consumer restarted under its old
// name reads its own pending entries first, once: an entry of that backlog
// whose handler fails (a plain error: MessageRetry, left pending) is not
// read again by it, but left to XAUTOCLAIM, a lease after its delivery
// (here 10 s); the consumer goes on to new entries. (It used to read its
// backlog from "0" until a read returned none: the failing entry came back
// at once, its handler ran 12,641 times in 1.5 s, and no new entry was
// read.)
func TestStreamConsumerReadsItsBacklogOnce(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		c := b.Client
		k := newKeeper(t, b, WithLease(10*time.Second))
		add := func(id string) {
			require.NoError(t, c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": id}}).Err())
		}
		add("poison")
		add("a")
		require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())
		// The consumer's previous process read both entries and died.
		got, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c1", Streams: []string{"s", ">"}, Count: 10}).Result()
		require.NoError(t, err)
		require.Len(t, got[0].Messages, 2)

		sc, err := NewStreamConsumer(k, c, "s", "g", "c1")
		require.NoError(t, err)
		var mu sync.Mutex
		runs := map[string]int{}
		ran := func(id string) int {
			mu.Lock()
			defer mu.Unlock()
			return runs[id]
		}
		stop := runStream(sc, entryID,
			func(ctx context.Context, m redis.XMessage) error {
				id := m.Values["id"].(string)
				mu.Lock()
				runs[id]++
				mu.Unlock()
				if id == "poison" {
					return errors.New("a transient failure")
				}
				return nil
			})
		deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
		for ran("a") == 0 || ran("poison") == 0 {
			require.True(t, time.Now().Before(deadline), "the backlog was never handled")
			time.Sleep(5 * time.Millisecond)
		}
		add("b") // a new entry
		for ran("b") == 0 {
			require.True(t, time.Now().Before(deadline), "a new entry is never read while a backlog entry fails (poison ran %d times)", ran("poison"))
			time.Sleep(5 * time.Millisecond)
		}
		require.ErrorIs(t, stop(), context.Canceled)

		mu.Lock()
		defer mu.Unlock()
		t.Logf("handler runs: %v", runs)
		assert.Equal(t, 1, runs["a"])
		assert.LessOrEqual(t, runs["poison"], 2, "a failing backlog entry is run again at once, in a loop, not after a lease")
		assert.Equal(t, 1, runs["b"], "a new entry is never read while a backlog entry fails")
		// The failing entry is left pending, for XAUTOCLAIM: delivered
		// twice, by the dead process's read and by the backlog's.
		p, err := c.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: "s", Group: "g", Start: "-", End: "+", Count: 10}).Result()
		require.NoError(t, err)
		require.Len(t, p, 1)
		assert.Equal(t, got[0].Messages[0].ID, p[0].ID)
		assert.EqualValues(t, 2, p[0].RetryCount)
	})
}

// TestStreamConsumerAsksDeliveriesOncePerBatch: a batch of entries
// delivered before costs one XPENDING, not one per entry, and each entry's
// count is its own: the one delivered 4 times is dead-lettered unrun.
func TestStreamConsumerAsksDeliveriesOncePerBatch(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		c := b.Client
		var cnt redistest.Counter
		c.AddHook(&cnt)
		k := newKeeper(t, b, WithLease(10*time.Second))
		ids := map[string]string{}
		for _, key := range []string{"a", "b", "crashes", "c", "d"} {
			id, err := c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": key}}).Result()
			require.NoError(t, err)
			ids[key] = id
		}
		require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())
		// The consumer's previous processes read every entry; "crashes"
		// was delivered twice more.
		_, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c1", Streams: []string{"s", ">"}, Count: 10}).Result()
		require.NoError(t, err)
		for range 2 {
			require.NoError(t, c.XClaim(ctx, &redis.XClaimArgs{Stream: "s", Group: "g", Consumer: "c1", Messages: []string{ids["crashes"]}}).Err())
		}

		sc, err := NewStreamConsumer(k, c, "s", "g", "c1", WithMaxDeliveries(3))
		require.NoError(t, err)
		var mu sync.Mutex
		runs := map[string]int{}
		stop := runStream(sc, entryID,
			func(ctx context.Context, m redis.XMessage) error {
				mu.Lock()
				defer mu.Unlock()
				runs[m.Values["id"].(string)]++
				return nil
			})
		deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
		for {
			n, err := c.XLen(ctx, "s:dead-letter").Result()
			require.NoError(t, err)
			mu.Lock()
			handled := len(runs)
			mu.Unlock()
			if n == 1 && handled == 4 {
				break
			}
			require.True(t, time.Now().Before(deadline), "%d dead letters, %d entries handled", n, handled)
			time.Sleep(5 * time.Millisecond)
		}
		require.ErrorIs(t, stop(), context.Canceled)
		assert.EqualValues(t, 1, cnt.Named("xpending"), "one XPENDING for the backlog's batch of 5")

		mu.Lock()
		defer mu.Unlock()
		assert.Equal(t, map[string]int{"a": 1, "b": 1, "c": 1, "d": 1}, runs)
		dl, err := c.XRange(ctx, "s:dead-letter", "-", "+").Result()
		require.NoError(t, err)
		require.Len(t, dl, 1)
		assert.Equal(t, ids["crashes"], dl[0].Values["idem-id"])
		assert.Equal(t, "4", dl[0].Values["idem-deliveries"])

		// Entries between a batch's, pending for the consumer but not in
		// the batch, cost a call more; one no longer pending counts 0.
		for _, key := range []string{"e", "f", "g", "h", "i"} {
			id, err := c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": key}}).Result()
			require.NoError(t, err)
			ids[key] = id
		}
		got, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c1", Streams: []string{"s", ">"}, Count: 10}).Result()
		require.NoError(t, err)
		msgs := got[0].Messages
		require.Len(t, msgs, 5)
		require.NoError(t, c.XClaim(ctx, &redis.XClaimArgs{Stream: "s", Group: "g", Consumer: "c1", Messages: []string{ids["g"]}}).Err())
		require.NoError(t, c.XAck(ctx, "s", "g", ids["i"]).Err())
		before := cnt.Named("xpending")
		n, err := sc.deliveries(ctx, []redis.XMessage{msgs[0], msgs[2], msgs[4]})
		require.NoError(t, err)
		assert.Equal(t, []int64{1, 2, 0}, n, "e read once, g twice, i acknowledged")
		assert.EqualValues(t, 2, cnt.Named("xpending")-before, "f and h lie between e, g and i")
		before = cnt.Named("xpending")
		n, err = sc.deliveries(ctx, msgs[:4])
		require.NoError(t, err)
		assert.Equal(t, []int64{1, 1, 2, 1}, n)
		assert.EqualValues(t, 1, cnt.Named("xpending")-before)
	})
}

// TestStreamConsumerDeadLettersAfterMaxDeliveries: with WithMaxDeliveries(3)
// an entry whose handler keeps failing, one whose handler panics, and one
// new entry that keeps failing are moved to the dead-letter stream and
// acknowledged after their third delivery's failure, with the handler's
// error and the delivery count; an entry delivered more than 3 times (its
// runs killed the process) is moved there without running; the panics do
// not stop Run; and a new entry is handled while the failing ones wait for
// their next delivery.
func TestStreamConsumerDeadLettersAfterMaxDeliveries(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		c := b.Client
		lease := 300 * time.Millisecond
		rec := &recorder{}
		k := newKeeper(t, b, WithLease(lease), WithObserver(rec))
		ids := map[string]string{} // the entries' ids, by their idem key
		add := func(key string) {
			id, err := c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": key}}).Result()
			require.NoError(t, err)
			ids[key] = id
		}
		for _, key := range []string{"fails", "panics", "crashes", "a"} {
			add(key)
		}
		require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())
		// The consumer's previous processes: one read every entry and
		// died; "crashes" killed two more (a delivery each: XCLAIM).
		got, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c1", Streams: []string{"s", ">"}, Count: 10}).Result()
		require.NoError(t, err)
		require.Len(t, got[0].Messages, 4)
		for range 2 {
			require.NoError(t, c.XClaim(ctx, &redis.XClaimArgs{Stream: "s", Group: "g", Consumer: "c1", Messages: []string{ids["crashes"]}}).Err())
		}

		sc, err := NewStreamConsumer(k, c, "s", "g", "c1", WithMaxDeliveries(3))
		require.NoError(t, err)
		var mu sync.Mutex
		runs := map[string]int{}
		ran := func(key string) int {
			mu.Lock()
			defer mu.Unlock()
			return runs[key]
		}
		stop := runStream(sc, entryID,
			func(ctx context.Context, m redis.XMessage) error {
				key := m.Values["id"].(string)
				mu.Lock()
				runs[key]++
				mu.Unlock()
				switch key {
				case "fails", "late-fails":
					return errors.New("downstream refused")
				case "panics":
					panic("boom")
				}
				return nil
			})
		deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
		for ran("a") == 0 || ran("fails") == 0 || ran("panics") == 0 {
			require.True(t, time.Now().Before(deadline), "the backlog was never handled: %v", runs)
			time.Sleep(5 * time.Millisecond)
		}
		add("b")
		add("late-fails")
		for ran("b") == 0 || ran("late-fails") == 0 {
			require.True(t, time.Now().Before(deadline), "new entries never handled: %v", runs)
			time.Sleep(5 * time.Millisecond)
		}
		if !b.Real {
			// miniredis's clock has not moved: no entry was idle for
			// XAUTOCLAIM yet, so the failing ones ran once, and the new
			// entries did not wait for them.
			assert.Equal(t, 1, ran("fails"))
			assert.Equal(t, 1, ran("panics"))
		}
		for {
			n, err := c.XLen(ctx, "s:dead-letter").Result()
			require.NoError(t, err)
			p, err := c.XPending(ctx, "s", "g").Result()
			require.NoError(t, err)
			if n == 4 && p.Count == 0 {
				break
			}
			require.True(t, time.Now().Before(deadline), "%d dead letters, %d pending, runs %v", n, p.Count, runs)
			if !b.Real {
				b.Advance(50 * time.Millisecond) // miniredis's idle times and leases move with its clock
			}
			time.Sleep(10 * time.Millisecond)
		}
		require.ErrorIs(t, stop(), context.Canceled, "Run goes on after a handler's panic")

		mu.Lock()
		defer mu.Unlock()
		t.Logf("handler runs: %v", runs)
		assert.Equal(t, map[string]int{"fails": 2, "panics": 2, "a": 1, "b": 1, "late-fails": 3}, runs,
			"the backlog's failing entries ran on their 2nd and 3rd deliveries, the new one on its 1st to 3rd; crashes never")
		dl, err := c.XRange(ctx, "s:dead-letter", "-", "+").Result()
		require.NoError(t, err)
		letters := map[string]map[string]any{}
		for _, m := range dl {
			letters[m.Values["id"].(string)] = m.Values
		}
		require.Len(t, letters, 4)
		for key, want := range map[string]struct{ deliveries, err string }{
			"fails":      {"3", "downstream refused"},
			"late-fails": {"3", "downstream refused"},
			"panics":     {"3", "the handler panicked: boom"},
			"crashes":    {"4", "delivered 4 times, more than WithMaxDeliveries' 3"},
		} {
			v := letters[key]
			require.NotNil(t, v, key)
			assert.Equal(t, "s", v["idem-stream"], key)
			assert.Equal(t, ids[key], v["idem-id"], key)
			assert.Equal(t, want.deliveries, v["idem-deliveries"], key)
			assert.Contains(t, v["idem-error"], want.err, key)
		}
		var why []string
		for _, ev := range rec.of(StepStream, ResultDeadLettered) {
			why = append(why, ev.Err.Error())
		}
		require.Len(t, why, 4, "the Observer is told of each dead letter: %q", why)
		for _, want := range []string{"downstream refused", "the handler panicked: boom", "delivered 4 times"} {
			assert.True(t, slices.ContainsFunc(why, func(w string) bool { return strings.Contains(w, want) }), "%q in %q", want, why)
		}
	})
}

// of returns the events of step and result told so far, leaving them.
func (r *recorder) of(step Step, result Result) []Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Event
	for _, ev := range r.evs {
		if ev.Step == step && ev.Result == result {
			out = append(out, ev)
		}
	}
	return out
}

// offsetClock is time.Now moved forward by what Advance adds.
type offsetClock struct{ offset atomic.Int64 }

func (c *offsetClock) Now() time.Time          { return time.Now().Add(time.Duration(c.offset.Load())) }
func (c *offsetClock) Advance(d time.Duration) { c.offset.Add(int64(d)) }

// TestStreamConsumerReportsItsBacklog: a stream of 10 entries whose group
// has delivered 4 (to another consumer, which holds them): as Run starts,
// before it reads, the Observer is told the group's lag, 6 (-1 on
// miniredis, whose lag is not the group's), and its pending entries, 4;
// once Run has handled the 6, the next report, 10 seconds later by the
// Keeper's clock and not before, says lag 0 and still 4 pending.
func TestStreamConsumerReportsItsBacklog(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		c := b.Client
		rec := &recorder{}
		clock := &offsetClock{}
		k := newKeeper(t, b, WithObserver(rec), WithClock(clock.Now))
		for i := range 10 {
			require.NoError(t, c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"n": i}}).Err())
		}
		require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())
		got, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "other", Streams: []string{"s", ">"}, Count: 4}).Result()
		require.NoError(t, err)
		require.Len(t, got[0].Messages, 4)

		sc, err := NewStreamConsumer(k, c, "s", "g", "c")
		require.NoError(t, err)
		var handled atomic.Int32
		stop := runStream(sc, nil, func(ctx context.Context, m redis.XMessage) error {
			handled.Add(1)
			return nil
		})
		wantLag := func(lag int64) int64 {
			if !b.Real {
				return -1
			}
			return lag
		}
		deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
		for handled.Load() < 6 || p(t, c) != 4 {
			require.True(t, time.Now().Before(deadline), "handled %d", handled.Load())
			time.Sleep(5 * time.Millisecond)
		}
		evs := rec.of(StepBacklog, ResultDone)
		require.Len(t, evs, 1, "one report as Run starts, none before 10 s")
		assert.Equal(t, "s g", evs[0].Scope)
		assert.Equal(t, wantLag(6), evs[0].Lag, "6 entries not delivered to the group")
		assert.EqualValues(t, 4, evs[0].Pending, "4 delivered to the other consumer, not acknowledged")

		clock.Advance(backlogEvery)
		for len(rec.of(StepBacklog, ResultDone)) < 2 {
			require.True(t, time.Now().Before(deadline), "no second report")
			time.Sleep(5 * time.Millisecond)
		}
		require.ErrorIs(t, stop(), context.Canceled)
		evs = rec.of(StepBacklog, ResultDone)
		assert.Len(t, evs, 2)
		assert.Equal(t, wantLag(0), evs[1].Lag, "every entry delivered")
		assert.EqualValues(t, 4, evs[1].Pending, "the other consumer's 4 are still pending")
		assert.Empty(t, rec.of(StepStream, ResultUnavailable))
	})
}

// TestStreamConsumerReadsNoBacklogUnobserved: without an Observer, Run
// never reads XINFO GROUPS.
func TestStreamConsumerReadsNoBacklogUnobserved(t *testing.T) {
	b := redistest.Miniredis(t)
	ctx := context.Background()
	reads := &backlogReads{}
	b.Client.AddHook(reads)
	k := newKeeper(t, b)
	require.NoError(t, b.Client.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"n": 1}}).Err())
	sc, err := NewStreamConsumer(k, b.Client, "s", "g", "c")
	require.NoError(t, err)
	var handled atomic.Int32
	stop := runStream(sc, nil, func(ctx context.Context, m redis.XMessage) error { handled.Add(1); return nil })
	deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
	for handled.Load() < 1 {
		require.True(t, time.Now().Before(deadline))
		time.Sleep(5 * time.Millisecond)
	}
	require.ErrorIs(t, stop(), context.Canceled)
	assert.Zero(t, reads.n.Load())
}

// backlogReads is a go-redis hook that counts the runs of streamBacklog.
type backlogReads struct{ n atomic.Int32 }

func (h *backlogReads) count(cmds ...redis.Cmder) {
	for _, cmd := range cmds {
		for _, a := range cmd.Args() {
			if a == streamBacklog.Hash() || a == streamBacklogSrc {
				h.n.Add(1)
			}
		}
	}
}

func (h *backlogReads) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *backlogReads) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.count(cmd)
		return next(ctx, cmd)
	}
}

func (h *backlogReads) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.count(cmds...)
		return next(ctx, cmds)
	}
}

// p is the count of the pending entries of group g of stream s.
func p(t *testing.T, c *redis.Client) int64 {
	t.Helper()
	x, err := c.XPending(context.Background(), "s", "g").Result()
	require.NoError(t, err)
	return x.Count
}

// runStream runs sc with key and handle until stop, which returns Run's
// error.
func runStream(sc *StreamConsumer, key func(redis.XMessage) string, handle func(context.Context, redis.XMessage) error) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sc.Run(ctx, key, handle) }()
	return func() error { cancel(); return <-done }
}

// entryID is the key of a test's stream entry: its field "id".
func entryID(m redis.XMessage) string { return m.Values["id"].(string) }
