package idem

import (
	"context"
	"maps"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Tests of WithReplicas on a Cluster whose slot moves: the store sends the
// script and WAIT to a node's client itself, so it must follow MOVED and ASK
// itself, as go-redis does for the commands it routes.

// TestReplicasFollowAskDuringSlotMigration is the regression test of a store
// that treated ASK like MOVED: it reloaded the slot map and tried the same
// master again, which answers ASK again until the migration ends, so every
// step on a key moved to the importing node failed with ErrUnavailable. The
// store now sends ASKING, the script and WAIT to the importing node; that node
// has lost its scripts, so the store also loads them there. Each master has a
// replica, so WAIT is satisfied and the completion succeeds.
//
// A claim names the record key and its index key (every key it may read):
// while the slot migrates, a node that lacks one of them answers TRYAGAIN,
// so the claim is unavailable, never made by a node without the index.
func TestReplicasFollowAskDuringSlotMigration(t *testing.T) {
	cl := redistest.StartCluster(t, 2, 1)
	scripts := &scriptCounter{}
	cc := cl.Client(t, &redis.ClusterOptions{NewClient: scripts.newClient})
	ctx := context.Background()
	k := durableKeeper(t, cc, WithReplicas(1, time.Second))
	key := k.store.(*redisStore).key(k.RecordID("s", "k"))
	out, err := k.Begin(ctx, "s", "k")
	require.NoError(t, err)
	require.NotNil(t, out.Claim)

	// The reshard starts, and its MIGRATE moves the record.
	m := startMigration(t, cl, cc, key)
	host, port, err := net.SplitHostPort(m.dstAddr)
	require.NoError(t, err)
	require.NoError(t, m.src.Migrate(ctx, host, port, key, 0, 5*time.Second).Err())
	require.NoError(t, m.dst.ScriptFlush(ctx).Err())

	before := scripts.counts()
	require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0), "complete during the migration")
	assert.Equal(t, map[string]int{m.srcAddr: 1, m.dstAddr: 2}, scripts.since(before),
		"complete: ASK from the old owner, then NOSCRIPT and the completion on the importing node")
	assert.True(t, askingExists(t, m.dst, key), "the record is on the importing node")

	// The index key is on neither node: the old owner answers ASK, the
	// importing node TRYAGAIN.
	_, err = k.Begin(ctx, "s", "k")
	require.ErrorIs(t, err, ErrUnavailable, "claim during the migration of slot %d", m.slot)

	m.finish(t, cl)
	rep, err := k.Begin(ctx, "s", "k")
	require.NoError(t, err)
	assert.True(t, rep.Replayed)
	assert.Equal(t, "v", string(rep.Value))
}

// TestReplicasFollowMovedAfterSlotMigration moves a slot to the other master
// behind the clients' backs: their slot maps still name the old owner, which
// answers MOVED. The store sends the call to the node the MOVED names at once
// (one pipeline to each node, no retry on the old owner), and the client
// learns the new slot map, so that the completion goes straight to the new
// owner. A client whose slot map never learns of the move (ClusterSlots
// serves the map from before it) shows that the store follows the address in
// the MOVED reply, not a reloaded map.
func TestReplicasFollowMovedAfterSlotMigration(t *testing.T) {
	cl := redistest.StartCluster(t, 2, 1)
	ctx := context.Background()
	scripts := &scriptCounter{}
	cc := cl.Client(t, &redis.ClusterOptions{NewClient: scripts.newClient})
	oldMap, err := cl.Masters[0].Client(t).ClusterSlots(ctx).Result()
	require.NoError(t, err)
	frozen := cl.Client(t, &redis.ClusterOptions{
		NewClient:    scripts.newClient,
		ClusterSlots: func(context.Context) ([]redis.ClusterSlot, error) { return oldMap, nil },
	})
	k := loadedKeeper(t, cc)
	kf := loadedKeeper(t, frozen, WithPrefix("frozen:"))
	key := k.store.(*redisStore).key(k.RecordID("s", "moved"))

	m := startMigration(t, cl, cc, key)
	m.finish(t, cl)
	owner, err := cc.MasterForKey(ctx, key)
	require.NoError(t, err)
	require.Equal(t, m.srcAddr, owner.Options().Addr, "the client must not know of the move yet")

	before := scripts.counts()
	out, err := k.Begin(ctx, "s", "moved")
	require.NoError(t, err, "claim after slot %d moved", m.slot)
	require.NotNil(t, out.Claim)
	assert.Equal(t, map[string]int{m.srcAddr: 1, m.dstAddr: 1}, scripts.since(before),
		"claim: MOVED from the old owner, then straight to the new one")
	before = scripts.counts()
	require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))
	assert.Equal(t, map[string]int{m.dstAddr: 1}, scripts.since(before),
		"complete: the client knows the new owner")

	before = scripts.counts()
	out, err = kf.Begin(ctx, "s", "moved")
	require.NoError(t, err, "claim through a client whose slot map never changes")
	require.NotNil(t, out.Claim)
	require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))
	assert.Equal(t, map[string]int{m.srcAddr: 2, m.dstAddr: 2}, scripts.since(before),
		"claim and complete: each MOVED from the old owner, then sent to the new one")
}

