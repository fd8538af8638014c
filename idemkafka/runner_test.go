package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemkafka"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestRunHandlesEachOnceAndCommitsAfterStored runs 400 records on 4
// partitions through a Runner, with every OffsetCommit checked as kfake
// receives it: each record below the offset committed had its handler run
// and its outcome stored in Redis (Inspect: completed) before the commit
// was sent. Each record is handled once, and the offsets reach the end.
func TestRunHandlesEachOnceAndCommitsAfterStored(t *testing.T) {
	c := cluster(t, "orders")
	k, _ := keeper(t)
	const n = 400
	produce(t, c, "orders", 0, n)

	var mu sync.Mutex
	keys := map[int32]map[int64]string{} // partition: offset: key, once handled
	checked := map[int32]int64{}         // partition: offsets below checked
	var bad []string
	c.ControlKey(int16(kmsg.OffsetCommit), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := kreq.(*kmsg.OffsetCommitRequest)
		mu.Lock()
		defer mu.Unlock()
		for _, rt := range req.Topics {
			for _, rp := range rt.Partitions {
				for o := checked[rp.Partition]; o < rp.Offset; o++ {
					key, ok := keys[rp.Partition][o]
					if !ok {
						bad = append(bad, fmt.Sprintf("%d@%d committed before its handler ran", rp.Partition, o))
						continue
					}
					rec, err := k.Inspect(context.Background(), "orders", key)
					if err != nil || rec.State != idem.StateCompleted {
						bad = append(bad, fmt.Sprintf("%d@%d committed while its record is %v (%v)", rp.Partition, o, rec.State, err))
					}
				}
				checked[rp.Partition] = max(checked[rp.Partition], rp.Offset)
			}
		}
		return nil, nil, false
	})

	runs := newCounter()
	r, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, rec *kgo.Record) error {
		runs.add(string(rec.Value))
		mu.Lock()
		if keys[rec.Partition] == nil {
			keys[rec.Partition] = map[int64]string{}
		}
		keys[rec.Partition][rec.Offset] = idemkafka.Position(rec)
		mu.Unlock()
		return nil
	}, idemkafka.WithBatch(50), idemkafka.WithConcurrency(4), idemkafka.WithErrorHandler(func(err error) { t.Log(err) }))
	if err != nil {
		t.Fatal(err)
	}
	stop := start(t, r)
	waitFor(t, 20*time.Second, "every offset committed", func() bool { return committedTotal(t, c, "g", "orders") == n })
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
	if got := runs.distinct(); got != n {
		t.Fatalf("%d records handled, want %d", got, n)
	}
	if tw := runs.twice(); len(tw) > 0 {
		t.Fatalf("handled more than once: %v", tw)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(bad) > 0 {
		t.Fatalf("%d commits ahead of stored outcomes, first: %s", len(bad), bad[0])
	}
}

// refuseCommits makes c answer every OffsetCommit with an error while
// refusing is set (a commit that did not land).
func refuseCommits(c interface {
	ControlKey(int16, func(kmsg.Request) (kmsg.Response, error, bool))
	KeepControl()
}, refusing *atomic.Bool) {
	c.ControlKey(int16(kmsg.OffsetCommit), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if !refusing.Load() {
			return nil, nil, false
		}
		req := kreq.(*kmsg.OffsetCommitRequest)
		resp := req.ResponseKind().(*kmsg.OffsetCommitResponse)
		resp.Version = req.Version
		for _, rt := range req.Topics {
			t := kmsg.NewOffsetCommitResponseTopic()
			t.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				p := kmsg.NewOffsetCommitResponseTopicPartition()
				p.Partition = rp.Partition
				p.ErrorCode = kerr.OffsetMetadataTooLarge.Code
				t.Partitions = append(t.Partitions, p)
			}
			resp.Topics = append(resp.Topics, t)
		}
		return resp, nil, true
	})
}

