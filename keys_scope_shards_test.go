package idem

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestScopeShardsIDs: a Keeper made WithScopeShards(n) gives the keys of a
// scope placed ids that share one of n tags, that a redisStore keys by that
// tag and reads back from the key; without it, ids are RecordID's.
func TestScopeShardsIDs(t *testing.T) {
	s, err := openRedisStore(redistest.Miniredis(t).Client)
	require.NoError(t, err)
	keeper := func(n int) *Keeper {
		k, err := keeperOn(s, WithScopeShards(n))
		require.NoError(t, err, "WithScopeShards(%d)", n)
		return k
	}

	plain := keeper(0)
	for _, key := range []string{"a", "order-1", strings.Repeat("k", MaxKeyLen)} {
		id := plain.RecordID("s", key)
		assert.Equal(t, recordID("s", key), id)
		assert.False(t, placedID(id), "%s is not placed", id)
		assert.Equal(t, DefaultPrefix+"{"+id+"}", s.key(id))
		assert.Equal(t, id, idOfKey(s.key(id)))
	}

	for _, n := range []int{1, 4, 256} {
		k := keeper(n)
		tags, slots, ids := map[string]int{}, map[uint16]bool{}, map[string]bool{}
		keys := max(2000, 100*n)
		for i := range keys {
			key := fmt.Sprint("order-", i)
			id := k.RecordID("orders", key)
			require.NoError(t, checkRecordID(id), "a placed id is a record id")
			require.True(t, placedID(id), "%s is placed", id)
			require.Equal(t, recordID("orders", key)[:15], id[:15], "a placed id starts with the key's digest")
			rk := s.key(id)
			tag := id[idLen-placedTagLen:]
			require.Equal(t, DefaultPrefix+"{"+tag+"}"+id[:idLen-placedTagLen], rk)
			require.Equal(t, id, idOfKey(rk), "the id read back from its key")
			require.Equal(t, []string{rk}, s.keysOf([]string{id}, []int{0}), "a batch's keys")
			tags[tag]++
			slots[keySlot(rk)] = true
			ids[id] = true
		}
		assert.Len(t, ids, keys, "n=%d: every key its own id", n)
		assert.Len(t, tags, n, "n=%d: the scope's keys share n tags", n)
		assert.LessOrEqual(t, len(slots), n, "n=%d: and at most n slots", n)
		for tag, c := range tags {
			assert.Greater(t, c, keys/n/3, "n=%d: shard %s holds %d keys: shards are about even", n, tag, c)
		}
		other := k.RecordID("refunds", "order-1")
		assert.NotEqual(t, k.RecordID("orders", "order-1")[idLen-placedTagLen:], other[idLen-placedTagLen:], "n=%d: another scope, another tag", n)
	}
	assert.NotEqual(t, keeper(1).RecordID("s", "k"), keeper(2).RecordID("s", "k"), "the placement is part of the id")

	for _, n := range []int{-1, 257} {
		_, err := keeperOn(s, WithScopeShards(n))
		assert.ErrorIs(t, err, ErrInvalidConfig, "WithScopeShards(%d)", n)
	}
	_, err = openRedisStore(redistest.Miniredis(t).Client, WithScopeShards(1))
	assert.ErrorIs(t, err, ErrInvalidConfig, "WithScopeShards is a Keeper's option")
}

