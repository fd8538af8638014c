package idemkafka_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemkafka"
	"github.com/twmb/franz-go/pkg/kgo"
)

// The backlog is reported by partition: 50 records in partition 2 only,
// and a Runner that takes 10 at a time and whose handlers wait. Its first
// report names that partition alone, and what Kafka holds past the poll
// (Lag) and what the Runner holds (Pending) add up to the 50.
func TestBacklogByPartition(t *testing.T) {
	const n, inFlight = 50, 10
	c := cluster(t, "orders")
	var mu sync.Mutex
	var reports []idem.Event
	k, _ := keeper(t, idem.WithObserver(idem.ObserverFunc(func(_ context.Context, ev idem.Event) {
		if ev.Step == idem.StepBacklog {
			mu.Lock()
			reports = append(reports, ev)
			mu.Unlock()
		}
	})))
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.DefaultProduceTopic("orders"),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	recs := make([]*kgo.Record, n)
	for i := range recs {
		v := []byte(strconv.Itoa(i))
		recs[i] = &kgo.Record{Partition: 2, Value: v, Headers: []kgo.RecordHeader{{Key: "id", Value: v}}}
	}
	err = cl.ProduceSync(context.Background(), recs...).FirstErr()
	cl.Close()
	if err != nil {
		t.Fatal(err)
	}

	gate := make(chan struct{})
	r, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, _ *kgo.Record) error {
		select {
		case <-gate:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}, idemkafka.WithKey(idemkafka.Header("id")), idemkafka.WithMaxInFlight(inFlight))
	if err != nil {
		t.Fatal(err)
	}
	stop := start(t, r)
	waitFor(t, 20*time.Second, "a backlog report", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(reports) > 0
	})
	mu.Lock()
	first := reports[0]
	mu.Unlock()
	close(gate)
	if first.ID != "orders/2" || first.Scope != "orders" {
		t.Errorf("the first report is of %q in scope %q, want orders/2 in orders", first.ID, first.Scope)
	}
	if first.Pending < 1 || first.Pending > inFlight || first.Lag+first.Pending != n {
		t.Errorf("the first report has Lag %d and Pending %d: want 1 to %d held and the rest of %d in Kafka", first.Lag, first.Pending, inFlight, n)
	}
	waitFor(t, 20*time.Second, "every offset committed", func() bool { return committedTotal(t, c, "g", "orders") == n })
	if err := stop(); err != context.Canceled {
		t.Fatalf("Run: %v", err)
	}
}
