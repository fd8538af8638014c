package idem

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestClusterSlotMigrationRunsMarkersAgain: on a Cluster a marker lives in
// two keys of one slot (the index key and the call record), and there is no
// record key. While a slot migrates (redis-cli --cluster reshard MIGRATEs
// its keys in batches), some of them are on the old owner and some on the
// new one. claim.lua (Begin, Do) declares only the record key: the old owner
// does not have it, so ASK sends the script to the importing node, which
// reads the undeclared index key and call record there: with nothing moved
// yet (the slot only marked MIGRATING, for the whole reshard of the slot)
// or the call record moved first, it finds no index key and claims the key;
// with the index key moved first it finds the entry but no call record,
// takes the entry for stale, drops it (the marker is gone for good) and
// claims the key. Every way, Begin claims a key whose message Consume handled ("Begin, Do:
// ErrResultExpired ... never a second run"), and would as well claim one a
// consumer holds right now. (Consume's own claim declares several keys and
// is answered TRYAGAIN, unavailable, during the migration: safe.)
func TestClusterSlotMigrationRunsMarkersAgain(t *testing.T) {
	cl := redistest.StartCluster(t, 2, 0)
	cc := cl.Client(t, nil)
	ctx := context.Background()
	k, err := NewRedis(cc)
	require.NoError(t, err)
	s := k.store.(*redisStore)

	// Four messages whose records share a slot, so that a Cluster keeps
	// their claims compactly (clusterCompactMin).
	sameSlot := func(prefix string) []string {
		first := prefix + "0"
		want := keySlot(s.key(k.RecordID("s", first)))
		keys := []string{first}
		for i := 1; len(keys) < 4; i++ {
			if key := fmt.Sprint(prefix, i); keySlot(s.key(k.RecordID("s", key))) == want {
				keys = append(keys, key)
			}
		}
		return keys
	}
	id := func(m string) string { return m }
	runs := map[string]int{}
	handle := func(_ context.Context, m string) error { runs[m]++; return nil }

	for _, moved := range []string{"nothing", "index key", "call record"} {
		t.Run(moved+" moved first", func(t *testing.T) {
			msgs := sameSlot(fmt.Sprint("m-", len(moved), "-"))
			res, err := Consume(ctx, k, "s", msgs, id, handle)
			require.NoError(t, err)
			for i, r := range res {
				require.Equal(t, MessageHandled, r.Status, msgs[i])
			}
			slot := keySlot(s.key(k.RecordID("s", msgs[0])))
			_, ikey, base := s.compactIndexArgs(k.RecordID("s", msgs[0]))
			m := startSlotMigration(t, cl, cc, int64(slot))
			calls, err := m.src.Keys(ctx, base+"*").Result()
			require.NoError(t, err)
			require.Len(t, calls, 1, "one call record: the markers are compact")
			require.EqualValues(t, 1, m.src.Exists(ctx, ikey).Val(), "the index key")

			// One MIGRATE batch of the reshard moves this key first.
			if moved != "nothing" {
				first := ikey
				if moved == "call record" {
					first = calls[0]
				}
				host, port, _ := net.SplitHostPort(m.dstAddr)
				require.NoError(t, m.src.Migrate(ctx, host, port, first, 0, 5*time.Second).Err())
			}

			// The broker redelivers: Consume is refused (TRYAGAIN), not run.
			// No claim reached the store, which Consume reports as an error
			// wrapping ErrUnavailable, with every result (MessageRetry).
			res, err = Consume(ctx, k, "s", msgs, id, handle)
			require.ErrorIs(t, err, ErrUnavailable)
			require.Len(t, res, len(msgs))
			for i, r := range res {
				require.NotEqual(t, MessageHandled, r.Status, "%s handled again during the migration", msgs[i])
			}
			for _, msg := range msgs {
				require.Equal(t, 1, runs[msg], "handler runs of %s", msg)
			}
			// Begin (or Do) on a key whose message was handled.
			o, err := k.Begin(ctx, "s", msgs[0])
			assert.Nil(t, o.Claim, "Begin claimed a key whose message was handled, during the migration of its slot (err %v)", err)
			assert.ErrorIs(t, err, ErrUnavailable, "Begin during the migration of the slot")
		})
	}
}

// TestClusterSlotMigrationLosesCompletions: a Consume batch whose slot
// starts migrating while its handlers run (CLUSTER SETSLOT MIGRATING, no key
// moved yet). Its completions lose nothing: the settle declares the call
// record and the index key, both still on the old owner, which runs it
// there, and every message is handled. (The name is that of the failure it
// guards against: a settle that declared only a record key, which a compact
// claim does not have, was sent to the importing node and answered "lease
// lost".)
func TestClusterSlotMigrationLosesCompletions(t *testing.T) {
	cl := redistest.StartCluster(t, 2, 0)
	cc := cl.Client(t, nil)
	ctx := context.Background()
	k, err := NewRedis(cc)
	require.NoError(t, err)
	s := k.store.(*redisStore)
	first := "c0"
	slot := keySlot(s.key(k.RecordID("s", first)))
	msgs := []string{first}
	for i := 1; len(msgs) < 4; i++ {
		if key := fmt.Sprint("c", i); keySlot(s.key(k.RecordID("s", key))) == slot {
			msgs = append(msgs, key)
		}
	}
	started := false
	res, err := Consume(ctx, k, "s", msgs, func(m string) string { return m }, func(context.Context, string) error {
		if !started {
			started = true
			startSlotMigration(t, cl, cc, int64(slot)) // an operator starts a reshard
		}
		return nil
	})
	require.NoError(t, err)
	for i, r := range res {
		assert.Equal(t, MessageHandled, r.Status, "%s: handled, its slot migrating: %v", msgs[i], r.Err)
	}
}