// TestScopeShardsOperators: what Consume leaves for a Keeper made
// WithScopeShards, Begin, Do, Inspect, Scan, Forget and Abandon find.
func TestScopeShardsOperators(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithScopeShards(2), WithLease(time.Hour))
		msgs := make([]string, 60)
		for i := range msgs {
			msgs[i] = fmt.Sprint("m-", i)
		}
		runs := map[string]int{}
		handle := func(_ context.Context, m string) error { runs[m]++; return nil }
		id := func(m string) string { return m }
		res, err := Consume(ctx, k, "q", msgs, id, handle, WithConcurrency(1))
		require.NoError(t, err)
		for i, r := range res {
			require.Equal(t, MessageHandled, r.Status, msgs[i])
		}
		res, err = Consume(ctx, k, "q", msgs, id, handle, WithConcurrency(1))
		require.NoError(t, err)
		for i, r := range res {
			require.Equal(t, MessageReplayed, r.Status, "%s delivered again", msgs[i])
			require.Equal(t, 1, runs[msgs[i]], "%s ran once", msgs[i])
		}

		// A message's marker answers Begin and Inspect; Forget lets it run
		// again.
		out, err := k.Begin(ctx, "q", "m-0")
		require.NoError(t, err)
		require.True(t, out.Replayed, "Begin of a handled message: %+v", out)
		r, err := k.Inspect(ctx, "q", "m-1")
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, r.State)
		assert.Equal(t, k.RecordID("q", "m-1"), r.ID)
		_, err = k.Forget(ctx, "q", "m-1", false)
		require.NoError(t, err)
		out, err = k.Begin(ctx, "q", "m-1")
		require.NoError(t, err)
		require.NotNil(t, out.Claim, "forgotten, m-1 is claimed again")

		// Abandon ends the lease of that claim, which the next Begin takes
		// over; its record is listed by Scan under its placed id and key.
		_, err = k.abandonKey(ctx, "q", "m-1", out.Claim.Token())
		require.NoError(t, err)
		again, err := k.Begin(ctx, "q", "m-1")
		require.NoError(t, err)
		require.NotNil(t, again.Claim, "abandoned, m-1 is taken over")
		assert.Greater(t, again.Claim.Token(), out.Claim.Token())
		s := k.store.(*redisStore)
		var listed []Record
		for r, err := range s.Scan(ctx, ScanOptions{State: StatePending}) {
			require.NoError(t, err)
			if r.ID != "" {
				listed = append(listed, r)
			}
		}
		require.Len(t, listed, 1, "the one record listed")
		assert.Equal(t, k.RecordID("q", "m-1"), listed[0].ID)
		assert.Equal(t, s.key(k.RecordID("q", "m-1")), listed[0].Key)
		byID, err := s.Inspect(ctx, listed[0].ID)
		require.NoError(t, err)
		assert.Equal(t, StatePending, byID.State)

		// Do answers a key a Consume handled, and stores its own.
		v, err := Do(ctx, k, "q", "m-2", func(context.Context) ([]byte, error) { return []byte("ran"), nil })
		require.NoError(t, err)
		assert.Empty(t, v, "m-2 was handled: its marker answers an empty result")
		v, err = Do(ctx, k, "q", "new", func(context.Context) ([]byte, error) { return []byte("ran"), nil })
		require.NoError(t, err)
		assert.Equal(t, []byte("ran"), v)
		n, err := b.Client.Exists(ctx, s.key(k.RecordID("q", "new"))).Result()
		require.NoError(t, err)
		assert.Equal(t, int64(1), n, "Do's record under the placed key")
		batch, err := k.batchBegin(ctx, "q", []string{"r-1", "r-2"})
		require.NoError(t, err)
		for i, r := range batch {
			require.NotNil(t, r.Outcome.Claim, "BeginBatch %d", i)
		}
		n, err = b.Client.Exists(ctx, s.key(k.RecordID("q", "r-1")), s.key(k.RecordID("q", "r-2"))).Result()
		require.NoError(t, err)
		assert.Equal(t, int64(2), n, "BeginBatch's records under the placed keys")
	})
}

