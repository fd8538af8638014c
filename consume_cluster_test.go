package idem

// Consume on a Redis Cluster whose topology changes under load: slots
// resharded from master to master, and a replica taking over its master.
// Consumers take their batches from the redelivering broker of
// helpers_test.go, which checks that no handler runs twice.

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestClusterReshardUnderLoad moves slots between the masters of a 3-master
// Cluster while consumers run Consume, as redis-cli --cluster reshard does:
// CLUSTER SETSLOT IMPORTING and MIGRATING, MIGRATE of the slot's keys a few
// at a time (so that a marker's index key and call record are on two nodes
// for a while), then CLUSTER SETSLOT NODE on every master. The messages'
// records fall in the slots moved, many a batch, so that their claims are
// compact and their outcomes markers. New messages come before each move;
// a broker redelivers every message not acknowledged and, until the moves
// end, every acknowledged one too. No handler runs twice, and every message
// is acknowledged once the moves end, each one whose handler ran (nothing
// acknowledged that did not take effect).
//
// It runs three times: with the Cluster's default placement (the scope in
// ClusterScopeShards shards), with keys placed by their own digests
// (WithScopeShards(0)), and with the scope in six shards, where each slot
// moved holds a sixth of the scope.
func TestClusterReshardUnderLoad(t *testing.T) {
	redistest.Long(t)
	t.Run("the default placement", func(t *testing.T) { clusterReshard(t) })
	t.Run("keys placed by digest", func(t *testing.T) { clusterReshard(t, WithScopeShards(0)) })
	t.Run("a scope in six shards", func(t *testing.T) { clusterReshard(t, WithScopeShards(6)) })
}

func clusterReshard(t *testing.T, opts ...Option) {
	cl := redistest.StartCluster(t, 3, 0)
	cc := cl.Client(t, nil)
	ctx := context.Background()
	k, err := NewRedis(cc, append([]Option{WithLease(3 * time.Second)}, opts...)...)
	require.NoError(t, err)
	s := k.store.(*redisStore)

	const slotCount, perSlot, consumers, batch, rounds = 6, 60, 3, 60, 2
	msgs, slots := reshardMessages(k, slotCount, perSlot)
	require.Len(t, msgs, slotCount*perSlot, "messages in %d slots", slotCount)

	b := newRedeliveringBroker(t, k, msgs, batch, 5*time.Millisecond)
	b.start(consumers)

	moves, fresh := 0, msgs
	for r := 0; r < rounds; r++ {
		for _, sl := range slots {
			// New messages, first in the queue; the move starts once their
			// handlers start, so that their outcomes are stored while the
			// slot migrates.
			n := min(len(fresh), len(fresh)/(rounds*len(slots)-moves)+1)
			before := b.started.Load()
			b.add(true, fresh[:n]...)
			fresh = fresh[n:]
			for i := 0; i < 500 && b.started.Load() == before; i++ {
				time.Sleep(time.Millisecond)
			}
			reshardSlot(t, cl, sl)
			// The consumers' client learns the move before the next one
			// starts: go-redis v9.23.0 races (-race) on a pipeline to one
			// node whose first call is answered TRYAGAIN and another one
			// MOVED (pipelineReadCmds sends the whole pipeline again, the
			// redirected call too, so one Cmd is read by two goroutines).
			ikey := v3IndexKey(s.prefix, true, uint16(sl))
			require.Eventually(t, func() bool {
				cc.ReloadState(ctx)
				owner, err := cc.MasterForKey(ctx, ikey)
				return err == nil && owner.Options().Addr == slotOwner(ctx, cl.Masters[0].Client(t), int64(sl))
			}, 20*time.Second, 10*time.Millisecond, "the client learns the move of slot %d", sl)
			moves++
		}
	}
	require.Empty(t, fresh)
	b.stop()
	b.check(fmt.Sprintf("%d slot moves", moves))
}