type slotMigration struct {
	src, dst         *redis.Client
	srcAddr, dstAddr string
}

// startSlotMigration marks slot as migrating from its master to the other one
// (CLUSTER SETSLOT IMPORTING, then MIGRATING, as redis-cli does).
func startSlotMigration(t *testing.T, cl *redistest.Cluster, cc *redis.ClusterClient, slot int64) *slotMigration {
	t.Helper()
	ctx := context.Background()
	src, dst := cl.Masters[0], cl.Masters[1]
	if slot >= redistest.Slots/2 {
		src, dst = dst, src
	}
	m := &slotMigration{src: src.Client(t), dst: dst.Client(t), srcAddr: src.Addr, dstAddr: dst.Addr}
	srcID, err := m.src.ClusterMyID(ctx).Result()
	require.NoError(t, err)
	dstID, err := m.dst.ClusterMyID(ctx).Result()
	require.NoError(t, err)
	require.NoError(t, m.dst.Do(ctx, "cluster", "setslot", slot, "importing", srcID).Err())
	require.NoError(t, m.src.Do(ctx, "cluster", "setslot", slot, "migrating", dstID).Err())
	return m
}

// TestClusterSlotMigrationYoungEntryWithoutCallRecord: an index entry whose
// call record is missing is stale only when it is older than any call
// record lives (the lease and the retention); a younger one shows a call
// record that is elsewhere (its slot migrating) or lost, and Begin and
// Consume answer unavailable, neither claiming the key nor dropping the
// entry. Once the call record is back the marker answers again; once the
// entry is older than that, it is taken for stale.
func TestClusterSlotMigrationYoungEntryWithoutCallRecord(t *testing.T) {
	b := redistest.Miniredis(t)
	ctx := context.Background()
	k, err := NewRedis(b.Client, WithLease(time.Second), WithRetention(time.Hour))
	require.NoError(t, err)
	msgs := []string{"y0", "y1", "y2", "y3"}
	runs := map[string]int{}
	handle := func(_ context.Context, m string) error { runs[m]++; return nil }
	id := func(m string) string { return m }
	res, err := Consume(ctx, k, "s", msgs, id, handle)
	require.NoError(t, err)
	for i, r := range res {
		require.Equal(t, MessageHandled, r.Status, msgs[i])
	}
	_, _, base := k.store.(*redisStore).compactIndexArgs(k.RecordID("s", msgs[0]))
	calls, err := b.Client.Keys(ctx, base+"*").Result()
	require.NoError(t, err)
	require.Len(t, calls, 1, "one call record: the markers are compact")
	call, err := b.Client.Get(ctx, calls[0]).Result()
	require.NoError(t, err)
	require.NoError(t, b.Client.Del(ctx, calls[0]).Err())

	o, err := k.Begin(ctx, "s", msgs[0])
	require.ErrorIs(t, err, ErrUnavailable, "Begin on a young entry without its call record")
	assert.Nil(t, o.Claim)
	res, err = Consume(ctx, k, "s", msgs, id, handle)
	require.ErrorIs(t, err, ErrUnavailable, "Consume on young entries without their call record")
	for i, r := range res {
		assert.Equal(t, MessageRetry, r.Status, msgs[i])
		assert.ErrorIs(t, r.Err, ErrUnavailable, msgs[i])
	}

	require.NoError(t, b.Client.Set(ctx, calls[0], call, 0).Err())
	o, err = k.Begin(ctx, "s", msgs[0])
	require.NoError(t, err)
	assert.Nil(t, o.Claim)
	assert.True(t, o.Replayed, "the marker answers again: its entry was kept")

	require.NoError(t, b.Client.Del(ctx, calls[0]).Err())
	b.Advance(time.Hour + 2*time.Second)
	o, err = k.Begin(ctx, "s", msgs[0])
	require.NoError(t, err, "an entry older than the lease and the retention, its call record gone, is stale")
	require.NotNil(t, o.Claim)
	require.NoError(t, o.Claim.Complete(ctx, nil, 0))
	res, err = Consume(ctx, k, "s", msgs[1:], id, handle)
	require.NoError(t, err)
	for i, r := range res {
		assert.Equal(t, MessageHandled, r.Status, msgs[1+i])
	}
	for _, m := range msgs {
		if m != msgs[0] {
			assert.Equal(t, 2, runs[m], "handler runs of %s", m)
		}
	}
}