// TestClusterScopeShards: on a Cluster, a Consume batch of one scope placed
// in one shard costs a few script calls on one node, where keys placed by
// their own digests (WithScopeShards(0)) cost one a message or so; its messages are kept as markers,
// and delivered again they are answered by them. A batch of a scope in
// three shards makes one round trip a step on each node of its shards.
func TestClusterScopeShards(t *testing.T) {
	cl := redistest.StartCluster(t, 3, 0)
	cc := cl.Client(t, nil)
	ctx := context.Background()
	masters := make([]*redis.Client, len(cl.Masters))
	for i, m := range cl.Masters {
		masters[i] = m.Client(t)
	}
	// scripts runs f and returns how many scripts each master ran meanwhile.
	scripts := func(f func()) []int64 {
		count := func() []int64 {
			out := make([]int64, len(masters))
			for i, m := range masters {
				stats, err := m.Info(ctx, "commandstats").Result()
				require.NoError(t, err)
				for _, l := range strings.Split(stats, "\n") {
					for _, cmd := range []string{"cmdstat_evalsha:", "cmdstat_eval:"} {
						if rest, ok := strings.CutPrefix(strings.TrimSpace(l), cmd+"calls="); ok {
							var c int64
							fmt.Sscanf(rest, "%d", &c)
							out[i] += c
						}
					}
				}
			}
			return out
		}
		before := count()
		f()
		after := count()
		for i := range after {
			after[i] -= before[i]
		}
		return after
	}
	consume := func(k *Keeper, scope string, want MessageStatus) {
		msgs := make([]string, 500)
		for i := range msgs {
			msgs[i] = fmt.Sprint("m-", i)
		}
		// One settle at the end, whatever the machine's load: the default
		// window (10 ms or 128 outcomes) settles a batch of 500 in four
		// calls or more, as the handlers happen to return.
		res, err := Consume(ctx, k, scope, msgs, func(m string) string { return m }, func(context.Context, string) error { return nil },
			WithSettleWindow(time.Hour, len(msgs)))
		require.NoError(t, err)
		for i, r := range res {
			require.Equal(t, want, r.Status, "%s %s: %v", scope, msgs[i], r.Err)
		}
	}
	// Each placement on a prefix of its own: one prefix refuses a Keeper
	// of another placement than its first's. LoadScripts writes each
	// prefix's record, so that the counts below are of the batches alone.
	byKey := newClusterKeeper(t, cc, WithScopeShards(0))
	placed := newClusterKeeper(t, cc, WithScopeShards(1), WithPrefix("placed:"))
	for _, k := range []*Keeper{byKey, placed} {
		require.NoError(t, k.store.(*redisStore).LoadScripts(ctx))
	}
	_, err := Do(ctx, newClusterKeeper(t, cc, WithScopeShards(1)), "placed", "k", func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, ErrInvalidConfig, "a Keeper of another placement on the Cluster's prefix")

	spread := scripts(func() { consume(byKey, "spread", MessageHandled) })
	keys, err := clusterKeys(ctx, masters)
	require.NoError(t, err)

	first := scripts(func() { consume(placed, "placed", MessageHandled) })
	again := scripts(func() { consume(placed, "placed", MessageReplayed) })
	all, err := clusterKeys(ctx, masters)
	require.NoError(t, err)
	t.Logf("500 messages: %v script calls a master spread by key, %v placed in one shard, %v delivered again; keys %d spread, %d placed",
		spread, first, again, keys, all-keys)

	busy := 0
	for i := range first {
		if first[i] > 0 {
			busy++
		}
		assert.Equal(t, first[i] > 0, again[i] > 0, "master %d: the redelivery goes to the same node", i)
	}
	assert.Equal(t, 1, busy, "one node runs a batch of one shard")
	assert.LessOrEqual(t, sum64(first), int64(6), "a few script calls for 500 messages: claims and settles by 200")
	assert.LessOrEqual(t, sum64(again), int64(8), "and for their redelivery")
	assert.Greater(t, sum64(spread), 10*sum64(first), "placed by key, the batch costs a script call a slot")
	assert.LessOrEqual(t, all-keys, int64(4), "markers: an index key and a call record or two, no record a message")

	// Round trips: a batch of a scope in three shards makes one a step on
	// each node its shards' slots are on: the claims, then the outcomes,
	// stored at once (a settle window longer than the batch).
	counted := cl.Client(t, nil)
	nodes := &nodeCounters{byAddr: map[string]*redistest.Counter{}}
	counted.OnNewNode(func(c *redis.Client) { c.AddHook(nodes.of(c.Options().Addr)) })
	three := newClusterKeeper(t, counted, WithScopeShards(3), WithPrefix("three:"))
	require.NoError(t, three.store.(*redisStore).LoadScripts(ctx))
	msgs := make([]string, 500)
	for i := range msgs {
		msgs[i] = fmt.Sprint("m-", i)
	}
	// A scope whose shards are on two nodes or more.
	scope := ""
	for c := 0; scope == "" && c < 100; c++ {
		owners, slots := map[string]bool{}, map[uint16]bool{}
		for _, m := range msgs {
			sl := keySlot(three.store.(*redisStore).key(three.RecordID(fmt.Sprint("three-", c), m)))
			if !slots[sl] {
				slots[sl] = true
				owners[slotOwner(ctx, masters[0], int64(sl))] = true
			}
		}
		require.Len(t, slots, 3, "three shards, three slots")
		if len(owners) >= 2 {
			scope = fmt.Sprint("three-", c)
		}
	}
	require.NotEmpty(t, scope, "a scope whose shards are on two nodes")
	for _, want := range []MessageStatus{MessageHandled, MessageReplayed} {
		before := nodes.snapshot()
		res, err := Consume(ctx, three, scope, msgs, func(m string) string { return m },
			func(context.Context, string) error { return nil }, WithSettleWindow(time.Hour, len(msgs)))
		require.NoError(t, err)
		for i, r := range res {
			require.Equal(t, want, r.Status, msgs[i])
		}
		trips := nodes.since(before)
		t.Logf("%s: round trips by node %v", want, trips)
		require.GreaterOrEqual(t, len(trips), 2, "%s: the nodes of the shards", want)
		steps := int64(2)
		if want == MessageReplayed {
			steps = 1 // nothing claimed, nothing to settle
		}
		for addr, n := range trips {
			assert.Equal(t, steps, n, "%s: round trips to %s", want, addr)
		}
	}
}

