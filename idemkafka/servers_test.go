package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemkafka"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// The tests run Kafka in the process (franz-go's kfake, on 127.0.0.1) and
// a redis-server started by internal/redistest: without redis-server on
// PATH they skip with a message, and IDEM_REQUIRE_REDIS=1 makes that a
// failure.

const parts = 4

// cluster starts a kfake cluster with topics of parts partitions, closed in
// Cleanup.
func cluster(tb testing.TB, topics ...string) *kfake.Cluster {
	tb.Helper()
	return clusterWith(tb, nil, topics...)
}

// clusterWith is cluster with more kfake options.
func clusterWith(tb testing.TB, opts []kfake.Opt, topics ...string) *kfake.Cluster {
	tb.Helper()
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1), kfake.SeedTopics(parts, topics...)}, opts...)...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(c.Close)
	return c
}

// keeper returns a Keeper on a new redis-server, and the server.
func keeper(tb testing.TB, opts ...idem.Option) (*idem.Keeper, *redistest.Server) {
	tb.Helper()
	srv := redistest.Start(tb)
	k, err := idem.NewRedis(redistest.NewClient(tb, srv.Addr), opts...)
	if err != nil {
		tb.Fatal(err)
	}
	return k, srv
}

// clientOpts are the options of a group member of c: quick to notice a
// rebalance and to answer a poll.
func clientOpts(c *kfake.Cluster, group string, topics ...string) []kgo.Opt {
	return []kgo.Opt{
		kgo.SeedBrokers(c.ListenAddrs()...),
		kgo.ConsumerGroup(group),
		kgo.ConsumeTopics(topics...),
		kgo.FetchMaxWait(100 * time.Millisecond),
		kgo.HeartbeatInterval(100 * time.Millisecond),
	}
}

// produce sends n records to topic, numbered from first: key and value
// are the number, and header "id" is it too unless it is in noID.
func produce(tb testing.TB, c *kfake.Cluster, topic string, first, n int, noID ...int) {
	tb.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.DefaultProduceTopic(topic))
	if err != nil {
		tb.Fatal(err)
	}
	defer cl.Close()
	skip := map[int]bool{}
	for _, i := range noID {
		skip[i] = true
	}
	recs := make([]*kgo.Record, 0, n)
	for i := first; i < first+n; i++ {
		v := []byte(strconv.Itoa(i))
		r := &kgo.Record{Key: v, Value: v}
		if !skip[i] {
			r.Headers = []kgo.RecordHeader{{Key: "id", Value: v}}
		}
		recs = append(recs, r)
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		tb.Fatal(err)
	}
}

// committed returns the group's committed offset of each partition of
// topic (-1: none).
func committed(tb testing.TB, c *kfake.Cluster, group, topic string) map[int32]int64 {
	tb.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...))
	if err != nil {
		tb.Fatal(err)
	}
	defer cl.Close()
	req := kmsg.NewPtrOffsetFetchRequest()
	req.Group = group
	rt := kmsg.NewOffsetFetchRequestTopic()
	rt.Topic = topic
	for p := range int32(parts) {
		rt.Partitions = append(rt.Partitions, p)
	}
	req.Topics = append(req.Topics, rt)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		tb.Fatal(err)
	}
	out := map[int32]int64{}
	for _, t := range resp.Topics {
		for _, p := range t.Partitions {
			out[p.Partition] = p.Offset
		}
	}
	for _, g := range resp.Groups {
		for _, t := range g.Topics {
			for _, p := range t.Partitions {
				out[p.Partition] = p.Offset
			}
		}
	}
	return out
}

// committedTotal is the sum of the committed offsets of topic's partitions
// (those with none count 0).
func committedTotal(tb testing.TB, c *kfake.Cluster, group, topic string) int64 {
	var n int64
	for _, o := range committed(tb, c, group, topic) {
		n += max(o, 0)
	}
	return n
}

// waitFor polls cond every 20ms until it holds, or fails tb after d.
func waitFor(tb testing.TB, d time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// start runs r until the returned stop is called (or Cleanup): stop
// cancels Run's context and waits for Run, and returns its error.
func start(tb testing.TB, r *idemkafka.Runner) (stop func() error) {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(20 * time.Second):
				err = errors.New("Run did not return within 20s of its context's end")
			}
		})
		return err
	}
	tb.Cleanup(func() { _ = stop() })
	return stop
}

// counter counts handler runs by record value.
type counter struct {
	mu   sync.Mutex
	runs map[string]int
}

func newCounter() *counter { return &counter{runs: map[string]int{}} }

func (c *counter) add(v string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.runs[v]++
	return c.runs[v]
}

func (c *counter) get(v string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[v]
}

func (c *counter) distinct() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.runs)
}

// twice lists the values run more than once.
func (c *counter) twice() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for v, n := range c.runs {
		if n > 1 {
			out = append(out, fmt.Sprintf("%s×%d", v, n))
		}
	}
	return out
}
