package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// msg is a message of the tests: its id is its key.
type msg struct {
	ID   string
	Body string
}

func msgID(m msg) string { return m.ID }

func msgs(ids ...string) []msg {
	out := make([]msg, len(ids))
	for i, id := range ids {
		out[i] = msg{ID: id, Body: "body of " + id}
	}
	return out
}

func statuses(res []MessageResult) []string {
	out := make([]string, len(res))
	for i, r := range res {
		out[i] = fmt.Sprintf("%s ack=%v", r.Status, r.Ack)
	}
	return out
}

func TestConsumeHandlesEachMessageOnce(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		var mu sync.Mutex
		runs := map[string]int{}
		errTransient := errors.New("downstream timed out")
		handle := func(ctx context.Context, m msg) error {
			mu.Lock()
			runs[m.ID]++
			mu.Unlock()
			c, ok := ClaimFromContext(ctx)
			if !ok || c.Token() == 0 {
				return errors.New("no claim in the handler's context")
			}
			switch m.ID {
			case "flaky":
				return errTransient
			case "declined":
				return Final(errors.New("card declined"))
			}
			return nil
		}
		_, err := Consume(ctx, k, "orders", msgs("old"), msgID, handle)
		require.NoError(t, err)

		batch := msgs("m1", "m2", "m1", "old", "", "flaky", "declined", "m2")
		res, err := Consume(ctx, k, "orders", batch, msgID, handle)
		require.NoError(t, err)
		assert.Equal(t, []string{
			"handled ack=true", "handled ack=true", "duplicate ack=true", "replayed ack=true",
			"rejected ack=false", "retry ack=false", "handled ack=true", "duplicate ack=true",
		}, statuses(res))
		assert.Equal(t, []int{0, 1, 0, 3, 4, 5, 6, 1}, firsts(res))
		assert.Equal(t, []bool{true, true, false, false, false, true, true, false}, rans(res))
		assert.ErrorIs(t, res[4].Err, ErrInvalidKey)
		assert.ErrorIs(t, res[5].Err, errTransient)
		var final *FinalError
		require.ErrorAs(t, res[6].Err, &final)
		assert.False(t, final.Replayed)
		assert.ErrorIs(t, res[2].Err, ErrDuplicate)
		assert.Equal(t, map[string]int{"old": 1, "m1": 1, "m2": 1, "flaky": 1, "declined": 1}, runs)

		// The broker redelivers the whole batch.
		res, err = Consume(ctx, k, "orders", batch, msgID, handle)
		require.NoError(t, err)
		assert.Equal(t, []string{
			"replayed ack=true", "replayed ack=true", "duplicate ack=true", "replayed ack=true",
			"rejected ack=false", "retry ack=false", "replayed ack=true", "duplicate ack=true",
		}, statuses(res))
		require.ErrorAs(t, res[6].Err, &final)
		assert.True(t, final.Replayed)
		assert.Equal(t, "card declined", final.Error())
		assert.Equal(t, map[string]int{"old": 1, "m1": 1, "m2": 1, "flaky": 2, "declined": 1}, runs, "only the released message ran again")
	})
}

func firsts(res []MessageResult) []int {
	out := make([]int, len(res))
	for i, r := range res {
		out[i] = r.First
	}
	return out
}

func rans(res []MessageResult) []bool {
	out := make([]bool, len(res))
	for i, r := range res {
		out[i] = r.Ran
	}
	return out
}

func TestConsumeRunsInOrderByDefault(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	var order []string
	var inFlight, most atomic.Int32
	_, err := Consume(context.Background(), k, "s", msgs("e", "d", "c", "b", "a"), msgID, func(ctx context.Context, m msg) error {
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for old := most.Load(); n > old && !most.CompareAndSwap(old, n); old = most.Load() {
		}
		order = append(order, m.ID)
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, []string{"e", "d", "c", "b", "a"}, order)
	assert.EqualValues(t, 1, most.Load())
}

// TestConsumeWithConcurrency: with WithConcurrency(3) three handlers run at
// once (the first three wait until three have started) and never more.
func TestConsumeWithConcurrency(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	var inFlight, most, started atomic.Int32
	res, err := Consume(context.Background(), k, "s", msgs("0", "1", "2", "3", "4", "5", "6"), msgID, func(ctx context.Context, m msg) error {
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for old := most.Load(); n > old && !most.CompareAndSwap(old, n); old = most.Load() {
		}
		started.Add(1)
		if m.ID < "3" {
			eventually(t, "three handlers run at once", func() bool { return started.Load() >= 3 })
		}
		return nil
	}, WithConcurrency(3))
	require.NoError(t, err)
	for i, r := range res {
		assert.Equal(t, MessageHandled, r.Status, "message %d", i)
	}
	assert.EqualValues(t, 3, most.Load())
}

// batchCounter counts a store's batch steps.
type batchCounter struct {
	*redisStore
	mu      sync.Mutex
	extends [][]error
	claims  atomic.Int32
}

func (s *batchCounter) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	s.claims.Add(1)
	return s.redisStore.ClaimBatch(ctx, req)
}