// loadedKeeper returns a Keeper on a redisStore on cc with WithReplicas,
// whose scripts are loaded on every master, so that no NOSCRIPT adds
// pipelines. Loading them also makes cc load the slot map.
func loadedKeeper(t *testing.T, cc *redis.ClusterClient, ropts ...Option) *Keeper {
	t.Helper()
	s, err := openRedisStore(cc, append(ropts, WithReplicas(1, time.Second))...)
	require.NoError(t, err)
	require.NoError(t, s.LoadScripts(context.Background()))
	k, err := keeperOn(s)
	require.NoError(t, err)
	return k
}

// migration is a slot being moved from one master to the other.
type migration struct {
	slot             int64
	src, dst         *redis.Client
	srcID, dstID     string
	srcAddr, dstAddr string
}

// startMigration starts moving the slot of key away from its master, with
// CLUSTER SETSLOT IMPORTING and MIGRATING, as redis-cli does, after making cc
// learn the slot map. cl must have two masters.
func startMigration(t *testing.T, cl *redistest.Cluster, cc *redis.ClusterClient, key string) *migration {
	t.Helper()
	ctx := context.Background()
	slot, err := cc.ClusterKeySlot(ctx, key).Result()
	require.NoError(t, err)
	src, dst := cl.Masters[0], cl.Masters[1]
	if slot >= redistest.Slots/2 {
		src, dst = dst, src
	}
	owner, err := cc.MasterForKey(ctx, key)
	require.NoError(t, err)
	require.Equal(t, src.Addr, owner.Options().Addr)
	m := &migration{slot: slot, src: src.Client(t), dst: dst.Client(t), srcAddr: src.Addr, dstAddr: dst.Addr}
	m.srcID, err = m.src.ClusterMyID(ctx).Result()
	require.NoError(t, err)
	m.dstID, err = m.dst.ClusterMyID(ctx).Result()
	require.NoError(t, err)
	require.NoError(t, m.dst.Do(ctx, "cluster", "setslot", slot, "importing", m.srcID).Err())
	require.NoError(t, m.src.Do(ctx, "cluster", "setslot", slot, "migrating", m.dstID).Err())
	return m
}

// finish ends the migration of an empty slot (CLUSTER SETSLOT NODE on both
// masters) and waits until every node of cl names the new owner.
func (m *migration) finish(t *testing.T, cl *redistest.Cluster) {
	t.Helper()
	ctx := context.Background()
	for _, c := range []*redis.Client{m.dst, m.src} {
		require.NoError(t, c.Do(ctx, "cluster", "setslot", m.slot, "node", m.dstID).Err())
	}
	for _, n := range cl.Nodes() {
		c := n.Client(t)
		require.Eventually(t, func() bool { return slotOwner(ctx, c, m.slot) == m.dstAddr }, 20*time.Second, 20*time.Millisecond,
			"%s does not see slot %d on %s", n.Addr, m.slot, m.dstAddr)
	}
}

// slotOwner returns the address of the master that c says serves slot.
func slotOwner(ctx context.Context, c *redis.Client, slot int64) string {
	slots, err := c.ClusterSlots(ctx).Result()
	if err != nil {
		return ""
	}
	for _, s := range slots {
		if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 {
			return s.Nodes[0].Addr
		}
	}
	return ""
}

// askingExists reports whether key exists on c, a node importing its slot.
func askingExists(t *testing.T, c *redis.Client, key string) bool {
	t.Helper()
	ctx := context.Background()
	pipe := c.Pipeline()
	pipe.Do(ctx, "asking")
	exists := pipe.Exists(ctx, key)
	_, err := pipe.Exec(ctx)
	require.NoError(t, err)
	return exists.Val() == 1
}

// scriptCounter counts, per node address (as the Cluster names the node), the
// pipelines carrying a script (EVALSHA or EVAL) that the node clients of a
// ClusterClient send, when the ClusterClient makes them with newClient.
type scriptCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *scriptCounter) newClient(opt *redis.Options) *redis.Client {
	client := redis.NewClient(opt)
	client.AddHook(scriptHook{c: c, addr: client.NodeAddress()})
	return client
}

func (c *scriptCounter) counts() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.n)
}

// since returns the counts that grew since before, by how much.
func (c *scriptCounter) since(before map[string]int) map[string]int {
	d := map[string]int{}
	for addr, n := range c.counts() {
		if n > before[addr] {
			d[addr] = n - before[addr]
		}
	}
	return d
}

type scriptHook struct {
	c    *scriptCounter
	addr string
}

func (h scriptHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h scriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (h scriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if name := cmd.Name(); name == "evalsha" || name == "eval" {
				h.c.mu.Lock()
				if h.c.n == nil {
					h.c.n = map[string]int{}
				}
				h.c.n[h.addr]++
				h.c.mu.Unlock()
				break
			}
		}
		return next(ctx, cmds)
	}
}
