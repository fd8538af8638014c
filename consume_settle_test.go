package idem

// Consume stores outcomes as handlers return (the settle window), answers a
// batch none of whose claims reached the store with ErrUnavailable, and
// waits, when asked, for the outcome of a key another consumer holds.

import (
	"context"
	"errors"
	"fmt"
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