func (s *batchCounter) ExtendBatch(ctx context.Context, claims []claimFence, lease, keep time.Duration) []error {
	errs := s.redisStore.ExtendBatch(ctx, claims, lease, keep)
	s.mu.Lock()
	s.extends = append(s.extends, errs)
	s.mu.Unlock()
	return errs
}

func (s *batchCounter) renewals() [][]error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.extends)
}

// TestConsumeRenewsTheBatchLeases: while a handler runs, one ExtendBatch
// renews the leases of every message of the batch not yet settled; the
// handlers' outcomes are stored afterwards.
func TestConsumeRenewsTheBatchLeases(t *testing.T) {
	// miniredis: Redis's clock stands still, so no lease runs out whatever
	// the machine's speed; the renewals run on the process's timers.
	b := redistest.Miniredis(t)
	rs, err := openRedisStore(b.Client)
	require.NoError(t, err)
	store := &batchCounter{redisStore: rs}
	k, err := keeperOn(store, WithLease(90*time.Millisecond))
	require.NoError(t, err)
	res, err := Consume(context.Background(), k, "s", msgs("a", "b", "c", "done"), msgID, func(ctx context.Context, m msg) error {
		if m.ID == "a" {
			eventually(t, "a renewal of the batch", func() bool { return len(store.renewals()) >= 1 })
		}
		return nil
	})
	require.NoError(t, err)
	first := store.renewals()[0]
	assert.Equal(t, []error{nil, nil, nil, nil}, first, "one call renews every message of the batch")
	for _, r := range res {
		assert.Equal(t, MessageHandled, r.Status)
	}
}

// TestConsumeLeaseLostCancelsTheHandler: a consumer paused past its lease
// while another attempt took its message over; its next renewal finds the
// lease lost, cancels the handler, and nothing of it is stored.
func TestConsumeLeaseLostCancelsTheHandler(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b, WithLease(300*time.Millisecond))
	ctx := context.Background()
	var other *Claim
	res, err := Consume(ctx, k, "s", msgs("a", "b"), msgID, func(ctx context.Context, m msg) error {
		if m.ID != "a" {
			return nil
		}
		b.Advance(time.Second) // Redis's clock: the lease has run out
		out, err := k.Begin(context.WithoutCancel(ctx), "s", "a")
		if assert.NoError(t, err) && assert.NotNil(t, out.Claim) {
			other = out.Claim
			assert.True(t, other.Recovered())
		}
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-time.After(10 * time.Second):
			return errors.New("the handler's context was not cancelled")
		}
	})
	require.NoError(t, err)
	assert.Equal(t, MessageRetry, res[0].Status)
	assert.True(t, res[0].Ran)
	assert.False(t, res[0].Ack)
	assert.ErrorIs(t, res[0].Err, ErrLeaseLost)
	assert.Equal(t, MessageHandled, res[1].Status, "the other message is still the batch's")
	require.NotNil(t, other)
	require.NoError(t, other.Complete(ctx, []byte("the new holder's"), 0))
	out, err := k.Begin(ctx, "s", "a")
	require.NoError(t, err)
	assert.Equal(t, "the new holder's", string(out.Value))
}

func TestConsumePanicReleasesAndRepanics(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		assert.PanicsWithValue(t, "boom", func() {
			_, _ = Consume(ctx, k, "s", msgs("ok", "boom", "later"), msgID, func(ctx context.Context, m msg) error {
				if m.ID == "boom" {
					panic("boom")
				}
				return nil
			})
		})
		out, err := k.Begin(ctx, "s", "ok")
		require.NoError(t, err)
		assert.True(t, out.Replayed, "the message handled before the panic is stored")
		for _, id := range []string{"boom", "later"} {
			out, err := k.Begin(ctx, "s", id)
			require.NoError(t, err, "%s is released, not left to its lease", id)
			assert.Equal(t, 2, out.Claim.Attempt())
		}
	})
}

