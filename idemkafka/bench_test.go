package idemkafka_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemkafka"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// BenchmarkConsume runs the same topic through a Runner and through the
// loop a user writes by hand, on kfake (Kafka in the process) and a real
// redis-server, at batches of 100 and 500, and reports records per second
// and Redis CPU per record (INFO cpu, user and system); speed is measured,
// never asserted:
//
//	cd idemkafka && go test -run '^$' -bench Consume -benchtime 1x .
//
// Each op is a topic of benchRecords records on 4 partitions, a fifth of
// them a second copy of an id (its "id" header), consumed by one member
// with a handler that does nothing; the clock runs from the start of the
// member to the group's last commit. The Runner keys by the header
// (WithKey(Header("id"))) and batches each partition (WithBatch). The loop
// by hand polls up to the batch across partitions, sends a pipelined SET
// id 1 NX PX lease, runs the handlers of the ids it set, a pipelined SET id
// 1 XX EX retention, and commits the poll (CommitRecords): one goroutine,
// no rebalance handling, and a failed SET NX taken as seen.
func BenchmarkConsume(b *testing.B) {
	srv := redistest.Start(b)
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 32})
	b.Cleanup(func() { rc.Close() })
	keeper, err := idem.NewRedis(rc)
	if err != nil {
		b.Fatal(err)
	}
	op := 0
	for _, batch := range []int{100, 500} {
		for _, tc := range []struct {
			name string
			run  func(ctx context.Context, opts []kgo.Opt) error
		}{
			{"runner", func(ctx context.Context, opts []kgo.Opt) error {
				r, err := idemkafka.New(keeper, "bench", opts, func(context.Context, *kgo.Record) error { return nil },
					idemkafka.WithKey(idemkafka.Header("id")), idemkafka.WithBatch(batch))
				if err != nil {
					return err
				}
				return r.Run(ctx)
			}},
			{"byhand", func(ctx context.Context, opts []kgo.Opt) error {
				return byHand(ctx, rc, opts, batch)
			}},
		} {
			b.Run(fmt.Sprintf("%s/batch=%d", tc.name, batch), func(b *testing.B) {
				var took time.Duration
				var cpu float64
				for range b.N {
					op++
					b.StopTimer() // producing is not timed
					c := benchTopic(b, op)
					cpu0 := serverCPU(b, rc)
					b.StartTimer()
					took += consumeAll(b, c, tc.run)
					b.StopTimer()
					cpu += serverCPU(b, rc) - cpu0
					c.Close()
					b.StartTimer()
				}
				b.ReportMetric(float64(b.N*benchRecords)/took.Seconds(), "msgs/s")
				b.ReportMetric(cpu/float64(b.N*benchRecords)*1e6, "redis-µs/msg")
			})
		}
	}
}

const benchRecords = 100_000

// benchTopic starts a kfake cluster whose topic "bench" holds benchRecords
// records, a fifth of them a second copy of an id, with ids unique to op.
func benchTopic(b *testing.B, op int) *kfake.Cluster {
	b.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(parts, "bench"))
	if err != nil {
		b.Fatal(err)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.DefaultProduceTopic("bench"))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ids := benchRecords * 4 / 5
	recs := make([]*kgo.Record, 0, 5000)
	send := func() {
		if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
			b.Fatal(err)
		}
		recs = recs[:0]
	}
	add := func(i int) {
		id := []byte(fmt.Sprint(op, "-", i))
		recs = append(recs, &kgo.Record{Key: id, Value: id, Headers: []kgo.RecordHeader{{Key: "id", Value: id}}})
		if len(recs) == cap(recs) {
			send()
		}
	}
	for i := range ids {
		add(i)
	}
	for i := 0; i < ids; i += 4 {
		add(i)
	}
	if len(recs) > 0 {
		send()
	}
	return c
}

// consumeAll runs run until group "bench" has committed every record of
// topic "bench", and returns how long that took.
func consumeAll(b *testing.B, c *kfake.Cluster, run func(ctx context.Context, opts []kgo.Opt) error) time.Duration {
	b.Helper()
	admin, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...))
	if err != nil {
		b.Fatal(err)
	}
	defer admin.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	started := time.Now()
	go func() {
		done <- run(ctx, []kgo.Opt{
			kgo.SeedBrokers(c.ListenAddrs()...), kgo.ConsumerGroup("bench"), kgo.ConsumeTopics("bench"),
			kgo.FetchMaxWait(100 * time.Millisecond),
		})
	}()
	for {
		if n := benchCommitted(b, admin); n == benchRecords {
			break
		}
		select {
		case err := <-done:
			b.Fatalf("the consumer returned before the end: %v", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	took := time.Since(started)
	cancel()
	<-done
	return took
}

// benchCommitted is the sum of group "bench"'s committed offsets of topic
// "bench".
func benchCommitted(b *testing.B, admin *kgo.Client) int64 {
	req := kmsg.NewPtrOffsetFetchRequest()
	req.Group = "bench"
	rt := kmsg.NewOffsetFetchRequestTopic()
	rt.Topic = "bench"
	for p := range int32(parts) {
		rt.Partitions = append(rt.Partitions, p)
	}
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(context.Background(), admin)
	if err != nil {
		b.Fatal(err)
	}
	var n int64
	for _, t := range resp.Topics {
		for _, p := range t.Partitions {
			n += max(p.Offset, 0)
		}
	}
	return n
}

// byHand is the loop a user writes by hand: poll, pipelined SET NX PX,
// handle, pipelined SET XX EX, commit.
func byHand(ctx context.Context, rc *redis.Client, opts []kgo.Opt, batch int) error {
	const lease, retention = 30 * time.Second, 24 * time.Hour
	cl, err := kgo.NewClient(append(opts, kgo.DisableAutoCommit())...)
	if err != nil {
		return err
	}
	defer cl.Close()
	id := idemkafka.Header("id")
	for ctx.Err() == nil {
		recs := cl.PollRecords(ctx, batch).Records()
		if len(recs) == 0 {
			continue
		}
		p := rc.Pipeline()
		set := make([]*redis.BoolCmd, len(recs))
		for i, r := range recs {
			set[i] = p.SetNX(ctx, "byhand:"+id(r), 1, lease)
		}
		if _, err := p.Exec(ctx); err != nil && err != redis.Nil {
			return err
		}
		p = rc.Pipeline()
		for i, r := range recs {
			if set[i].Val() {
				// the handler: nothing
				p.SetXX(ctx, "byhand:"+id(r), 1, retention)
			}
		}
		if _, err := p.Exec(ctx); err != nil && err != redis.Nil {
			return err
		}
		if err := cl.CommitRecords(ctx, recs...); err != nil && ctx.Err() == nil {
			return err
		}
	}
	return ctx.Err()
}

// serverCPU is the server's CPU time so far, user and system, in seconds.
func serverCPU(tb testing.TB, c *redis.Client) float64 {
	info, err := c.Info(context.Background(), "cpu").Result()
	if err != nil {
		tb.Fatal(err)
	}
	var sum float64
	for _, line := range strings.Split(info, "\r\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, _ := strconv.ParseFloat(v, 64)
			sum += f
		}
	}
	return sum
}
