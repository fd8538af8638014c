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

// TestDeadLetterTopic: a record without the "id" header its key needs is
// produced to the dead-letter topic with its value and the idem- headers
// naming why and where it came from, and committed past; the Observer is
// told of it (StepStream, ResultDeadLettered) and of the backlog
// (StepBacklog).
func TestDeadLetterTopic(t *testing.T) {
	c := cluster(t, "orders", "orders.dead")
	var mu sync.Mutex
	var dead, backlog int
	k, _ := keeper(t, idem.WithObserver(idem.ObserverFunc(func(_ context.Context, ev idem.Event) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case ev.Step == idem.StepStream && ev.Result == idem.ResultDeadLettered:
			dead++
		case ev.Step == idem.StepBacklog:
			backlog++
		}
	})))
	const n = 20
	produce(t, c, "orders", 0, n, 4)
	runs := newCounter()
	r, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, rec *kgo.Record) error {
		runs.add(string(rec.Value))
		return nil
	}, idemkafka.WithKey(idemkafka.Header("id")), idemkafka.WithDeadLetterTopic("orders.dead"))
	if err != nil {
		t.Fatal(err)
	}
	stop := start(t, r)
	waitFor(t, 20*time.Second, "every offset committed", func() bool { return committedTotal(t, c, "g", "orders") == n })
	_ = stop()
	if got := runs.distinct(); got != n-1 {
		t.Fatalf("%d records handled, want %d", got, n-1)
	}

	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.ConsumeTopics("orders.dead"))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	fs := cl.PollFetches(ctx)
	if err := fs.Err0(); err != nil {
		t.Fatal(err)
	}
	recs := fs.Records()
	if len(recs) != 1 || string(recs[0].Value) != "4" {
		t.Fatalf("dead letters %v, want the record 4", recs)
	}
	h := map[string]string{}
	for _, x := range recs[0].Headers {
		h[x.Key] = string(x.Value)
	}
	if h[idemkafka.HeaderTopic] != "orders" || h[idemkafka.HeaderPartition] == "" || h[idemkafka.HeaderReason] == "" {
		t.Fatalf("dead letter's headers %v", h)
	}
	if _, err := strconv.ParseInt(h[idemkafka.HeaderOffset], 10, 64); err != nil {
		t.Fatalf("dead letter's offset header %q", h[idemkafka.HeaderOffset])
	}
	mu.Lock()
	defer mu.Unlock()
	if dead != 1 || backlog == 0 {
		t.Fatalf("the Observer was told of %d dead letters and %d backlogs, want 1 and some", dead, backlog)
	}
}