func TestConsumeCallerCancelled(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx, cancel := context.WithCancel(context.Background())
		res, err := Consume(ctx, k, "s", msgs("first", "second", "third"), msgID, func(ctx context.Context, m msg) error {
			cancel() // the consumer is shutting down
			return nil
		})
		require.NoError(t, err)
		assert.Equal(t, []string{"handled ack=true", "retry ack=false", "retry ack=false"}, statuses(res))
		assert.ErrorIs(t, res[1].Err, context.Canceled)
		assert.NotErrorIs(t, res[1].Err, ErrUnavailable)
		assert.False(t, res[1].Ran)
		for _, id := range []string{"second", "third"} {
			out, err := k.Begin(context.Background(), "s", id)
			require.NoError(t, err, "%s was released", id)
			assert.NotNil(t, out.Claim)
		}
		_, err = Consume(ctx, k, "s", msgs("x"), msgID, func(context.Context, msg) error { return nil })
		assert.ErrorIs(t, err, context.Canceled)
	})
}

// TestConsumeRebalance: a partition moves to another consumer while the
// first is in the middle of a batch. The second consumer is redelivered the
// same messages: they are in progress, not acknowledged, and not handled;
// once the first has finished, a redelivery is acknowledged as replayed.
func TestConsumeRebalance(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		batch := msgs("p0", "p1", "p2")
		inside, release := make(chan struct{}), make(chan struct{})
		var runs atomic.Int32
		done := make(chan []MessageResult)
		go func() {
			res, err := Consume(ctx, k, "s", batch, msgID, func(ctx context.Context, m msg) error {
				runs.Add(1)
				if m.ID == "p0" {
					close(inside)
					<-release
				}
				return nil
			})
			assert.NoError(t, err)
			done <- res
		}()
		<-inside
		second := newKeeper(t, b) // another consumer process
		res, err := Consume(ctx, second, "s", batch, msgID, func(context.Context, msg) error {
			runs.Add(1)
			return nil
		})
		require.NoError(t, err)
		assert.Equal(t, []string{"retry ack=false", "retry ack=false", "retry ack=false"}, statuses(res))
		assert.ErrorIs(t, res[0].Err, ErrInProgress)
		close(release)
		assert.Equal(t, []string{"handled ack=true", "handled ack=true", "handled ack=true"}, statuses(<-done))
		res, err = Consume(ctx, second, "s", batch, msgID, func(context.Context, msg) error {
			runs.Add(1)
			return nil
		})
		require.NoError(t, err)
		assert.Equal(t, []string{"replayed ack=true", "replayed ack=true", "replayed ack=true"}, statuses(res))
		assert.EqualValues(t, 3, runs.Load())
	})
}

func TestConsumeRefusesMisuse(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	ok := func(context.Context, msg) error { return nil }
	for name, call := range map[string]func() error{
		"nil key": func() error { _, err := Consume(ctx, k, "s", msgs("a"), nil, ok); return err },
		"nil handler": func() error {
			_, err := Consume[msg](ctx, k, "s", msgs("a"), msgID, nil)
			return err
		},
		"fingerprints for other keys": func() error {
			_, err := Consume(ctx, k, "s", msgs("a", "b"), msgID, ok, WithFingerprints([][]byte{nil}))
			return err
		},
		"negative concurrency": func() error { _, err := Consume(ctx, k, "s", msgs("a"), msgID, ok, WithConcurrency(-1)); return err },
		"negative WithWait":    func() error { _, err := Consume(ctx, k, "s", msgs("a"), msgID, ok, WithWait(-time.Second)); return err },
		"WithSettleWindow of 0": func() error {
			_, err := Consume(ctx, k, "s", msgs("a"), msgID, ok, WithSettleWindow(time.Millisecond, 0))
			return err
		},
		"WithFingerprint": func() error { _, err := Consume(ctx, k, "s", msgs("a"), msgID, ok, WithFingerprint(nil)); return err },
		"WithConcurrency to BeginBatch": func() error {
			_, err := k.batchBegin(ctx, "s", []string{"a"}, WithConcurrency(2))
			return err
		},
		"WithFingerprints to Begin": func() error {
			_, err := k.Begin(ctx, "s", "a", WithFingerprints(nil))
			return err
		},
	} {
		assert.ErrorIs(t, call(), ErrInvalidConfig, name)
	}
	out, err := k.Begin(ctx, "s", "a")
	require.NoError(t, err)
	assert.Equal(t, 1, out.Claim.Attempt(), "nothing was claimed by the refused calls")
	errs := k.completeClaims(ctx, []completion{{Claim: nil}, {Claim: out.Claim, Retention: MaxDuration + time.Hour}})
	assert.ErrorIs(t, errs[0], ErrInvalidConfig)
	assert.ErrorIs(t, errs[1], ErrInvalidConfig)
	otherKeeper := newKeeper(t, b)
	assert.ErrorIs(t, otherKeeper.releaseClaims(ctx, []*Claim{out.Claim})[0], ErrInvalidConfig)
	assert.ErrorIs(t, otherKeeper.extendClaims(ctx, []*Claim{out.Claim})[0], ErrInvalidConfig)
	require.NoError(t, out.Claim.Release(ctx))
}