// reshardMessages returns perSlot messages in each of slotCount slots: the
// slots of the first records found, and the messages whose records fall
// in them.
func reshardMessages(k *Keeper, slotCount, perSlot int) (msgs []string, slots []uint16) {
	s := k.store.(*redisStore)
	per := map[uint16]int{}
	for i := 0; len(msgs) < slotCount*perSlot && i < 1e7; i++ {
		m := fmt.Sprint("r", i)
		sl := keySlot(s.key(k.RecordID("s", m)))
		if _, ok := per[sl]; !ok && len(slots) < slotCount {
			slots = append(slots, sl)
			per[sl] = 0
		}
		if n, ok := per[sl]; ok && n < perSlot {
			per[sl] = n + 1
			msgs = append(msgs, m)
		}
	}
	return msgs, slots
}

// reshardSlot moves slot from its master to the next one, as redis-cli
// --cluster reshard does, with MIGRATE of one key at a time, a few
// milliseconds apart.
func reshardSlot(t *testing.T, cl *redistest.Cluster, slot uint16) {
	t.Helper()
	ctx := context.Background()
	var src, dst *redis.Client
	var dstAddr string
	clients := make([]*redis.Client, len(cl.Masters))
	ids := make([]string, len(cl.Masters))
	for i, m := range cl.Masters {
		clients[i] = m.Client(t)
		id, err := clients[i].ClusterMyID(ctx).Result()
		require.NoError(t, err)
		ids[i] = id
	}
	var srcID, dstID string
	owner := slotOwner(ctx, clients[0], int64(slot))
	for i, m := range cl.Masters {
		if m.Addr == owner {
			j := (i + 1) % len(cl.Masters)
			src, srcID = clients[i], ids[i]
			dst, dstID, dstAddr = clients[j], ids[j], cl.Masters[j].Addr
		}
	}
	require.NotNil(t, src, "owner of slot %d", slot)
	require.NoError(t, dst.Do(ctx, "cluster", "setslot", slot, "importing", srcID).Err())
	require.NoError(t, src.Do(ctx, "cluster", "setslot", slot, "migrating", dstID).Err())
	time.Sleep(20 * time.Millisecond)
	host, port, err := net.SplitHostPort(dstAddr)
	require.NoError(t, err)
	for {
		keys, err := src.ClusterGetKeysInSlot(ctx, int(slot), 1).Result()
		require.NoError(t, err)
		if len(keys) == 0 {
			break
		}
		args := []any{"migrate", host, port, "", 0, 5000, "keys"}
		for _, key := range keys {
			args = append(args, key)
		}
		require.NoError(t, src.Do(ctx, args...).Err(), "MIGRATE of slot %d", slot)
		time.Sleep(5 * time.Millisecond) // the consumers go on between batches
	}
	for _, c := range append([]*redis.Client{dst, src}, clients...) {
		require.NoError(t, c.Do(ctx, "cluster", "setslot", slot, "node", dstID).Err())
	}
	for _, c := range clients {
		require.Eventually(t, func() bool { return slotOwner(ctx, c, int64(slot)) == dstAddr }, 20*time.Second, 10*time.Millisecond)
	}
}

// TestClusterConsumeFailover: consumers run Consume, WithReplicas on, on a
// Cluster of 3 masters with a replica each, while a replica takes over its
// master with CLUSTER FAILOVER. The messages' records fall in a few slots,
// half of them the failed master's, many a batch, so that their claims are
// compact and their outcomes markers. A broker redelivers every message not
// acknowledged and, until the failover ends and a while after, every
// acknowledged one too. No handler runs twice, every message is
// acknowledged once the failover ends, and none can be claimed afterwards:
// a marker acknowledged before the failover is on the new master.
//
// It runs twice: with keys placed by their own digests (WithScopeShards(0)),
// and with the Cluster's default placement, the scope in
// ClusterScopeShards shards, four of whose slots hold the messages.
func TestClusterConsumeFailover(t *testing.T) {
	redistest.Long(t)
	t.Run("keys placed by digest", func(t *testing.T) { clusterConsumeFailover(t, WithScopeShards(0)) })
	t.Run("the default placement", func(t *testing.T) { clusterConsumeFailover(t) })
}

