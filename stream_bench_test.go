package idem

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// BenchmarkStreamConsumer: b.N entries (a fifth duplicate ids) in one
// stream, three consumers of one group in this process, batches of 500,
// handlers that do one INCR, eight at once: StreamConsumer against the
// hand-written loop (XREADGROUP, a pipeline of SET NX PX, the handlers, a
// pipeline of SET XX EX and XACK, XAUTOCLAIM every half lease). An op is an
// entry. Reports entries/s and Redis CPU per entry (INFO cpu, user and
// system). Each side starts its own redis-server; the figures quoted in
// docs/consumers.md are of 200,000 entries:
//
//	go test -run '^$' -bench BenchmarkStreamConsumer -benchtime 200000x .
func BenchmarkStreamConsumer(b *testing.B) {
	const batch, workers, concurrency = 500, 3, 8
	for _, loop := range []string{"idem", "baseline"} {
		b.Run(loop, func(b *testing.B) {
			var secs, cpu float64
			entries := b.N
			{
				srv := redistest.Start(b)
				c := srv.Client(b)
				ctx := context.Background()
				for i := 0; i < entries; i += 10_000 {
					pipe := c.Pipeline()
					for j := i; j < min(i+10_000, entries); j++ {
						id := j
						if j%5 == 4 {
							id = j - 1 - j%(2*batch) // a fifth repeat an id
						}
						pipe.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": "id-" + strconv.Itoa(id)}})
					}
					if _, err := pipe.Exec(ctx); err != nil {
						b.Fatal(err)
					}
				}
				if err := c.XGroupCreateMkStream(ctx, "s", "g", "0").Err(); err != nil {
					b.Fatal(err)
				}
				cpu0 := serverCPU(b, c)
				rctx, stop := context.WithCancel(ctx)
				var wg sync.WaitGroup
				began := time.Now()
				for w := range workers {
					wc := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 4 * concurrency})
					defer wc.Close()
					name := fmt.Sprint("w", w)
					wg.Add(1)
					go func() {
						defer wg.Done()
						handle := func(ctx context.Context, m redis.XMessage) error {
							return wc.Incr(ctx, "n").Err()
						}
						if loop == "baseline" {
							baselineStreamLoop(rctx, wc, name, batch, concurrency, 30*time.Second, handle)
							return
						}
						k, err := NewRedis(wc)
						if err != nil {
							b.Error(err)
							return
						}
						sc, err := NewStreamConsumer(k, wc, "s", "g", name, WithBatchSize(batch), WithConcurrency(concurrency))
						if err != nil {
							b.Error(err)
							return
						}
						_ = sc.Run(rctx, func(m redis.XMessage) string { return m.Values["id"].(string) }, handle)
					}()
				}
				for {
					g, err := c.XInfoGroups(ctx, "s").Result()
					if err != nil {
						b.Fatal(err)
					}
					if g[0].Pending == 0 && g[0].Lag == 0 {
						break
					}
					time.Sleep(2 * time.Millisecond)
				}
				secs += time.Since(began).Seconds()
				cpu += serverCPU(b, c) - cpu0
				stop()
				wg.Wait()
			}
			b.ReportMetric(float64(entries)/secs, "entries/s")
			b.ReportMetric(cpu/float64(entries)*1e6, "redis-µs/entry")
		})
	}
}

// baselineStreamLoop is the hand-written consumer the StreamConsumer is
// measured against: a key per id claimed with SET NX PX lease, the handlers
// of those claimed, the successes marked with SET XX EX (a day), every
// entry whose claim failed taken as done, and one XACK per batch; every half
// lease, XAUTOCLAIM of the entries idle for a lease.
func baselineStreamLoop(ctx context.Context, c *redis.Client, name string, batch, concurrency int, lease time.Duration, handle func(context.Context, redis.XMessage) error) {
	var sweepAt time.Time
	cursor := "0-0"
	for ctx.Err() == nil {
		var msgs []redis.XMessage
		if now := time.Now(); !now.Before(sweepAt) {
			var err error
			msgs, cursor, err = c.XAutoClaim(ctx, &redis.XAutoClaimArgs{Stream: "s", Group: "g", Consumer: name, MinIdle: lease, Start: cursor, Count: int64(batch)}).Result()
			if err != nil || cursor == "0-0" {
				cursor, sweepAt = "0-0", now.Add(lease/2)
			}
		} else {
			streams, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: name, Streams: []string{"s", ">"}, Count: int64(batch), Block: time.Second}).Result()
			if err != nil {
				continue
			}
			for _, s := range streams {
				msgs = append(msgs, s.Messages...)
			}
		}
		if len(msgs) == 0 {
			continue
		}
		pipe := c.Pipeline()
		claims := make([]*redis.BoolCmd, len(msgs))
		for i, m := range msgs {
			claims[i] = pipe.SetNX(ctx, "b:"+m.Values["id"].(string), "1", lease)
		}
		if _, err := pipe.Exec(ctx); err != nil && !strings.Contains(err.Error(), "nil") {
			continue
		}
		ok := make([]bool, len(msgs))
		var wg sync.WaitGroup
		next := make(chan int)
		for range concurrency {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range next {
					ok[i] = handle(ctx, msgs[i]) == nil
				}
			}()
		}
		for i := range msgs {
			if claims[i].Val() {
				next <- i
			} else {
				ok[i] = true // claimed before: taken as done
			}
		}
		close(next)
		wg.Wait()
		pipe = c.Pipeline()
		var ack []string
		for i, m := range msgs {
			if !ok[i] {
				continue
			}
			if claims[i].Val() {
				pipe.SetXX(ctx, "b:"+m.Values["id"].(string), "done", 24*time.Hour)
			}
			ack = append(ack, m.ID)
		}
		pipe.XAck(ctx, "s", "g", ack...)
		_, _ = pipe.Exec(ctx)
	}
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