// crashable is a go-redis hook that makes every command fail once the
// process it stands for has died.
type crashable struct{ dead atomic.Bool }

var errDead = errors.New("connection refused: the consumer process died")

func (h *crashable) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *crashable) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.dead.Load() {
			cmd.SetErr(errDead)
			return errDead
		}
		return next(ctx, cmd)
	}
}

func (h *crashable) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.dead.Load() {
			for _, c := range cmds {
				c.SetErr(errDead)
			}
			return errDead
		}
		return next(ctx, cmds)
	}
}

// effectLedger counts the side effects of every message, step by step.
type effectLedger struct {
	mu      sync.Mutex
	effects map[string]int
}

func (l *effectLedger) apply(id, step string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.effects[id+"/"+step]++
}

// TestConsumeExactlyOnceUnderCrashesAndRedeliveries: consumers take
// batches of a stream that the producer sometimes sends twice; some die in
// the middle of a batch, between two steps of a message (after a
// checkpoint), or after handling messages whose outcomes were not yet
// stored; every message not acknowledged is delivered again, with the batches
// shuffled, until all are acknowledged. Each message's three side effects
// happen exactly once.
func TestConsumeExactlyOnceUnderCrashesAndRedeliveries(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		_ = context.Background()
		const messages, batchSize, consumers = 120, 16, 3
		rnd := rand.New(rand.NewPCG(7, 7))
		ledger := &effectLedger{effects: map[string]int{}}
		var recovered, replayed, crashes atomic.Int32
		acked := map[string]bool{}
		var stream []msg
		for i := range messages {
			stream = append(stream, msg{ID: fmt.Sprint("evt-", i)})
			if rnd.IntN(10) == 0 { // the producer retried its send
				stream = append(stream, msg{ID: fmt.Sprint("evt-", i)})
			}
		}
		store, err := openRedisStore(b.Client)
		require.NoError(t, err)
		for round := 0; len(acked) < messages; round++ {
			require.Less(t, round, 30, "every message acknowledged within 30 deliveries")
			if round > 0 {
				// The dead consumers' leases run out.
				for _, m := range stream {
					expireLease(t, store, "stream", m.ID)
				}
			}
			var pending []msg
			for _, m := range stream {
				// Unacknowledged messages come again, and some acknowledged
				// ones too: the broker lost the acknowledgement.
				if !acked[m.ID] || rnd.IntN(10) == 0 {
					pending = append(pending, m)
				}
			}
			rnd.Shuffle(len(pending), func(i, j int) { pending[i], pending[j] = pending[j], pending[i] })
			batches := make(chan []msg, len(pending)/batchSize+1)
			for len(pending) > 0 {
				n := min(batchSize, len(pending))
				batches <- pending[:n]
				pending = pending[n:]
			}
			close(batches)
			crashRate := 0.4
			if round >= 4 {
				crashRate = 0 // the fleet settles down
			}
			var mu sync.Mutex
			var wg sync.WaitGroup
			for c := range consumers {
				seed := uint64(round*consumers + c)
				wg.Add(1)
				go func() {
					defer wg.Done()
					for batch := range batches {
						res := consumeOnce(t, b, batch, seed, crashRate, ledger, &recovered, &crashes)
						mu.Lock()
						for i, r := range res {
							if r.Ack {
								acked[batch[i].ID] = true
							}
							if r.Status == MessageReplayed {
								replayed.Add(1)
							}
						}
						mu.Unlock()
						seed += 1000
					}
				}()
			}
			wg.Wait()
		}
		for i := range messages {
			for _, step := range []string{"reserve", "charge", "notify"} {
				assert.Equal(t, 1, ledger.effects[fmt.Sprint("evt-", i, "/", step)], "evt-%d %s", i, step)
			}
		}
		assert.Positive(t, crashes.Load())
		assert.Positive(t, recovered.Load(), "some messages were taken over from dead consumers")
		assert.Positive(t, replayed.Load(), "some redeliveries were answered from the store")
		t.Logf("%d crashes, %d recovered claims, %d replays", crashes.Load(), recovered.Load(), replayed.Load())
	})
}

