package idem

import (
	"context"
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
		k := newKeeper(t, b, WithLease(lease), WithRetention(time.Hour))
		add := func(id string) {
			require.NoError(t, c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": id}}).Err())
		}
		add("dead-held")
		require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())
		// A consumer that read the entry, claimed its key, and died.
		got, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "dead", Streams: []string{"s", ">"}, Count: 1}).Result()
		require.NoError(t, err)
		require.Len(t, got[0].Messages, 1)
		out, err := k.BeginBatch(ctx, "s g", []string{"dead-held"})
		require.NoError(t, err)
		require.NotNil(t, out[0].Outcome.Claim)
		add("") // an invalid key
		add("fine")
		add("fine") // a producer's duplicate

		sc, err := NewStreamConsumer(k, c, "s", "g", "live")
		require.NoError(t, err)
		var handled, recovered atomic.Int32
		rctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			done <- sc.Run(rctx, func(m redis.XMessage) string { return m.Values["id"].(string) }, func(ctx context.Context, m redis.XMessage) error {
				handled.Add(1)
				if c, _ := ClaimFromContext(ctx); c.Recovered() {
					recovered.Add(1)
				}
				return nil
			})
		}()
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
		stop()
		require.ErrorIs(t, <-done, context.Canceled)
		assert.EqualValues(t, 2, handled.Load(), "fine once, dead-held once")
		assert.EqualValues(t, 1, recovered.Load(), "dead-held taken over")
		dl, err := c.XRange(ctx, "s:dead-letter", "-", "+").Result()
		require.NoError(t, err)
		require.Len(t, dl, 1)
		assert.Equal(t, "", dl[0].Values["id"])
		assert.Contains(t, dl[0].Values["idem-error"], "key")
	})
}

func TestStreamConsumerRefusesMisuse(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	for name, opts := range map[string][]Option{
		"WithFingerprints":   {WithFingerprints(nil)},
		"negative batch":     {WithBatchSize(-1)},
		"negative wait":      {WithWait(-time.Second)},
		"WithSettleWindow 0": {WithSettleWindow(0, 0)},
	} {
		_, err := NewStreamConsumer(k, b.Client, "s", "g", "c", opts...)
		assert.ErrorIs(t, err, ErrInvalidConfig, name)
	}
	_, err := NewStreamConsumer(k, b.Client, "s", "", "c")
	assert.ErrorIs(t, err, ErrInvalidConfig)
}
