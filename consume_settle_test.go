package idem

// Consume stores outcomes as handlers return (the settle window), answers a
// batch none of whose claims reached the store with ErrUnavailable, waits,
// when asked, for the outcome of a key another consumer holds, and tries a
// settling again through an outage while the claims' lease is alive.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// awaitStored waits until every key of keys is answered as completed to
// another Keeper's claim, or fails after bound (a bound, not a margin: the
// renewals, which would also store them, come only after a third of the
// lease, longer than bound).
func awaitStored(ctx context.Context, other *Keeper, scope string, keys []string, bound time.Duration) error {
	deadline := time.Now().Add(bound)
	for _, key := range keys {
		for {
			out, err := other.Begin(ctx, scope, key)
			if err == nil && out.Replayed {
				break
			}
			if err == nil {
				return fmt.Errorf("%s: claimed by another Keeper while its handler's batch runs", key)
			}
			if !errors.Is(err, ErrInProgress) {
				return err
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s: not stored within %s of its handler's return", key, bound)
			}
			time.Sleep(time.Millisecond)
		}
	}
	return nil
}

func TestConsumeStoresOutcomesAsHandlersReturn(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		lease := 3 * time.Minute
		k := newKeeper(t, b, WithLease(lease), WithRetention(time.Hour))
		other := newKeeper(t, b, WithLease(lease), WithRetention(time.Hour))
		for name, tc := range map[string]struct {
			opts    []Option
			settled []string // stored before the last handler returns
		}{
			"within the delay": {nil, []string{"a"}},
			"at the count":     {[]Option{WithSettleWindow(time.Hour, 2)}, []string{"a", "b"}},
		} {
			t.Run(name, func(t *testing.T) {
				scope := "settle " + name
				batch := msgs(append(append([]string{}, tc.settled...), "last")...)
				res, err := Consume(ctx, k, scope, batch, msgID, func(ctx context.Context, m msg) error {
					if m.ID == "last" {
						return awaitStored(ctx, other, scope, tc.settled, 20*time.Second)
					}
					return nil
				}, tc.opts...)
				require.NoError(t, err)
				for i, r := range res {
					assert.Equal(t, MessageHandled, r.Status, "%s: %v", batch[i].ID, r.Err)
				}
			})
		}
	})
}

func TestConsumeUnreachableStoreIsAnError(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	res, err := Consume(ctx, k, "s", msgs("", "bad\x01key"), msgID, func(context.Context, msg) error { return nil })
	require.NoError(t, err, "no key was sent to the store: nothing failed to reach it")
	assert.Equal(t, []string{"rejected ack=false", "rejected ack=false"}, statuses(res))

	b.Stop()
	ran := false
	res, err = Consume(ctx, k, "s", msgs("a", "b", "a", ""), msgID, func(context.Context, msg) error { ran = true; return nil })
	require.ErrorIs(t, err, ErrUnavailable)
	assert.False(t, ran)
	require.Len(t, res, 4)
	assert.Equal(t, []string{"retry ack=false", "retry ack=false", "duplicate ack=false", "rejected ack=false"}, statuses(res))
	for _, r := range res {
		assert.False(t, r.Ack)
	}
	assert.ErrorIs(t, res[0].Err, ErrUnavailable)
}

