package idem

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/require"
)

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
// It runs twice: with keys placed by their own digests, and with the scope
// in 16 shards (WithScopeShards), four of whose slots hold the messages.
func TestClusterConsumeFailover(t *testing.T) {
	redistest.Long(t)
	t.Run("keys placed by digest", func(t *testing.T) { clusterConsumeFailover(t) })
	t.Run("a scope in 16 shards", func(t *testing.T) { clusterConsumeFailover(t, WithScopeShards(16)) })
}

func clusterConsumeFailover(t *testing.T, opts ...Option) {
	cl := redistest.StartCluster(t, 3, 1)
	cc := cl.Client(t, nil)
	ctx := context.Background()
	k, err := NewRedis(cc, append([]Option{WithLease(3 * time.Second), WithReplicas(1, 2*time.Second)}, opts...)...)
	require.NoError(t, err)
	s := k.store.(*RedisStore)

	// Messages in four slots: two of the master that fails over, two of
	// the others.
	failing := cl.Masters[0].Addr
	owner := cl.Masters[0].Client(t)
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
	cl.Failover(t, cl.Replicas[0][0])
	t.Logf("the failover took %s", time.Since(began).Round(time.Millisecond))
	<-feed
	// Acknowledged messages keep coming again for as long as the handling
	// took so far, after the failover: each must be answered by its marker
	// on the new master.
	require.Eventually(t, b.ackedAll, 60*time.Second, 5*time.Millisecond, "every message acknowledged after the failover")
	b.stop()
	b.check(fmt.Sprintf("%d slots (%d of the master that failed over)", len(per), onFailing))
}
