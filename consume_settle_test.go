package idem

// Consume stores outcomes as handlers return (the settle window), answers a
// batch none of whose claims reached the store with ErrUnavailable, and
// waits, when asked, for the outcome of a key another consumer holds.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

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

// replyLostOnSettle is a Store whose first SettleBatch with outcomes to
// store stores them and then loses its reply (answered ErrUnavailable, as
// when the connection drops after Redis ran the script); renewed is closed
// once an ExtendBatch sent after that has returned.
type replyLostOnSettle struct {
	Store
	mu       sync.Mutex
	lost     bool
	once     sync.Once
	renewed  chan struct{}
	extended [][]error // the answers of the ExtendBatches after the lost reply
}

func (s *replyLostOnSettle) SettleBatch(ctx context.Context, items []BatchCompletion, release []Fence, keep time.Duration) (done, given []error) {
	done, given = s.Store.SettleBatch(ctx, items, release, keep)
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

func (s *replyLostOnSettle) ExtendBatch(ctx context.Context, claims []Fence, lease, keep time.Duration) []error {
	s.mu.Lock()
	after := s.lost
	s.mu.Unlock()
	errs := s.Store.ExtendBatch(ctx, claims, lease, keep)
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
				rs, err := NewRedisStore(b.Client, append([]Option{WithPrefix("doubt " + name + ":")}, opts...)...)
				require.NoError(t, err)
				s := &replyLostOnSettle{Store: rs, renewed: make(chan struct{})}
				k, err := New(s, append([]Option{WithLease(3 * time.Second), WithRetention(time.Hour)}, opts...)...)
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
