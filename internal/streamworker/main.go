// Command streamworker is one consumer of a Redis stream's group through
// idem.StreamConsumer, for the kill test (stream_kill_test.go), which builds
// it, starts several, and kills one with SIGKILL mid-batch. Each entry's
// handler counts its run with one HINCRBY of the hash ran, field the
// entry's id field; the test reads those counts.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:6379", "Redis address")
	stream := flag.String("stream", "s", "stream")
	group := flag.String("group", "g", "consumer group")
	name := flag.String("name", "w", "consumer name")
	lease := flag.Duration("lease", 2*time.Second, "lease")
	batch := flag.Int("batch", 500, "entries per batch")
	conc := flag.Int("concurrency", 8, "handlers at once")
	flag.Parse()
	if err := run(*addr, *stream, *group, *name, *lease, *batch, *conc); err != nil {
		fmt.Fprintln(os.Stderr, "streamworker:", err)
		os.Exit(1)
	}
}

func run(addr, stream, group, name string, lease time.Duration, batch, conc int) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	client := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 4 * conc})
	defer client.Close()
	k, err := idem.NewRedis(client, idem.WithLease(lease), idem.WithRetention(time.Hour))
	if err != nil {
		return err
	}
	c, err := idem.NewStreamConsumer(k, client, stream, group, name, idem.WithBatchSize(batch), idem.WithConcurrency(conc))
	if err != nil {
		return err
	}
	fmt.Println("ready")
	err = c.Run(ctx, func(m redis.XMessage) string { s, _ := m.Values["id"].(string); return s },
		func(ctx context.Context, m redis.XMessage) error {
			return client.HIncrBy(ctx, "ran", m.Values["id"].(string), 1).Err()
		})
	if ctx.Err() != nil {
		return nil
	}
	return err
}