func TestConsumeWaitsForTheHolder(t *testing.T) {
	b := redistest.Real(t)
	ctx := context.Background()
	for name, tc := range map[string]struct {
		lease  time.Duration // the holder's
		wait   time.Duration
		settle func(c *Claim) error // what the holder does once the batch found it in progress
		want   MessageStatus
		ran    bool
		recov  bool
	}{
		"completed":      {time.Minute, 20 * time.Second, func(c *Claim) error { return c.Complete(ctx, nil, time.Hour) }, MessageReplayed, false, false},
		"released":       {time.Minute, 20 * time.Second, func(c *Claim) error { return c.Release(ctx) }, MessageHandled, true, false},
		"lease ran out":  {300 * time.Millisecond, 20 * time.Second, func(*Claim) error { return nil }, MessageHandled, true, true},
		"wait too short": {time.Minute, 50 * time.Millisecond, func(*Claim) error { return nil }, MessageRetry, false, false},
		"no wait (0)":    {time.Minute, 0, func(*Claim) error { return nil }, MessageRetry, false, false},
	} {
		t.Run(name, func(t *testing.T) {
			scope := "wait " + name
			holder := newKeeper(t, b, WithLease(tc.lease), WithRetention(time.Hour))
			out, err := holder.Begin(ctx, scope, "held")
			require.NoError(t, err)
			require.NotNil(t, out.Claim)
			found := make(chan struct{}, 1)
			k := newKeeper(t, b, WithLease(time.Minute), WithRetention(time.Hour), WithObserver(ObserverFunc(func(_ context.Context, ev Event) {
				if ev.Step == StepClaim && ev.Result == ResultInProgress {
					select {
					case found <- struct{}{}:
					default:
					}
				}
			})))
			settled := make(chan error, 1)
			go func() { <-found; settled <- tc.settle(out.Claim) }()
			recovered := false
			res, err := Consume(ctx, k, scope, msgs("free", "held", "held"), msgID, func(ctx context.Context, m msg) error {
				if m.ID == "held" {
					c, _ := ClaimFromContext(ctx)
					recovered = c.Recovered()
				}
				return nil
			}, WithWait(tc.wait))
			require.NoError(t, err)
			require.NoError(t, <-settled)
			assert.Equal(t, MessageHandled, res[0].Status)
			assert.Equal(t, tc.want, res[1].Status, "%v", res[1].Err)
			assert.Equal(t, tc.ran, res[1].Ran)
			assert.Equal(t, tc.recov, recovered)
			assert.Equal(t, res[1].Status != MessageRetry, res[1].Ack)
			assert.Equal(t, MessageDuplicate, res[2].Status)
			assert.Equal(t, res[1].Ack, res[2].Ack, "a duplicate is acknowledged as its first")
			if tc.want == MessageRetry {
				assert.ErrorIs(t, res[1].Err, ErrInProgress)
			}
		})
	}
}

// replyLostOnSettle is a store whose first SettleBatch with outcomes to
// store stores them and then loses its reply (answered ErrUnavailable, as
// when the connection drops after Redis ran the script); renewed is closed
// once an ExtendBatch sent after that has returned.
type replyLostOnSettle struct {
	recordStore
	mu       sync.Mutex
	lost     bool
	once     sync.Once
	renewed  chan struct{}
	extended [][]error // the answers of the ExtendBatches after the lost reply
}

func (s *replyLostOnSettle) SettleBatch(ctx context.Context, items []batchCompletion, release []claimFence, keep time.Duration) (done, given []error) {
	done, given = s.recordStore.SettleBatch(ctx, items, release, keep)
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.lost && len(items) > 0 {
		s.lost = true
		for j, err := range done {
			if err == nil {
				done[j] = fmt.Errorf("%w: the reply was lost", ErrUnavailable)
			}
		}
	}
	return done, given
}

func (s *replyLostOnSettle) ExtendBatch(ctx context.Context, claims []claimFence, lease, keep time.Duration) []error {
	s.mu.Lock()
	after := s.lost
	s.mu.Unlock()
	errs := s.recordStore.ExtendBatch(ctx, claims, lease, keep)
	if after {
		s.mu.Lock()
		s.extended = append(s.extended, slices.Clone(errs))
		s.mu.Unlock()
		s.once.Do(func() { close(s.renewed) })
	}
	return errs
}