func clusterConsumeFailover(t *testing.T, opts ...Option) {
	cl := redistest.StartCluster(t, 3, 1)
	cc := cl.Client(t, nil)
	ctx := context.Background()
	k, err := NewRedis(cc, append([]Option{WithLease(3 * time.Second), WithReplicas(1, 2*time.Second)}, opts...)...)
	require.NoError(t, err)
	s := k.store.(*redisStore)

	// Messages in four slots: two of the master that fails over, two of
	// the others. It is the first master that holds two of the slots of
	// the first thousand messages while the others hold two (placed in a
	// scope's shards, the messages are in a few slots only).
	owner := cl.Masters[0].Client(t)
	fails := -1
	{
		slotsOf := map[string]map[uint16]bool{}
		for i := 0; i < 1000; i++ {
			sl := keySlot(s.key(k.RecordID("s", fmt.Sprint("f", i))))
			o := slotOwner(ctx, owner, int64(sl))
			if slotsOf[o] == nil {
				slotsOf[o] = map[uint16]bool{}
			}
			slotsOf[o][sl] = true
		}
		for i := 0; i < len(cl.Masters) && fails < 0; i++ {
			others := 0
			for addr, sls := range slotsOf {
				if addr != cl.Masters[i].Addr {
					others += len(sls)
				}
			}
			if len(slotsOf[cl.Masters[i].Addr]) >= 2 && others >= 2 {
				fails = i
			}
		}
	}
	require.GreaterOrEqual(t, fails, 0, "a master with two of the messages' slots, and two elsewhere")
	failing := cl.Masters[fails].Addr
	const perSlot, consumers, batch = 120, 3, 60
	var msgs []string
	per := map[uint16]int{}
	passed := map[uint16]bool{}
	onFailing, elsewhere := 0, 0
	for i := 0; len(msgs) < 4*perSlot && i < 1e7; i++ {
		m := fmt.Sprint("f", i)
		sl := keySlot(s.key(k.RecordID("s", m)))
		if _, ok := per[sl]; !ok {
			if len(per) == 4 || passed[sl] {
				continue
			}
			mine := slotOwner(ctx, owner, int64(sl)) == failing
			if mine && onFailing < 2 {
				onFailing++
			} else if !mine && elsewhere < 2 {
				elsewhere++
			} else {
				passed[sl] = true
				continue
			}
			per[sl] = 0
		}
		if per[sl] < perSlot {
			per[sl]++
			msgs = append(msgs, m)
		}
	}
	require.Len(t, msgs, 4*perSlot, "messages in 4 slots, 2 of the master that fails over")

	b := newRedeliveringBroker(t, k, msgs, batch, 2*time.Millisecond)
	b.add(false, msgs[:len(msgs)/2]...)
	b.start(consumers)

	// The failover starts once a quarter of the messages have been handled;
	// the other half of the messages comes while it runs.
	require.Eventually(t, func() bool { return b.started.Load() >= int64(len(msgs)/4) }, 60*time.Second, time.Millisecond)
	feed := make(chan struct{})
	go func() {
		defer close(feed)
		for rest := msgs[len(msgs)/2:]; len(rest) > 0; rest = rest[min(batch, len(rest)):] {
			b.add(false, rest[:min(batch, len(rest))]...)
			time.Sleep(5 * time.Millisecond)
		}
	}()
	began := time.Now()
	cl.Failover(t, cl.Replicas[fails][0])
	t.Logf("the failover took %s", time.Since(began).Round(time.Millisecond))
	<-feed
	// Acknowledged messages keep coming again for as long as the handling
	// took so far, after the failover: each must be answered by its marker
	// on the new master.
	require.Eventually(t, b.ackedAll, 60*time.Second, 5*time.Millisecond, "every message acknowledged after the failover")
	b.stop()
	b.check(fmt.Sprintf("%d slots (%d of the master that failed over)", len(per), onFailing))
}