func newClusterKeeper(t *testing.T, cc *redis.ClusterClient, opts ...Option) *Keeper {
	t.Helper()
	k, err := NewRedis(cc, opts...)
	require.NoError(t, err)
	return k
}

// clusterKeys is how many keys the masters hold.
func clusterKeys(ctx context.Context, masters []*redis.Client) (int64, error) {
	var n int64
	for _, m := range masters {
		c, err := m.DBSize(ctx).Result()
		if err != nil {
			return 0, err
		}
		n += c
	}
	return n, nil
}

func sum64(v []int64) int64 {
	var s int64
	for _, x := range v {
		s += x
	}
	return s
}

// TestClusterDefaultPlacement: a Keeper made without WithScopeShards on a
// *redis.ClusterClient places a scope's keys in ClusterScopeShards shards,
// as WithScopeShards(ClusterScopeShards) does: a Consume batch of 500
// costs a script call a shard a step, not one a message; Do, Begin,
// Inspect, Forget and Abandon find what Consume wrote and Consume what
// they wrote. WithScopeShards(0) places keys by their own digests; a
// Keeper of another placement than the prefix's is refused. On one server
// the default is no shards.
func TestClusterDefaultPlacement(t *testing.T) {
	cl := redistest.StartCluster(t, 3, 0)
	ctx := context.Background()
	var calls redistest.Counter
	cc := cl.Client(t, nil)
	cc.OnNewNode(func(c *redis.Client) { c.AddHook(&calls) })
	k := newClusterKeeper(t, cc, WithLease(time.Hour))
	s := k.store.(*redisStore)
	require.NoError(t, s.LoadScripts(ctx))

	// The ids are the ones WithScopeShards(ClusterScopeShards) gives.
	explicit := newClusterKeeper(t, cc, WithScopeShards(ClusterScopeShards))
	digest := newClusterKeeper(t, cc, WithScopeShards(0), WithPrefix("digest:"))
	tags := map[string]bool{}
	for i := range 400 {
		key := fmt.Sprint("m-", i)
		id := k.RecordID("orders", key)
		require.True(t, placedID(id), "%s: placed by default on a Cluster", key)
		require.Equal(t, explicit.RecordID("orders", key), id, key)
		require.Equal(t, recordID("orders", key), digest.RecordID("orders", key), "WithScopeShards(0): by digest")
		tags[id[idLen-placedTagLen:]] = true
	}
	assert.Len(t, tags, ClusterScopeShards, "the scope's keys in ClusterScopeShards shards")

	// A batch of 500, then its redelivery: a script call a shard a step
	// (the outcomes stored at once: a settle window longer than the
	// batch), where keys by digest cost one a message or so.
	msgs := make([]string, 500)
	for i := range msgs {
		msgs[i] = fmt.Sprint("m-", i)
	}
	runs := map[string]int{}
	handle := func(_ context.Context, m string) error { runs[m]++; return nil }
	id := func(m string) string { return m }
	consume := func(k *Keeper, want MessageStatus) int64 {
		before := calls.Commands()
		res, err := Consume(ctx, k, "orders", msgs, id, handle, WithSettleWindow(time.Hour, len(msgs)))
		require.NoError(t, err)
		for i, r := range res {
			require.Equal(t, want, r.Status, "%s: %v", msgs[i], r.Err)
		}
		return calls.Commands() - before
	}
	first := consume(k, MessageHandled)
	again := consume(k, MessageReplayed)
	require.NoError(t, digest.store.(*redisStore).LoadScripts(ctx))
	byDigest := consume(digest, MessageHandled)
	t.Logf("a batch of 500: %d commands, %d delivered again; %d placed by digest", first, again, byDigest)
	assert.LessOrEqual(t, first, int64(2*ClusterScopeShards), "a claim and a completion a shard")
	assert.LessOrEqual(t, again, int64(ClusterScopeShards), "a claim a shard")
	assert.Greater(t, byDigest, 5*first, "by digest, a script call a slot")
	for _, m := range msgs {
		require.Equal(t, 2, runs[m], "%s: once a prefix", m)
	}

	// Inspect, Do, Begin, Forget and Abandon find the markers Consume
	// wrote, under the keys of the placed ids.
	r, err := k.Inspect(ctx, "orders", "m-1")
	require.NoError(t, err)
	assert.Equal(t, StateCompleted, r.State)
	assert.True(t, r.Compact, "a marker")
	assert.Equal(t, k.RecordID("orders", "m-1"), r.ID)
	assert.Equal(t, s.key(r.ID), r.Key)
	assert.NotEqual(t, s.RecordKey("orders", "m-1"), r.Key, "not the key by digest")
	v, err := Do(ctx, k, "orders", "m-2", func(context.Context) ([]byte, error) { return []byte("ran"), nil })
	require.NoError(t, err)
	assert.Empty(t, v, "m-2 was handled: its marker answers")
	out, err := k.Begin(ctx, "orders", "m-3")
	require.NoError(t, err)
	assert.True(t, out.Replayed, "m-3 was handled: %+v", out)
	_, err = k.Forget(ctx, "orders", "m-1", false)
	require.NoError(t, err)
	out, err = k.Begin(ctx, "orders", "m-1")
	require.NoError(t, err)
	require.NotNil(t, out.Claim, "forgotten, m-1 is claimed again")
	_, err = k.abandonKey(ctx, "orders", "m-1", out.Claim.Token())
	require.NoError(t, err)

	// What Do and Begin write, Consume finds: m-1's abandoned claim is
	// taken over, recovered; "new" was done by Do.
	_, err = Do(ctx, k, "orders", "new", func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	n, err := cc.Exists(ctx, s.key(k.RecordID("orders", "new"))).Result()
	require.NoError(t, err)
	assert.Equal(t, int64(1), n, "Do's record under the placed key")
	var recovered []bool
	res, err := Consume(ctx, k, "orders", []string{"m-1", "new"}, id, func(ctx context.Context, m string) error {
		c, _ := ClaimFromContext(ctx)
		recovered = append(recovered, c.Recovered())
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, MessageHandled, res[0].Status, "m-1 taken over")
	assert.Equal(t, []bool{true}, recovered, "m-1 ran once more, recovered")
	assert.Equal(t, MessageReplayed, res[1].Status, "new, done by Do")

	// The prefix is recorded as the default's: a Keeper of another
	// placement is refused before it writes, WithScopeShards(0) too.
	for _, n := range []int{0, 4} {
		other := newClusterKeeper(t, cc, WithScopeShards(n))
		_, err := Do(ctx, other, "orders", "m-9", func(context.Context) (int, error) { return 1, nil })
		assert.ErrorIs(t, err, ErrInvalidConfig, "WithScopeShards(%d) on the default's prefix", n)
		_, err = other.Inspect(ctx, "orders", "m-9")
		assert.ErrorIs(t, err, ErrInvalidConfig, "WithScopeShards(%d) on the default's prefix", n)
	}
	raw, err := cc.Get(ctx, prefixRecordKey(DefaultPrefix)).Result()
	require.NoError(t, err)
	ours, _ := layouts()
	assert.Equal(t, fmt.Sprintf("%s shards=%d", ours, ClusterScopeShards), raw)

	// One server's default is no shards.
	one := newKeeper(t, redistest.Miniredis(t))
	assert.Equal(t, recordID("orders", "m-1"), one.RecordID("orders", "m-1"))
}