// TestConsumeSettlingInDoubtIsSentAgain: an outcome whose storing was in
// doubt (the store ran it, its reply was lost) is stored again at the next
// settling, which the store answers as the first; a renewal in between,
// which the store answers "lease lost" for a claim already completed, does
// not lose the message: it is handled, acknowledged, and ran once.
func TestConsumeSettlingInDoubtIsSentAgain(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		for name, opts := range map[string][]Option{"markers": nil, "records": {WithoutMarkers()}} {
			t.Run(name, func(t *testing.T) {
				rs, err := openRedisStore(b.Client, append([]Option{WithPrefix("doubt " + name + ":")}, opts...)...)
				require.NoError(t, err)
				s := &replyLostOnSettle{recordStore: rs, renewed: make(chan struct{})}
				k, err := keeperOn(s, append([]Option{WithLease(3 * time.Second), WithRetention(time.Hour)}, opts...)...)
				require.NoError(t, err)
				runs := map[string]int{}
				var mu sync.Mutex
				res, err := Consume(context.Background(), k, "s", msgs("first", "last"), msgID, func(ctx context.Context, m msg) error {
					mu.Lock()
					runs[m.ID]++
					mu.Unlock()
					if m.ID == "last" {
						// Returns once a renewal came after the first
						// message's settling in doubt.
						select {
						case <-s.renewed:
						case <-time.After(30 * time.Second):
							return errors.New("no renewal after the settling in doubt")
						}
					}
					return nil
				})
				require.NoError(t, err)
				s.mu.Lock()
				require.True(t, s.lost, "the first settling's reply was lost")
				t.Logf("renewals after the lost reply answered %v", s.extended)
				s.mu.Unlock()
				assert.Equal(t, []string{"handled ack=true", "handled ack=true"}, statuses(res))
				for _, r := range res {
					assert.NoError(t, r.Err)
				}
				assert.Equal(t, map[string]int{"first": 1, "last": 1}, runs)
				for _, id := range []string{"first", "last"} {
					out, err := k.Begin(context.Background(), "s", id)
					require.NoError(t, err, id)
					assert.True(t, out.Replayed, "%s is stored", id)
				}
			})
		}
	})
}