// TestRestartAnswersFromStored: a first Runner handles every record but
// none of its commits lands; a second member of the same group, started
// after it, is given every record again from offset 0, and answers each
// from its stored outcome without running its handler, then commits.
func TestRestartAnswersFromStored(t *testing.T) {
	c := cluster(t, "orders")
	k, _ := keeper(t)
	const n = 200
	produce(t, c, "orders", 0, n)
	var refusing atomic.Bool
	refusing.Store(true)
	refuseCommits(c, &refusing)

	first := newCounter()
	var commitErrs atomic.Int64
	a, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, rec *kgo.Record) error {
		first.add(string(rec.Value))
		return nil
	}, idemkafka.WithErrorHandler(func(err error) {
		if strings.Contains(err.Error(), "commit") {
			commitErrs.Add(1)
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	stopA := start(t, a)
	waitFor(t, 20*time.Second, "the first runner to handle every record", func() bool { return first.distinct() == n })
	waitFor(t, 5*time.Second, "a commit refused", func() bool { return commitErrs.Load() > 0 })
	if err := stopA(); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v", err)
	}
	if got := committedTotal(t, c, "g", "orders"); got != 0 {
		t.Fatalf("committed %d offsets while commits were refused", got)
	}
	refusing.Store(false)

	second := newCounter()
	b, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, rec *kgo.Record) error {
		second.add(string(rec.Value))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	stopB := start(t, b)
	waitFor(t, 20*time.Second, "every offset committed", func() bool { return committedTotal(t, c, "g", "orders") == n })
	_ = stopB()
	if got := second.distinct(); got != 0 {
		t.Fatalf("the second runner ran %d handlers of records already handled, want 0", got)
	}
	if tw := first.twice(); len(tw) > 0 {
		t.Fatalf("handled more than once: %v", tw)
	}
}

// TestRebalanceMovesPartitions: a second member joins the group while the
// first handles a stream, and then the first leaves: partitions move both
// times, each record is handled exactly once (those the first had handled
// and not committed are answered from Redis by the second), both members
// handle some, and the offsets reach the end.
func TestRebalanceMovesPartitions(t *testing.T) {
	c := cluster(t, "orders")
	k, _ := keeper(t)
	runs := newCounter()
	var byA, byB atomic.Int64
	handler := func(by *atomic.Int64) func(context.Context, *kgo.Record) error {
		return func(ctx context.Context, rec *kgo.Record) error {
			runs.add(string(rec.Value))
			by.Add(1)
			time.Sleep(time.Millisecond)
			return nil
		}
	}
	opts := []idemkafka.Option{idemkafka.WithBatch(20), idemkafka.WithErrorHandler(func(err error) { t.Log(err) })}
	a, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), handler(&byA), opts...)
	if err != nil {
		t.Fatal(err)
	}
	produce(t, c, "orders", 0, 300)
	stopA := start(t, a)
	waitFor(t, 20*time.Second, "the first runner to start", func() bool { return byA.Load() >= 50 })

	b, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), handler(&byB), opts...)
	if err != nil {
		t.Fatal(err)
	}
	stopB := start(t, b)
	produce(t, c, "orders", 300, 300)
	waitFor(t, 20*time.Second, "the second runner to be given partitions", func() bool { return byB.Load() > 0 })
	waitFor(t, 20*time.Second, "the first 600 records handled", func() bool { return runs.distinct() == 600 })
	if err := stopA(); !errors.Is(err, context.Canceled) {
		t.Fatalf("the first Run returned %v", err)
	}
	produce(t, c, "orders", 600, 100)
	waitFor(t, 20*time.Second, "every offset committed", func() bool { return committedTotal(t, c, "g", "orders") == 700 })
	_ = stopB()
	if got := runs.distinct(); got != 700 {
		t.Fatalf("%d records handled, want 700", got)
	}
	if tw := runs.twice(); len(tw) > 0 {
		t.Fatalf("handled more than once: %v", tw)
	}
	t.Logf("first runner %d, second %d handlers", byA.Load(), byB.Load())
}

