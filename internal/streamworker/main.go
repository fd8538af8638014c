// Command streamworker is one consumer of a Redis stream's group through
// idem.StreamConsumer, for the kill test (stream_kill_test.go), which builds
// it, starts several, and kills one with SIGKILL mid-batch. Each entry's
// handler counts its run with one HINCRBY of the hash ran, field the
// entry's id field; the test reads those counts.
//
// With -log, for the chaos kill test, the handler's side effect is a line
// in that file instead (internal/runlog), written after a pause of -delay,
// with its claim's token and Recovered flag; the Keeper's Observer adds a
// line for each completion stored or refused. A file, unlike the hash in a
// Redis that the test restarts, takes every side effect the handler makes.
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
	"github.com/idemkit/idem/internal/runlog"
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
	logPath := flag.String("log", "", "the side-effect log (internal/runlog); empty: HINCRBY ran")
	delay := flag.Duration("delay", 0, "how long a handler takes, with -log")
	flag.Parse()
	if err := run(*addr, *stream, *group, *name, *lease, *batch, *conc, *logPath, *delay); err != nil {
		fmt.Fprintln(os.Stderr, "streamworker:", err)
		os.Exit(1)
	}
}

func run(addr, stream, group, name string, lease time.Duration, batch, conc int, logPath string, delay time.Duration) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	client := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 4 * conc})
	defer client.Close()
	opts := []idem.Option{idem.WithLease(lease), idem.WithRetention(time.Hour)}
	var log *runlog.Log
	if logPath != "" {
		var err error
		if log, err = runlog.Open(logPath); err != nil {
			return err
		}
		defer log.Close()
		opts = append(opts, idem.WithObserver(idem.ObserverFunc(func(_ context.Context, ev idem.Event) {
			switch {
			case ev.Step == idem.StepComplete && ev.Result == idem.ResultDone:
				_ = log.Stored(ev.ID, ev.Token)
			case ev.Step == idem.StepComplete && ev.Result == idem.ResultLeaseLost:
				_ = log.Fenced(ev.ID, ev.Token)
			}
		})))
	}
	k, err := idem.NewRedis(client, opts...)
	if err != nil {
		return err
	}
	handle := func(ctx context.Context, m redis.XMessage) error {
		return client.HIncrBy(ctx, "ran", m.Values["id"].(string), 1).Err()
	}
	if log != nil {
		// The side effect is a line of the log, made whatever the handler's
		// context says once the pause is over: as a handler that does not
		// look at it would, so that what fences a late one is the runner.
		handle = func(ctx context.Context, m redis.XMessage) error {
			c, ok := idem.ClaimFromContext(ctx)
			if !ok {
				return fmt.Errorf("no claim in the handler's context")
			}
			id, rid := m.Values["id"].(string), k.RecordID(c.Scope(), c.Key())
			if err := log.Start(id, rid, c.Token(), c.Recovered()); err != nil {
				return err
			}
			time.Sleep(delay)
			return log.Run(id, rid, c.Token(), c.Recovered())
		}
	}
	c, err := idem.NewStreamConsumer(k, client, stream, group, name, idem.WithBatchSize(batch), idem.WithConcurrency(conc))
	if err != nil {
		return err
	}
	fmt.Println("ready")
	err = c.Run(ctx, func(m redis.XMessage) string { s, _ := m.Values["id"].(string); return s }, handle)
	if ctx.Err() != nil {
		return nil
	}
	return err
}