// consumeOnce is one consumer process taking one batch: its own client and
// Keeper; with crashRate, it dies at a random step of a random message.
func consumeOnce(t *testing.T, b *redistest.Backend, batch []msg, seed uint64, crashRate float64, ledger *effectLedger, recovered, crashes *atomic.Int32) []MessageResult {
	rnd := rand.New(rand.NewPCG(seed, 3))
	client := redis.NewClient(b.Client.Options())
	defer client.Close()
	hook := &crashable{}
	client.AddHook(hook)
	k, err := NewRedis(client, WithLease(time.Minute))
	if !assert.NoError(t, err) {
		return nil
	}
	crashAt, crashStep := -1, ""
	if rnd.Float64() < crashRate {
		crashAt, crashStep = rnd.IntN(len(batch)), []string{"", "reserve", "charge", "notify"}[rnd.IntN(4)]
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	place := map[string]int{}
	for i, m := range batch {
		if _, ok := place[m.ID]; !ok {
			place[m.ID] = i
		}
	}
	res, err := Consume(ctx, k, "stream", batch, msgID, func(ctx context.Context, m msg) error {
		c, _ := ClaimFromContext(ctx)
		if c.Recovered() {
			recovered.Add(1)
		}
		die := func() error {
			hook.dead.Store(true) // nothing reaches Redis from here on
			cancel()
			crashes.Add(1)
			return errCrashed
		}
		if place[m.ID] == crashAt && crashStep == "" {
			return die() // died before this message, after handling the earlier ones
		}
		for _, step := range []string{"reserve", "charge", "notify"} {
			if _, done := c.Checkpointed(step); done {
				continue
			}
			ledger.apply(m.ID, step)
			if err := c.Checkpoint(ctx, step, nil); err != nil {
				return err
			}
			if place[m.ID] == crashAt && step == crashStep {
				return die()
			}
		}
		return nil
	})
	if hook.dead.Load() {
		return nil // a dead process acknowledges nothing
	}
	assert.NoError(t, err)
	return res
}

func TestConsumeEmptyBatch(t *testing.T) {
	b := redistest.Miniredis(t)
	var cnt redistest.Counter
	b.Client.AddHook(&cnt)
	k := newKeeper(t, b)
	assert.Zero(t, cnt.Count(func() {
		res, err := Consume(context.Background(), k, "s", nil, msgID, func(context.Context, msg) error { return nil })
		require.NoError(t, err)
		assert.Empty(t, res)
		got, err := k.batchBegin(context.Background(), "s", nil)
		require.NoError(t, err)
		assert.Empty(t, got)
		assert.Empty(t, k.completeClaims(context.Background(), nil))
	}), "nothing to ask Redis")
}

// TestConsumeRepeatedKeyWithOtherFingerprintIsRejected: two messages with
// one key and different bodies (fingerprints) in one batch. The first is
// handled; the second is another request under a used key, which the README
// answers MessageRejected ("used with another fingerprint (WithFingerprints)
// ... MessageRejected, false") and which Consume does answer so when it comes
// in the next batch. In the same batch it is acknowledged as a duplicate:
// its content is dropped without running and without being dead-lettered.
func TestConsumeRepeatedKeyWithOtherFingerprintIsRejected(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		var mu sync.Mutex
		handled := map[string]int{}
		handle := func(ctx context.Context, m msg) error {
			mu.Lock()
			handled[m.Body]++
			mu.Unlock()
			return nil
		}
		batch := []msg{{ID: "order-1", Body: "charge 10"}, {ID: "order-1", Body: "charge 99"}}
		fps := [][]byte{[]byte(batch[0].Body), []byte(batch[1].Body)}
		res, err := Consume(ctx, k, "orders", batch, msgID, handle, WithFingerprints(fps))
		require.NoError(t, err)
		require.Equal(t, MessageHandled, res[0].Status)
		assert.Equal(t, 1, handled["charge 10"])
		assert.Equal(t, 0, handled["charge 99"], "the other body never ran")

		// The same second message, in the next batch: rejected.
		again, err := Consume(ctx, k, "orders", batch[1:], msgID, handle, WithFingerprints(fps[1:]))
		require.NoError(t, err)
		require.Equal(t, MessageRejected, again[0].Status, "next batch: another fingerprint is rejected")
		assert.ErrorIs(t, again[0].Err, ErrMismatch)
		assert.False(t, again[0].Ack)

		// In the first batch it must not be acknowledged either.
		assert.False(t, res[1].Ack, "a message with another fingerprint was acknowledged without running (status %s, err %v)", res[1].Status, res[1].Err)
		assert.NotEqual(t, MessageDuplicate, res[1].Status, "another fingerprint is no duplicate")
	})
}