// TestConsumeSettlesThroughAShortOutage: a handler returns while Redis is
// unreachable for 2 s, a third of the 6 s lease (the contract: "a Redis
// outage shorter than half a lease loses no lease"). Every try of the
// settling fails at once (go-redis gives up within milliseconds), so
// Consume tries again, with backoff, while the claim's lease is alive by
// this process's clock: the outcome is stored once Redis is back, and the
// message is acknowledged. Before, the final settle was tried once and
// Consume answered MessageRetry well inside the outage, with the claim still
// pending; the broker's redelivery waited for the lease to run out and ran
// the handler again, Recovered.
func TestConsumeSettlesThroughAShortOutage(t *testing.T) {
	srv := redistest.Start(t)
	p := newFaultProxy(t, srv.Addr, 1)
	c := redistest.NewClient(t, p.Addr())
	k, err := NewRedis(c, WithLease(6*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	id := func(m string) string { return m }

	var runs, recovered atomic.Int32
	outageOver := make(chan struct{})
	handle := func(ctx context.Context, m string) error {
		if runs.Add(1) == 1 {
			// Redis becomes unreachable while the handler finishes; back
			// after 2 s.
			p.Set(faultproxy.Faults{Cut: 1})
			p.CutAll()
			time.AfterFunc(2*time.Second, func() { p.Set(faultproxy.Faults{}); close(outageOver) })
			time.Sleep(20 * time.Millisecond)
		} else if cl, _ := ClaimFromContext(ctx); cl.Recovered() {
			recovered.Add(1)
		}
		return nil
	}
	start := time.Now()
	res, err := Consume(ctx, k, "s", []string{"m1"}, id, handle)
	require.NoError(t, err)
	returned := time.Since(start)
	t.Logf("first Consume: %+v after %s (outage: 2 s, lease: 6 s)", res[0], returned.Round(time.Millisecond))
	<-outageOver

	// The broker redelivers the message it was not told to ack.
	if !res[0].Ack {
		res, err = Consume(ctx, k, "s", []string{"m1"}, id, handle, WithWait(10*time.Second))
		require.NoError(t, err)
		t.Logf("redelivery: %+v", res[0])
	}
	assert.EqualValues(t, 1, runs.Load(), "a message whose handler returned during a 2 s outage (a third of the lease) ran again")
	assert.Zero(t, recovered.Load(), "the redelivery took the claim over, Recovered")
}

// TestConsumeGivesUpSettlingWhenTheLeaseRunsOut: the patience of the last
// settling is bounded by the claim's lease. Redis is unreachable from the
// moment the handler returns until after the test, longer than the lease:
// Consume tries the settling again (the Observer is told of more than one
// try), then returns once the lease has run out by this process's clock,
// the message not acknowledged, its error saying the store was unavailable.
func TestConsumeGivesUpSettlingWhenTheLeaseRunsOut(t *testing.T) {
	srv := redistest.Start(t)
	p := newFaultProxy(t, srv.Addr, 1)
	c := redistest.NewClient(t, p.Addr())
	var tries atomic.Int32
	lease := 1500 * time.Millisecond
	k, err := NewRedis(c, WithLease(lease), WithObserver(ObserverFunc(func(_ context.Context, ev Event) {
		if ev.Step == StepComplete && ev.Result == ResultUnavailable {
			tries.Add(1)
		}
	})))
	require.NoError(t, err)

	type answer struct {
		res []MessageResult
		err error
	}
	returned := make(chan answer, 1)
	go func() {
		res, err := Consume(context.Background(), k, "s", []string{"m1"}, func(m string) string { return m }, func(context.Context, string) error {
			p.Set(faultproxy.Faults{Cut: 1}) // for longer than the lease
			p.CutAll()
			return nil
		})
		returned <- answer{res, err}
	}()
	var a answer
	select {
	case a = <-returned:
	case <-time.After(3 * lease): // a bound on a hang, not a measure
		t.Fatal("Consume still settling after three times the lease")
	}
	require.NoError(t, a.err, "the claim reached the store")
	require.Len(t, a.res, 1)
	r := a.res[0]
	assert.Equal(t, MessageRetry, r.Status, "%v", r.Err)
	assert.False(t, r.Ack)
	assert.True(t, r.Ran)
	assert.ErrorIs(t, r.Err, ErrUnavailable)
	assert.Greater(t, tries.Load(), int32(1), "the settling was tried again")
}

// settleFailsUntilRenewed is a store whose SettleBatch is answered
// ErrUnavailable (nothing written), from its first call on, until an
// ExtendBatch sent after that first call has renewed every claim it was
// sent: a store that takes renewals and refuses settlings for a while.
type settleFailsUntilRenewed struct {
	recordStore
	mu       sync.Mutex
	failing  bool // a SettleBatch was refused
	renewed  bool // an ExtendBatch sent since then renewed its claims
	refused  int
	extended int
}

func (s *settleFailsUntilRenewed) SettleBatch(ctx context.Context, items []batchCompletion, release []claimFence, keep time.Duration) (done, given []error) {
	s.mu.Lock()
	if !s.renewed {
		s.failing = true
		s.refused++
		s.mu.Unlock()
		done, given = make([]error, len(items)), make([]error, len(release))
		for j := range done {
			done[j] = fmt.Errorf("%w: refused by the test", ErrUnavailable)
		}
		for j := range given {
			given[j] = fmt.Errorf("%w: refused by the test", ErrUnavailable)
		}
		return done, given
	}
	s.mu.Unlock()
	return s.recordStore.SettleBatch(ctx, items, release, keep)
}

func (s *settleFailsUntilRenewed) ExtendBatch(ctx context.Context, claims []claimFence, lease, keep time.Duration) []error {
	s.mu.Lock()
	after := s.failing
	s.mu.Unlock()
	errs := s.recordStore.ExtendBatch(ctx, claims, lease, keep)
	if after && len(errs) > 0 && !slices.ContainsFunc(errs, func(err error) bool { return err != nil }) {
		s.mu.Lock()
		s.renewed = true
		s.extended++
		s.mu.Unlock()
	}
	return errs
}

// TestConsumeRenewsWhileTheLastSettlingWaits: while the last settling of a
// batch waits for the store, the renewals of its claims go on. The store
// refuses every settling until a renewal sent after the first refusal has
// got through; the handlers have all returned by then, so only the last
// settling is refused: the batch is handled once its claims were renewed.
func TestConsumeRenewsWhileTheLastSettlingWaits(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		for name, opts := range map[string][]Option{"markers": nil, "records": {WithoutMarkers()}} {
			t.Run(name, func(t *testing.T) {
				rs, err := openRedisStore(b.Client, append([]Option{WithPrefix("renew last " + name + ":")}, opts...)...)
				require.NoError(t, err)
				s := &settleFailsUntilRenewed{recordStore: rs}
				// The first renewal comes a third of the lease after the
				// claim; the patience lasts until the lease runs out.
				k, err := keeperOn(s, append([]Option{WithLease(3 * time.Second), WithRetention(time.Hour)}, opts...)...)
				require.NoError(t, err)
				runs := map[string]int{}
				res, err := Consume(context.Background(), k, "s", msgs("a", "b", "c"), msgID, func(ctx context.Context, m msg) error {
					runs[m.ID]++
					if m.ID == "b" {
						return errors.New("released, not stored")
					}
					return nil
				})
				require.NoError(t, err)
				s.mu.Lock()
				assert.Positive(t, s.refused, "the last settling was refused")
				assert.Positive(t, s.extended, "a renewal got through while the last settling waited")
				s.mu.Unlock()
				assert.Equal(t, []string{"handled ack=true", "retry ack=false", "handled ack=true"}, statuses(res))
				assert.NoError(t, res[0].Err)
				assert.NotErrorIs(t, res[1].Err, ErrUnavailable, "b was released")
				assert.Equal(t, map[string]int{"a": 1, "b": 1, "c": 1}, runs)
				for _, id := range []string{"a", "c"} {
					out, err := k.Begin(context.Background(), "s", id)
					require.NoError(t, err, id)
					assert.True(t, out.Replayed, "%s is stored", id)
				}
				out, err := k.Begin(context.Background(), "s", "b")
				require.NoError(t, err)
				assert.False(t, out.Replayed, "b was released: claimed again")
				require.NotNil(t, out.Claim)
				assert.False(t, out.Claim.Recovered(), "b was released, not left to run out")
				require.NoError(t, out.Claim.Release(context.Background()))
			})
		}
	})
}

