package idemkafka_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemkafka"
	"github.com/twmb/franz-go/pkg/kgo"
)

// TestStopDrains: Run's context ends while the handler of the first record
// of each partition runs; Run waits for them, stores and commits them
// (each partition past its first record), starts no other record, and then
// returns. A runner started afterwards handles the rest, none twice.
func TestStopDrains(t *testing.T) {
	c := cluster(t, "orders")
	k, _ := keeper(t)
	const n = 40
	produce(t, c, "orders", 0, n)
	runs := newCounter()
	release := make(chan struct{})
	var held atomic.Int64
	a, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, rec *kgo.Record) error {
		runs.add(string(rec.Value))
		held.Add(1)
		<-release
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	stopA := start(t, a)
	waitFor(t, 20*time.Second, "a handler held in each partition", func() bool { return held.Load() == parts })
	returned := make(chan error, 1)
	go func() { returned <- stopA() }()
	select {
	case err := <-returned:
		t.Fatalf("Run returned %v while its handlers ran", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	if err := <-returned; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
	if got := runs.distinct(); got != parts {
		t.Fatalf("%d handlers ran, want %d (one a partition, no other started after the stop)", got, parts)
	}
	for p, o := range committed(t, c, "g", "orders") {
		if o != 1 {
			t.Errorf("partition %d committed at %d, want 1 (past the record whose handler ran)", p, o)
		}
	}

	b, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, rec *kgo.Record) error {
		runs.add(string(rec.Value))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	stopB := start(t, b)
	waitFor(t, 20*time.Second, "every offset committed", func() bool { return committedTotal(t, c, "g", "orders") == n })
	_ = stopB()
	if got := runs.distinct(); got != n {
		t.Fatalf("%d records handled, want %d", got, n)
	}
	if tw := runs.twice(); len(tw) > 0 {
		t.Fatalf("handled more than once: %v", tw)
	}
}
