package idem

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem/internal/minitime"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestRingShardsWithTheSameTokenSettleApart: compact claims are grouped by the
// server that holds them, not by their token alone. On a *redis.Ring (a client openRedisStore
// documents as supported), each shard makes compact call tokens from its own
// clock, unique only among that shard's call records. Two calls on two shards
// that get the same token are taken for one call by compactGroups (which
// groups by token, and by slot only on a Cluster): the completion of both is
// sent to one shard, so the other shard's claim is never completed, and a
// redelivery after the lease runs the handler a second time.
func TestRingShardsWithTheSameTokenSettleApart(t *testing.T) {
	now := time.Now()
	var minis [2]*miniredis.Miniredis
	var times [2]*minitime.Time
	addrs := map[string]string{}
	for i, name := range []string{"a", "b"} {
		m := miniredis.RunT(t)
		m.SetTime(now)
		times[i] = minitime.Install(m, now) // TIME: now, then one µs more per call
		minis[i] = m
		addrs[name] = m.Addr()
	}
	advance := func(d time.Duration) {
		now = now.Add(d)
		for i := range minis {
			minis[i].SetTime(now)
			times[i].Set(now)
			minis[i].FastForward(d)
		}
	}
	ring := redis.NewRing(&redis.RingOptions{Addrs: addrs})
	t.Cleanup(func() { ring.Close() })
	ctx := context.Background()

	k, err := NewRedis(ring, WithLease(time.Second), WithRetention(time.Minute))
	require.NoError(t, err)
	s := k.store.(*redisStore)

	// One key on each shard.
	shardOf := func(key string) int {
		probe := "{" + recordID("s", key) + "}probe"
		require.NoError(t, ring.Set(ctx, probe, 1, 0).Err())
		defer ring.Del(ctx, probe)
		for i, m := range minis {
			if m.Exists(probe) {
				return i
			}
		}
		t.Fatal("probe not found")
		return -1
	}
	var keys [2]string
	for i := 0; keys[0] == "" || keys[1] == ""; i++ {
		key := "m" + string(rune('a'+i%26)) + time.Duration(i).String()
		if sh := shardOf(key); keys[sh] == "" {
			keys[sh] = key
		}
	}
	_ = s

	var runs [2]atomic.Int32
	handle := func(_ context.Context, key string) error {
		for i := range keys {
			if keys[i] == key {
				runs[i].Add(1)
			}
		}
		return nil
	}
	msgs := keys[:]
	res, err := Consume(ctx, k, "s", msgs, func(m string) string { return m }, handle)
	require.NoError(t, err)
	for i, r := range res {
		require.Equal(t, MessageHandled, r.Status, "first delivery of %s: %v", msgs[i], r.Err)
		require.True(t, r.Ack)
	}

	// The broker delivers the batch again (the consumer died before its ack
	// reached the broker, a rebalance...), after the lease.
	advance(2 * time.Second)
	res, err = Consume(ctx, k, "s", msgs, func(m string) string { return m }, handle)
	require.NoError(t, err)
	for i, r := range res {
		require.Equal(t, MessageReplayed, r.Status, "redelivery of %s (acknowledged as handled): %v, ran again: %v", msgs[i], r.Err, r.Ran)
		require.EqualValues(t, 1, runs[i].Load(), "handler runs of %s", msgs[i])
	}
}