// renewalSettleInDoubt is a store whose first SettleBatch, which the test
// arranges to be a renewal's, waits until another SettleBatch comes, or
// for half a second, and is then answered ErrUnavailable, nothing written;
// started is closed when it begins.
type renewalSettleInDoubt struct {
	recordStore
	mu      sync.Mutex
	calls   int
	started chan struct{}
	second  chan struct{}
}

func (s *renewalSettleInDoubt) SettleBatch(ctx context.Context, items []batchCompletion, release []claimFence, keep time.Duration) (done, given []error) {
	s.mu.Lock()
	s.calls++
	n := s.calls
	s.mu.Unlock()
	switch n {
	case 1:
		close(s.started)
		select {
		case <-s.second:
		case <-time.After(500 * time.Millisecond):
		}
		done, given = make([]error, len(items)), make([]error, len(release))
		for j := range done {
			done[j] = fmt.Errorf("%w: refused by the test", ErrUnavailable)
		}
		for j := range given {
			given[j] = fmt.Errorf("%w: refused by the test", ErrUnavailable)
		}
		return done, given
	case 2:
		close(s.second)
	}
	return s.recordStore.SettleBatch(ctx, items, release, keep)
}

// TestConsumeLastSettlingWaitsForARenewalsSettling: a renewal settles the
// messages whose handlers returned; when the last handler returns while
// such a settling is under way, and that settling then fails, the last
// settling still stores those messages: it begins once the renewal's
// settling has ended. A message answered MessageHandled is stored.
func TestConsumeLastSettlingWaitsForARenewalsSettling(t *testing.T) {
	b := redistest.Real(t)
	rs, err := openRedisStore(b.Client, WithPrefix("renewal settling:"))
	require.NoError(t, err)
	s := &renewalSettleInDoubt{recordStore: rs, started: make(chan struct{}), second: make(chan struct{})}
	k, err := keeperOn(s, WithLease(3*time.Second), WithRetention(time.Hour))
	require.NoError(t, err)
	ctx := context.Background()
	// The settle window never closes while the handlers run: the first
	// settling is the renewal's, a third of the lease after the claims.
	res, err := Consume(ctx, k, "s", msgs("first", "last"), msgID, func(ctx context.Context, m msg) error {
		if m.ID == "last" {
			select {
			case <-s.started:
			case <-time.After(30 * time.Second):
				return errors.New("no renewal settled the first message")
			}
		}
		return nil
	}, WithSettleWindow(time.Hour, 1000))
	require.NoError(t, err)
	assert.Equal(t, []string{"handled ack=true", "handled ack=true"}, statuses(res), "%v", res)
	for _, id := range []string{"first", "last"} {
		out, err := k.Begin(ctx, "s", id)
		require.NoError(t, err, id)
		assert.True(t, out.Replayed, "%s, answered handled, is stored", id)
	}
}