// TestConsumeWithReplicasSettlesThroughASlotMigration: on a Cluster, a store
// made WithReplicas follows the redirects of a call itself, and gives up
// after four of them, about 150 ms. Two messages whose records share a
// slot are completed in one call; their handlers return while that slot
// migrates, one record moved and the other not: the old owner answers the
// call TRYAGAIN until the migration ends. Consume tries the completion
// again while the claims' lease is alive: the messages are handled once
// the migration has ended, and a redelivery is answered MessageReplayed.
func TestConsumeWithReplicasSettlesThroughASlotMigration(t *testing.T) {
	cl := redistest.StartCluster(t, 2, 1)
	cc := cl.Client(t, nil)
	ctx := context.Background()
	// refused is closed once three tries of the completion of both
	// messages were refused: more than Consume made before it tried again
	// (the settle window's and the last).
	refused := make(chan struct{})
	var once sync.Once
	var refusals atomic.Int32
	s, err := openRedisStore(cc, WithReplicas(1, time.Second))
	require.NoError(t, err)
	require.NoError(t, s.LoadScripts(ctx))
	k, err := keeperOn(s, WithLease(6*time.Second), WithRetention(time.Hour), WithObserver(ObserverFunc(func(_ context.Context, ev Event) {
		if ev.Step == StepComplete && ev.Result == ResultUnavailable && refusals.Add(1) >= 3*2 {
			once.Do(func() { close(refused) })
		}
	})))
	require.NoError(t, err)
	ids, _ := reshardMessages(k, 1, 2)
	key := s.key(k.RecordID("s", ids[0]))

	var runs atomic.Int32
	running, proceed := make(chan struct{}), make(chan struct{})
	type answer struct {
		res []MessageResult
		err error
	}
	returned := make(chan answer, 1)
	go func() {
		// Both outcomes go in one call: the window takes two.
		res, err := Consume(ctx, k, "s", msgs(ids...), msgID, func(context.Context, msg) error {
			if runs.Add(1) == 1 {
				close(running)
				<-proceed
			}
			return nil
		}, WithSettleWindow(time.Hour, 2))
		returned <- answer{res, err}
	}()
	<-running
	// The migration of the messages' slot starts; one of their records
	// moves. (The slot holds the two records, and in the v3 layout its
	// index key, whose token counter a claim of records moves too.)
	m := startMigration(t, cl, cc, key)
	keys, err := m.src.ClusterGetKeysInSlot(ctx, int(m.slot), 100).Result()
	require.NoError(t, err)
	records := []string{key, s.key(k.RecordID("s", ids[1]))}
	require.Subset(t, keys, records, "the two records")
	host, port, err := net.SplitHostPort(m.dstAddr)
	require.NoError(t, err)
	require.NoError(t, m.src.Migrate(ctx, host, port, records[0], 0, 5*time.Second).Err())
	close(proceed)
	select {
	case <-refused:
	case a := <-returned:
		t.Fatalf("Consume returned after %d refusals of a completion: %+v, %v", refusals.Load(), a.res, a.err)
	}
	// Refused, the completion waits for another try: the rest of the slot
	// moves, and the migration ends.
	for _, key := range keys {
		if key != records[0] {
			require.NoError(t, m.src.Migrate(ctx, host, port, key, 0, 5*time.Second).Err())
		}
	}
	m.finish(t, cl)
	var a answer
	select {
	case a = <-returned:
	case <-time.After(60 * time.Second): // a bound on a hang, not a measure
		t.Fatal("Consume did not return")
	}
	require.NoError(t, a.err)
	assert.Equal(t, []string{"handled ack=true", "handled ack=true"}, statuses(a.res), "%v", a.res)
	res, err := Consume(ctx, k, "s", msgs(ids...), msgID, func(context.Context, msg) error { runs.Add(1); return nil })
	require.NoError(t, err)
	assert.Equal(t, []string{"replayed ack=true", "replayed ack=true"}, statuses(res), "%v", res)
	assert.EqualValues(t, 2, runs.Load(), "each handler ran once")
}
