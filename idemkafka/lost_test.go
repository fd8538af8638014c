package idemkafka_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemkafka"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestLostPartitionCommitsNothing: while the handler of record 5 runs, the
// group answers the member's heartbeats UNKNOWN_MEMBER_ID, so the client
// loses its partitions (OnPartitionsLost). The handler finishes and its
// outcome is stored, but nothing more of its partition is committed in the
// generation lost; the member joins again (a new generation), is given the
// partition from its last commit, answers record 5 from Redis without
// running it again, and commits past it.
func TestLostPartitionCommitsNothing(t *testing.T) {
	c := clusterWith(t, []kfake.Opt{kfake.GroupMinSessionTimeout(100 * time.Millisecond)}, "orders")
	k, _ := keeper(t)
	const n = 40
	produce(t, c, "orders", 0, n)

	var failHeartbeats atomic.Bool
	var oldGeneration atomic.Int32
	c.ControlKey(int16(kmsg.Heartbeat), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if !failHeartbeats.Load() {
			return nil, nil, false
		}
		req := kreq.(*kmsg.HeartbeatRequest)
		oldGeneration.Store(req.Generation)
		resp := req.ResponseKind().(*kmsg.HeartbeatResponse)
		resp.Version = req.Version
		resp.ErrorCode = kerr.UnknownMemberID.Code
		return resp, nil, true
	})
	type commit struct {
		generation int32
		partition  int32
		offset     int64
	}
	var mu sync.Mutex
	var commits []commit
	c.ControlKey(int16(kmsg.OffsetCommit), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := kreq.(*kmsg.OffsetCommitRequest)
		mu.Lock()
		defer mu.Unlock()
		for _, rt := range req.Topics {
			for _, rp := range rt.Partitions {
				commits = append(commits, commit{req.Generation, rp.Partition, rp.Offset})
			}
		}
		return nil, nil, false
	})

	opts := append(clientOpts(c, "g", "orders"),
		kgo.SessionTimeout(time.Second), kgo.RebalanceTimeout(2*time.Second))
	runs := newCounter()
	started, release := make(chan struct{}), make(chan struct{})
	var part5 atomic.Int32
	var off5 atomic.Int64
	r, err := idemkafka.New(k, "orders", opts, func(ctx context.Context, rec *kgo.Record) error {
		if runs.add(string(rec.Value)) == 1 && string(rec.Value) == "5" {
			part5.Store(rec.Partition)
			off5.Store(rec.Offset)
			close(started)
			<-release
		}
		return nil
	}, idemkafka.WithErrorHandler(func(err error) { t.Log(err) }))
	if err != nil {
		t.Fatal(err)
	}
	lost := make(chan struct{})
	var lostOnce sync.Once
	idemkafka.OnRelease(r, func(wasLost bool) {
		if wasLost {
			lostOnce.Do(func() { close(lost) })
		}
	})
	stop := start(t, r)
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("record 5 was not handled within 20s")
	}
	failHeartbeats.Store(true)
	select {
	case <-lost: // its partitions stopped; it waits for the held handler
	case <-time.After(20 * time.Second):
		t.Fatal("the member did not lose its partitions within 20s")
	}
	failHeartbeats.Store(false)
	close(release)
	waitFor(t, 30*time.Second, "every offset committed", func() bool { return committedTotal(t, c, "g", "orders") == n })
	_ = stop()

	if got := runs.get("5"); got != 1 {
		t.Fatalf("record 5 ran %d times, want 1 (answered from Redis after the partition came back)", got)
	}
	if tw := runs.twice(); len(tw) > 0 {
		t.Fatalf("handled more than once: %v", tw)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, cm := range commits {
		if cm.partition == part5.Load() && cm.offset > off5.Load() {
			if cm.generation <= oldGeneration.Load() {
				t.Fatalf("the lost member committed partition %d past record 5: %+v (generation lost %d)", cm.partition, cm, oldGeneration.Load())
			}
			return // the first commit past record 5 is the next session's
		}
	}
	t.Fatal(fmt.Sprintf("no commit of partition %d past record 5", part5.Load()))
}