// TestConsumeSettlerTriesAgainThroughAnOutage: the settling of a handler
// that returned while Redis was unreachable is tried again, with backoff,
// while the other handlers go on, not only at the next renewal (a third of
// the lease, here a minute) or when the batch ends: the last handler of the
// batch returns only once the first one's outcome is stored.
func TestConsumeSettlerTriesAgainThroughAnOutage(t *testing.T) {
	srv := redistest.Start(t)
	p := newFaultProxy(t, srv.Addr, 1)
	ctx := context.Background()
	lease := 3 * time.Minute
	k, err := NewRedis(redistest.NewClient(t, p.Addr()), WithLease(lease), WithRetention(time.Hour))
	require.NoError(t, err)
	other, err := NewRedis(redistest.NewClient(t, srv.Addr), WithLease(lease), WithRetention(time.Hour))
	require.NoError(t, err)
	res, err := Consume(ctx, k, "s", msgs("first", "last"), msgID, func(ctx context.Context, m msg) error {
		if m.ID == "first" {
			p.Set(faultproxy.Faults{Cut: 1})
			p.CutAll()
			time.AfterFunc(300*time.Millisecond, func() { p.Set(faultproxy.Faults{}) })
			return nil
		}
		return awaitStored(ctx, other, "s", []string{"first"}, 20*time.Second)
	})
	require.NoError(t, err)
	assert.Equal(t, []string{"handled ack=true", "handled ack=true"}, statuses(res))
	for _, r := range res {
		assert.NoError(t, r.Err)
	}
}

// TestConsumeSettlesThroughAShortOutageWithReplicas is
// TestConsumeSettlesThroughAShortOutage on a store made WithReplicas, whose
// completions go with WAIT on a connection of their own: a handler returns
// while the master is unreachable for 2 s, a third of the 6 s lease; the
// outcome is stored, and acknowledged by the replica, once the master is
// back, and the redelivery is answered MessageReplayed.
func TestConsumeSettlesThroughAShortOutageWithReplicas(t *testing.T) {
	master := redistest.Start(t)
	redistest.StartReplica(t, master.Addr)
	p := newFaultProxy(t, master.Addr, 1)
	s, err := openRedisStore(redistest.NewClient(t, p.Addr()), WithReplicas(1, time.Second))
	require.NoError(t, err)
	k, err := keeperOn(s, WithLease(6*time.Second), WithRetention(time.Hour))
	require.NoError(t, err)
	ctx := context.Background()

	var runs atomic.Int32
	outageOver := make(chan struct{})
	handle := func(ctx context.Context, m msg) error {
		if runs.Add(1) == 1 {
			p.Set(faultproxy.Faults{Cut: 1})
			p.CutAll()
			time.AfterFunc(2*time.Second, func() { p.Set(faultproxy.Faults{}); close(outageOver) })
		}
		return nil
	}
	res, err := Consume(ctx, k, "s", msgs("m1"), msgID, handle)
	require.NoError(t, err)
	<-outageOver
	assert.Equal(t, []string{"handled ack=true"}, statuses(res), "%v", res[0].Err)
	res, err = Consume(ctx, k, "s", msgs("m1"), msgID, handle, WithWait(10*time.Second))
	require.NoError(t, err)
	assert.Equal(t, []string{"replayed ack=true"}, statuses(res), "%v", res[0].Err)
	assert.EqualValues(t, 1, runs.Load(), "the handler ran once")
}
