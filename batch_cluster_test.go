package idem

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestBatchCluster runs the batch API on a real 3-master Redis Cluster, one
// for all subtests; the last stops a master. The cluster serves the slots it
// still has when a master is gone (cluster-require-full-coverage no), as a
// cluster whose master has no replica to fail over to would be configured to
// keep serving.
func TestBatchCluster(t *testing.T) {
	cl := redistest.StartCluster(t, 3, 0, "--cluster-require-full-coverage", "no")
	cc := cl.Client(t, &redis.ClusterOptions{DialTimeout: 250 * time.Millisecond, MaxRedirects: 2})
	nodes := &nodeCounters{byAddr: map[string]*redistest.Counter{}}
	cc.OnNewNode(func(c *redis.Client) { c.AddHook(nodes.of(c.Options().Addr)) })
	ctx := context.Background()
	// The subtests' Keepers place keys by their own digests
	// (WithScopeShards(0)), under a prefix of their own: the twin runs'
	// Keepers take the Cluster's default placement under DefaultPrefix.
	s, err := openRedisStore(cc, WithPrefix("batch:"))
	require.NoError(t, err)
	require.NoError(t, s.LoadScripts(ctx))

	t.Run("slots as Redis computes them", func(t *testing.T) {
		for i := range 200 {
			key := s.RecordKey("s", fmt.Sprint("key-", i))
			want, err := cc.ClusterKeySlot(ctx, key).Result()
			require.NoError(t, err)
			assert.EqualValues(t, want, keySlot(key), key)
		}
		assert.EqualValues(t, 12182, keySlot("foo"), "no hash tag: the whole key")
		assert.EqualValues(t, keySlot("bar"), keySlot("foo{bar}"), "the hash tag")
	})
	t.Run("the same answers as the single-key API", func(t *testing.T) {
		seen := map[string]bool{}
		for seed := uint64(1); seed <= 2; seed++ {
			twinRun(t, cc, 20+seed, 300, seen)
		}
		assertSawEveryAnswer(t, seen)
	})
	t.Run("one round trip per node and step", func(t *testing.T) {
		k, err := keeperOn(s, WithScopeShards(0), WithLease(time.Hour))
		require.NoError(t, err)
		batch, done := redeliveryBatch(500, 0.2, 3)
		_, err = Consume(ctx, k, "s", done, func(s string) string { return s }, func(context.Context, string) error { return nil })
		require.NoError(t, err)
		perNode := map[string]map[string]int64{}
		names, step := []string{"claim", "renew", "complete"}, 0
		batchSteps(t, k, batch, func(f func()) int64 {
			before := nodes.snapshot()
			f()
			for addr, n := range nodes.since(before) {
				if perNode[addr] == nil {
					perNode[addr] = map[string]int64{}
				}
				perNode[addr][names[step]] = n
			}
			step++
			return 0
		})
		masters := 0
		for addr, steps := range perNode {
			masters++
			assert.Equal(t, map[string]int64{"claim": 1, "renew": 1, "complete": 1}, steps, "node %s", addr)
		}
		assert.Equal(t, 3, masters, "every master holds part of the batch")
	})
	t.Run("compact claims and markers, one round trip per node and step", func(t *testing.T) {
		k, err := keeperOn(s, WithScopeShards(0), WithLease(time.Hour))
		require.NoError(t, err)
		id := func(s string) string { return s }
		ok := func(context.Context, string) error { return nil }
		// Ids whose records are in 64 slots over the three masters, 8 a
		// slot, those of 8 slots handled before: each slot's share of a
		// batch is kept compactly (clusterCompactMin). (Ids spread over
		// all slots are kept in records: the next subtest.)
		var batch, done []string
		perSlot := map[uint16]int{}
		for n := 0; len(batch) < 64*8; n++ {
			m := fmt.Sprint("msg-4-", n)
			slot := keySlot(s.RecordKey("m", m))
			if slot%256 != 0 || perSlot[slot] == 8 {
				continue
			}
			perSlot[slot]++
			batch = append(batch, m)
			if slot%2048 == 0 {
				done = append(done, m)
			}
		}
		res, err := Consume(ctx, k, "m", done, id, ok)
		require.NoError(t, err)
		for _, r := range res {
			require.Equal(t, MessageHandled, r.Status, "%v", r.Err)
		}
		ran := map[string]int{}
		before := nodes.snapshot()
		res, err = Consume(ctx, k, "m", batch, id, func(_ context.Context, m string) error { ran[m]++; return nil }, WithSettleWindow(time.Hour, len(batch)))
		require.NoError(t, err)
		perNode := nodes.since(before)
		require.Len(t, perNode, 3, "every master holds part of the batch")
		for addr, n := range perNode {
			assert.EqualValues(t, 2, n, "node %s: the claim and the completion", addr)
		}
		replayed := 0
		for i, r := range res {
			require.True(t, r.Ack, "%s: %v", batch[i], r.Err)
			if r.Status == MessageReplayed {
				replayed++
			}
		}
		assert.Equal(t, len(done), replayed, "the redeliveries are answered from their markers")
		assert.Len(t, ran, len(batch)-len(done))
		// A Keeper without markers reads them too.
		plain, err := keeperOn(s, WithScopeShards(0), WithoutMarkers())
		require.NoError(t, err)
		res, err = Consume(ctx, plain, "m", batch, id, func(_ context.Context, m string) error { ran[m]++; return nil })
		require.NoError(t, err)
		for _, r := range res {
			assert.Equal(t, MessageReplayed, r.Status)
		}
		assert.Len(t, ran, len(batch)-len(done))
		// The claims were compact: no message has a record of its own, and
		// the masters hold index keys and call records, under a slot's
		// hash tag each.
		for _, m := range batch {
			n, err := cc.Exists(ctx, s.RecordKey("m", m)).Result()
			require.NoError(t, err)
			require.Zero(t, n, "%s has a record of its own", m)
		}
		var compactKeys atomic.Int64
		require.NoError(t, cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			keys, err := c.Keys(ctx, "batch:{*}[ic]*").Result()
			compactKeys.Add(int64(len(keys)))
			return err
		}))
		assert.Positive(t, compactKeys.Load())

		// Operators see the markers on every master, and act on them.
		markers := 0
		for r, err := range s.Scan(ctx, ScanOptions{State: StateCompleted}) {
			if err != nil {
				// The corrupt values of the twin runs above.
				require.ErrorIs(t, err, ErrCorrupt)
				require.NotEmpty(t, r.ID, "a record's, not a call's")
				continue
			}
			if r.Compact {
				markers += r.Claims
			}
		}
		assert.GreaterOrEqual(t, markers, len(batch), "every message handled left a marker, listed by its call")
		r, err := k.Inspect(ctx, "m", batch[0])
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, r.State)
		assert.True(t, r.Compact)
		_, err = k.forgetToken(ctx, "m", batch[0], r.Token, false)
		require.NoError(t, err)
		held := compactClaims(t, k, "held-on-a-cluster")
		_, err = k.abandonKey(ctx, "s", "held-on-a-cluster", held[0].Token())
		require.NoError(t, err)
		out, err := k.Begin(ctx, "s", "held-on-a-cluster")
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.True(t, out.Claim.Recovered())
		res, err = Consume(ctx, k, "m", batch[:1], id, func(_ context.Context, m string) error { ran[m]++; return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageHandled, res[0].Status, "forgotten: handled again")
	})
	t.Run("a slot's few messages are kept in records, answered as markers", func(t *testing.T) {
		k, err := keeperOn(s, WithScopeShards(0), WithLease(time.Minute), WithRetention(time.Minute), WithMarkerRetention(time.Hour))
		require.NoError(t, err)
		id := func(s string) string { return s }
		batch, done := redeliveryBatch(100, 0.2, 5)
		ran := map[string]int{}
		count := func(_ context.Context, m string) error { ran[m]++; return nil }
		_, err = Consume(ctx, k, "m", done, id, count)
		require.NoError(t, err)
		res, err := Consume(ctx, k, "m", batch, id, count)
		require.NoError(t, err)
		for i, r := range res {
			require.True(t, r.Ack, "%s: %v", batch[i], r.Err)
		}
		assert.Len(t, ran, len(batch), "each ran once")
		for _, m := range ran {
			assert.Equal(t, 1, m)
		}
		for _, m := range batch {
			r, err := k.Inspect(ctx, "m", m)
			require.NoError(t, err)
			assert.Equal(t, StateCompleted, r.State, m)
			assert.False(t, r.Compact, "%s: a record of its own", m)
			ttl, err := cc.PTTL(ctx, s.RecordKey("m", m)).Result()
			require.NoError(t, err)
			assert.Greater(t, ttl, 30*time.Minute, "%s: kept for the marker retention, not the retention", m)
		}
	})
	t.Run("a master down fails its keys only", func(t *testing.T) {
		k, err := keeperOn(s, WithScopeShards(0), WithLease(time.Hour))
		require.NoError(t, err)
		down := cl.Masters[1]
		downSlots := func(slot uint16) bool {
			return int(slot) >= redistest.Slots/3 && int(slot) < 2*redistest.Slots/3
		}
		var keys []string
		for i := range 60 {
			keys = append(keys, fmt.Sprint("down-", i))
		}
		down.Stop()
		res, err := k.batchBegin(ctx, "s", keys)
		require.NoError(t, err)
		var lost, claimed int
		for i, r := range res {
			if downSlots(keySlot(s.RecordKey("s", keys[i]))) {
				assert.ErrorIs(t, r.Err, ErrUnavailable, "%s is on the stopped master", keys[i])
				lost++
				continue
			}
			require.NoError(t, r.Err, "%s is on a live master", keys[i])
			assert.NotNil(t, r.Outcome.Claim)
			claimed++
		}
		assert.Positive(t, lost)
		assert.Positive(t, claimed)
	})
}

// nodeCounters counts round trips per Cluster node.
type nodeCounters struct {
	mu     sync.Mutex
	byAddr map[string]*redistest.Counter
}

func (n *nodeCounters) of(addr string) *redistest.Counter {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := n.byAddr[addr]
	if c == nil {
		c = &redistest.Counter{}
		n.byAddr[addr] = c
	}
	return c
}

func (n *nodeCounters) snapshot() map[string]int64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := map[string]int64{}
	for addr, c := range n.byAddr {
		out[addr] = c.RoundTrips()
	}
	return out
}

// since returns the round trips of each node that made any since before.
func (n *nodeCounters) since(before map[string]int64) map[string]int64 {
	out := map[string]int64{}
	for addr, rt := range n.snapshot() {
		if d := rt - before[addr]; d > 0 {
			out[addr] = d
		}
	}
	return out
}
