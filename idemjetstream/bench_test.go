package idemjetstream_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemjetstream"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
)

// BenchmarkConsume runs the same stream through a Runner and through the
// loop a user writes by hand, on a real nats-server and redis-server, and
// reports messages per second (speed is measured, never asserted):
//
//	go test -run '^$' -bench Consume -benchtime 1x .
//
// Each op is a stream of benchMessages messages, a fifth of them a second
// copy of an id (stored: published after the Duplicates window), consumed
// by benchCallers goroutines in batches of 500 with a handler that does
// nothing; the clock runs from the first fetch to the last ack. The loop
// by hand is the two phases of docs/consumers.md's setnx2: Fetch, a
// pipelined SET id 1 NX PX lease, the handlers of the ids it set, a
// pipelined SET id 1 XX EX retention, then Ack (a failed SET NX is acked
// as seen: the loop cannot tell a live holder from a finished one).
func BenchmarkConsume(b *testing.B) {
	natsURL, redisAddr := startNATS(b), redistest.Start(b).Addr
	_, js := connect(b, natsURL)
	rc := redis.NewClient(&redis.Options{Addr: redisAddr, PoolSize: 4 * benchCallers})
	b.Cleanup(func() { rc.Close() })
	keeper, err := idem.NewRedis(rc)
	if err != nil {
		b.Fatal(err)
	}
	n := 0
	for _, tc := range []struct {
		name string
		run  func(ctx context.Context, cons jetstream.Consumer) error
	}{
		{"runner", func(ctx context.Context, cons jetstream.Consumer) error {
			r, err := idemjetstream.New(keeper, "bench", cons, func(ctx context.Context, m jetstream.Msg) error { return nil })
			if err != nil {
				return err
			}
			return r.Run(ctx)
		}},
		{"byhand", func(ctx context.Context, cons jetstream.Consumer) error {
			return byHand(ctx, rc, cons)
		}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var took time.Duration
			for range b.N {
				n++
				b.StopTimer() // publishing is not timed
				cons := benchStream(b, js, fmt.Sprintf("BENCH%d", n))
				b.StartTimer()
				took += consumeAll(b, cons, tc.run)
			}
			b.ReportMetric(float64(b.N*benchMessages)/took.Seconds(), "msgs/s")
		})
	}
}

const (
	benchMessages = 100_000
	benchCallers  = 4
	benchBatch    = 500
)

// benchStream publishes a stream of benchMessages messages, a fifth of
// them a second copy of an id stored past the Duplicates window, and
// returns a pull consumer of it.
func benchStream(b *testing.B, js jetstream.JetStream, name string) jetstream.Consumer {
	b.Helper()
	cons := stream(b, js, name, jetstream.StreamConfig{Duplicates: 100 * time.Millisecond},
		jetstream.ConsumerConfig{MaxAckPending: 2 * benchCallers * benchBatch})
	ids := benchMessages * 4 / 5
	var list []string
	for i := range ids {
		list = append(list, fmt.Sprint(name, "-", i))
	}
	ctx := context.Background()
	if err := publishChunks(ctx, js, name+".x", list, make([]bool, len(list))); err != nil {
		b.Fatal(err)
	}
	time.Sleep(150 * time.Millisecond)
	var again []string
	for i := 0; i < ids; i += 4 {
		again = append(again, list[i])
	}
	if err := publishChunks(ctx, js, name+".x", again, make([]bool, len(again))); err != nil {
		b.Fatal(err)
	}
	return cons
}

// consumeAll runs run in benchCallers goroutines until the consumer has
// acknowledged every message, and returns how long that took.
func consumeAll(b *testing.B, cons jetstream.Consumer, run func(ctx context.Context, cons jetstream.Consumer) error) time.Duration {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	started := time.Now()
	for range benchCallers {
		wg.Go(func() {
			if err := run(ctx, cons); ctx.Err() == nil {
				b.Error(err)
			}
		})
	}
	for {
		info, err := cons.Info(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream == benchMessages {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	took := time.Since(started)
	cancel()
	wg.Wait()
	return took
}

// byHand is the loop a user writes by hand: Fetch, pipelined SET NX PX,
// handle, pipelined SET XX EX, Ack.
func byHand(ctx context.Context, rc *redis.Client, cons jetstream.Consumer) error {
	const lease, retention = 30 * time.Second, 24 * time.Hour
	handled := atomic.Int64{}
	for ctx.Err() == nil {
		batch, err := cons.FetchNoWait(benchBatch)
		if err != nil {
			return err
		}
		var msgs []jetstream.Msg
		for m := range batch.Messages() {
			msgs = append(msgs, m)
		}
		if len(msgs) == 0 {
			time.Sleep(time.Millisecond)
			continue
		}
		p := rc.Pipeline()
		set := make([]*redis.BoolCmd, len(msgs))
		for i, m := range msgs {
			set[i] = p.SetNX(ctx, "byhand:"+m.Headers().Get(jetstream.MsgIDHeader), 1, lease)
		}
		if _, err := p.Exec(ctx); err != nil && err != redis.Nil {
			for _, m := range msgs {
				_ = m.NakWithDelay(time.Second)
			}
			continue
		}
		p = rc.Pipeline()
		for i, m := range msgs {
			if set[i].Val() {
				handled.Add(1) // the handler: nothing
				p.SetXX(ctx, "byhand:"+m.Headers().Get(jetstream.MsgIDHeader), 1, retention)
			}
		}
		if _, err := p.Exec(ctx); err != nil && err != redis.Nil {
			for _, m := range msgs {
				_ = m.NakWithDelay(time.Second)
			}
			continue
		}
		for _, m := range msgs {
			_ = m.Ack()
		}
	}
	return ctx.Err()
}
