package idemkafka_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemkafka"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestRevokeFinishesRunningStartsNoMore: the first member's handler holds
// the first record of each of its four partitions while a second member
// joins; the rebalance revokes two partitions from the first, whose
// revoke waits for their held handlers, stores and commits them, and
// starts no other record of those partitions. The second member is given
// them from past the held record: in each partition it handles, the first
// member ran exactly one record, and no record runs twice.
func TestRevokeFinishesRunningStartsNoMore(t *testing.T) {
	c := cluster(t, "orders")
	k, _ := keeper(t)
	const n = 80
	produce(t, c, "orders", 0, n)
	var syncs atomic.Int64
	c.ControlKey(int16(kmsg.SyncGroup), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		syncs.Add(1)
		return nil, nil, false
	})

	runs := newCounter()
	var mu sync.Mutex
	byA, byB := map[int32]int{}, map[int32]int{}
	release := make(chan struct{})
	var held atomic.Int64
	a, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, rec *kgo.Record) error {
		runs.add(string(rec.Value))
		mu.Lock()
		byA[rec.Partition]++
		first := byA[rec.Partition] == 1
		mu.Unlock()
		if first {
			held.Add(1)
			<-release
		}
		return nil
	}, idemkafka.WithBatch(50))
	if err != nil {
		t.Fatal(err)
	}
	var revoked atomic.Int64
	idemkafka.OnRelease(a, func(lost bool) {
		if !lost {
			revoked.Add(1)
		}
	})
	stopA := start(t, a)
	waitFor(t, 20*time.Second, "a handler held in each partition", func() bool { return held.Load() == parts })
	before := syncs.Load()

	b, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, rec *kgo.Record) error {
		runs.add(string(rec.Value))
		mu.Lock()
		byB[rec.Partition]++
		mu.Unlock()
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	stopB := start(t, b)
	// Both members synced the plan that moves partitions, and the first
	// stopped the revoked ones: it waits for its held handlers.
	waitFor(t, 20*time.Second, "the rebalance", func() bool { return syncs.Load() >= before+2 })
	waitFor(t, 20*time.Second, "the revoke", func() bool { return revoked.Load() > 0 })
	close(release)
	waitFor(t, 20*time.Second, "every offset committed", func() bool { return committedTotal(t, c, "g", "orders") == n })
	_ = stopA()
	_ = stopB()

	if got := runs.distinct(); got != n {
		t.Fatalf("%d records handled, want %d", got, n)
	}
	if tw := runs.twice(); len(tw) > 0 {
		t.Fatalf("handled more than once: %v", tw)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(byB) == 0 {
		t.Fatal("no partition moved to the second member")
	}
	for p := range byB {
		if byA[p] != 1 {
			t.Errorf("partition %d: the first member ran %d records, want 1 (the held one, then no more once revoked)", p, byA[p])
		}
	}
	t.Logf("first member %v, second %v", byA, byB)
}