// TestDeadLetters: a record whose handler always fails and one whose
// handler panics are run WithMaxDeliveries (3) times each, then
// dead-lettered with a reason that wraps ErrMaxDeliveries; one with no key
// (no "id" header) is dead-lettered at once, its handler never run; the
// others are handled once, and the partitions are committed past all.
func TestDeadLetters(t *testing.T) {
	c := cluster(t, "orders")
	k, _ := keeper(t)
	const n = 60
	produce(t, c, "orders", 0, n, 21)
	runs := newCounter()
	var mu sync.Mutex
	dead := map[string]error{}
	r, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, rec *kgo.Record) error {
		v := string(rec.Value)
		runs.add(v)
		switch v {
		case "7":
			return errors.New("always fails")
		case "13":
			panic("poison")
		}
		return nil
	},
		idemkafka.WithKey(idemkafka.Header("id")), idemkafka.WithMaxDeliveries(3), idemkafka.WithRetryDelay(10*time.Millisecond),
		idemkafka.WithDeadLetter(func(ctx context.Context, rec *kgo.Record, reason error) error {
			mu.Lock()
			defer mu.Unlock()
			dead[string(rec.Value)] = reason
			return nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	stop := start(t, r)
	waitFor(t, 20*time.Second, "every offset committed", func() bool { return committedTotal(t, c, "g", "orders") == n })
	_ = stop()
	mu.Lock()
	defer mu.Unlock()
	if len(dead) != 3 {
		t.Fatalf("dead letters %v, want 7, 13 and 21", dead)
	}
	for _, v := range []string{"7", "13"} {
		if got := runs.get(v); got != 3 {
			t.Errorf("record %s ran %d times, want 3", v, got)
		}
		if !errors.Is(dead[v], idemkafka.ErrMaxDeliveries) {
			t.Errorf("record %s dead-lettered for %v, want ErrMaxDeliveries", v, dead[v])
		}
	}
	if !strings.Contains(fmt.Sprint(dead["13"]), "panicked: poison") {
		t.Errorf("the panicking record's reason %v does not name the panic", dead["13"])
	}
	if got := runs.get("21"); got != 0 || !errors.Is(dead["21"], idem.ErrInvalidKey) {
		t.Errorf("the record without a key ran %d times, dead-lettered for %v; want 0 and ErrInvalidKey", got, dead["21"])
	}
	for i := range n {
		v := fmt.Sprint(i)
		if v != "7" && v != "13" && v != "21" && runs.get(v) != 1 {
			t.Errorf("record %s ran %d times, want 1", v, runs.get(v))
		}
	}
}

// TestRedisOutagePauses: redis-server is stopped while records arrive; the
// Runner reports the outage, runs no handler, and does not end; once
// Redis is back every record is handled once and committed.
func TestRedisOutagePauses(t *testing.T) {
	c := cluster(t, "orders")
	k, srv := keeper(t)
	runs := newCounter()
	var unavailable atomic.Int64
	r, err := idemkafka.New(k, "orders", clientOpts(c, "g", "orders"), func(ctx context.Context, rec *kgo.Record) error {
		runs.add(string(rec.Value))
		return nil
	}, idemkafka.WithRetryDelay(50*time.Millisecond), idemkafka.WithErrorHandler(func(err error) {
		if errors.Is(err, idem.ErrUnavailable) {
			unavailable.Add(1)
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	produce(t, c, "orders", 0, 50)
	stop := start(t, r)
	// Stored and committed before the outage: the server restarts empty.
	waitFor(t, 20*time.Second, "the first records committed", func() bool { return committedTotal(t, c, "g", "orders") == 50 })
	srv.Stop()
	produce(t, c, "orders", 50, 50)
	waitFor(t, 20*time.Second, "the outage reported", func() bool { return unavailable.Load() >= 2 })
	if got := runs.distinct(); got != 50 {
		t.Fatalf("%d handlers ran while Redis was down", got-50)
	}
	srv.Restart(t)
	waitFor(t, 20*time.Second, "every offset committed", func() bool { return committedTotal(t, c, "g", "orders") == 100 })
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled (an outage must not end it)", err)
	}
	if tw := runs.twice(); len(tw) > 0 {
		t.Fatalf("handled more than once: %v", tw)
	}
}

// TestNewRefuses: misuse is refused by New with idem.ErrInvalidConfig.
func TestNewRefuses(t *testing.T) {
	c := cluster(t, "orders")
	k2, _ := keeper(t)
	h := func(context.Context, *kgo.Record) error { return nil }
	for name, call := range map[string]func() error{
		"no group": func() error {
			_, err := idemkafka.New(k2, "s", []kgo.Opt{kgo.SeedBrokers(c.ListenAddrs()...)}, h)
			return err
		},
		"nil keeper":  func() error { _, err := idemkafka.New(nil, "s", clientOpts(c, "g", "orders"), h); return err },
		"nil handler": func() error { _, err := idemkafka.New(k2, "s", clientOpts(c, "g", "orders"), nil); return err },
		"batch 0": func() error {
			_, err := idemkafka.New(k2, "s", clientOpts(c, "g", "orders"), h, idemkafka.WithBatch(0))
			return err
		},
		"deliveries 0": func() error {
			_, err := idemkafka.New(k2, "s", clientOpts(c, "g", "orders"), h, idemkafka.WithMaxDeliveries(0))
			return err
		},
		"negative delay": func() error {
			_, err := idemkafka.New(k2, "s", clientOpts(c, "g", "orders"), h, idemkafka.WithRetryDelay(-1))
			return err
		},
		"nil key": func() error {
			_, err := idemkafka.New(k2, "s", clientOpts(c, "g", "orders"), h, idemkafka.WithKey(nil))
			return err
		},
	} {
		if err := call(); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%s: %v, want ErrInvalidConfig", name, err)
		}
	}
}
