// Command idem-demo serves a small payments API guarded by idem's HTTP
// middleware and drives it with a retry storm, then checks the ledger: every
// payment charged exactly once, every replay identical to the first response.
// Then it runs a stream of orders through queue consumers that use
// idem.Consume and checkpoints, while they crash mid-batch, lose partitions
// to rebalances and get the producer's duplicates, and checks that every
// order's steps took effect exactly once.
//
// Usage:
//
//	go run ./cmd/idem-demo                      # embedded miniredis, storm, table
//	go run ./cmd/idem-demo -redis redis://localhost:6379/0
//	go run ./cmd/idem-demo -serve 127.0.0.1:8080 # serve for curl instead
//	go run ./cmd/idem-demo -unguarded            # the same storm without idem
//
// With no -redis flag it starts an embedded miniredis, so it needs nothing but
// Go. -seed repeats the traffic (the requests, the events, the crash and
// rebalance draws), not the interleaving: the counts differ from run to
// run, the checks do not. It exits with status 1 if a payment was charged twice, a replay differed
// from the first response, a payment never got an answer, or an order's step
// took effect twice or never; 2 on bad flags or an unreachable Redis.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// run is the whole command; it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem-demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	redisURL := fs.String("redis", "", "Redis URL (redis:// or rediss://, as go-redis parses it); default: an embedded miniredis")
	serve := fs.String("serve", "", "serve the API on this address (such as 127.0.0.1:8080) until interrupted, instead of the storm")
	unguarded := fs.Bool("unguarded", false, "serve the API without the middleware, to see what it prevents (the checks fail)")
	cfg := defaultStorm()
	fs.IntVar(&cfg.Payments, "payments", cfg.Payments, "distinct payments in the storm")
	fs.IntVar(&cfg.Copies, "copies", cfg.Copies, "copies of each payment sent at once, with the same key")
	fs.IntVar(&cfg.Resends, "resends", cfg.Resends, "copies of each payment sent again after it was answered")
	fs.IntVar(&cfg.Clients, "clients", cfg.Clients, "concurrent clients, each sending one payment's copies at once")
	fs.DurationVar(&cfg.Work, "work", cfg.Work, "time the API spends on one charge")
	fs.Float64Var(&cfg.CutRate, "cut", cfg.CutRate, "share of requests cut off by a client timeout (then retried)")
	fs.Float64Var(&cfg.ChangeRate, "change", cfg.ChangeRate, "share of payments retried once more with another amount")
	fs.Float64Var(&cfg.NoKeyRate, "nokey", cfg.NoKeyRate, "share of payments also sent once without a key")
	fs.Uint64Var(&cfg.Seed, "seed", 0, "seed of the random choices (0: a random one): a seed sends the same requests again (amounts, which are cut off and when, which are resent changed or without a key) and publishes the same events, but clients and consumers interleave as the scheduler runs them, so the counts differ from run to run")
	deadline := fs.Duration("deadline", time.Minute, "give up on the storm, and on the consumer scenario, after this long")
	ccfg, consumers := consumerFlags(fs)
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "idem-demo: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if err := cfg.validate(); err != nil {
		fmt.Fprintf(stderr, "idem-demo: %v\n", err)
		return 2
	}
	if err := ccfg.validate(); err != nil {
		fmt.Fprintf(stderr, "idem-demo: %v\n", err)
		return 2
	}

	client, where, closeRedis, err := openRedis(ctx, *redisURL)
	if err != nil {
		fmt.Fprintf(stderr, "idem-demo: %v\n", err)
		return 2
	}
	defer closeRedis()
	events := &eventCounts{}
	keeper, err := newKeeper(client, events)
	if err != nil {
		fmt.Fprintf(stderr, "idem-demo: %v\n", err)
		return 2
	}
	book := newLedger()
	api, err := newAPI(keeper, book, cfg.Work)
	if *unguarded {
		api = unguardedAPI(book, cfg.Work)
	}
	if err != nil {
		fmt.Fprintf(stderr, "idem-demo: %v\n", err)
		return 2
	}

	addr := *serve
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintf(stderr, "idem-demo: %v\n", err)
		return 2
	}
	srv := &http.Server{Handler: api, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	base := "http://" + ln.Addr().String()

	if *serve != "" {
		fmt.Fprintf(stdout, "idem-demo: Redis: %s\n", where)
		fmt.Fprintf(stdout, "serving POST %s/payments (guarded) and GET %s/payments (the ledger); Ctrl-C stops.\n\n", base, base)
		fmt.Fprintf(stdout, "  curl -i -X POST %s/payments -H 'Idempotency-Key: order-1' -d '{\"payment\":\"order-1\",\"amount\":1000,\"currency\":\"EUR\"}'\n", base)
		fmt.Fprintf(stdout, "  (run it twice: the second answer is the first one, with Idempotent-Replayed: true;\n")
		fmt.Fprintf(stdout, "   change the amount: 422; drop the header: 400)\n")
		fmt.Fprintf(stdout, "  curl %s/payments\n", base)
		<-ctx.Done()
		return 0
	}

	if cfg.Seed == 0 {
		cfg.Seed = randomSeed()
	}
	guard := "guarded by idemhttp.New"
	if *unguarded {
		guard = "NOT guarded (-unguarded)"
	}
	fmt.Fprintf(stdout, "idem-demo: a retry storm against POST %s/payments, %s\n", base, guard)
	fmt.Fprintf(stdout, "Redis: %s\n", where)
	fmt.Fprintf(stdout, "storm: %d clients send %d payments, each as %d concurrent copies then %d more, %s per charge, %.0f%% cut off by client timeouts (-seed %d sends the same requests again; the counts vary with the interleaving)\n\n",
		cfg.Clients, cfg.Payments, cfg.Copies, cfg.Resends, cfg.Work, 100*cfg.CutRate, cfg.Seed)

	sctx, cancel := context.WithTimeout(ctx, *deadline)
	defer cancel()
	started := time.Now()
	rep, err := storm(sctx, base, cfg)
	elapsed := time.Since(started)
	if err != nil {
		fmt.Fprintf(stderr, "idem-demo: storm: %v\n", err)
		return 1
	}
	v := check(rep, book)
	printTable(stdout, cfg, rep, v, events, elapsed)
	ok := v.ok(rep)
	if *consumers {
		ccfg.Seed = cfg.Seed
		ok = runConsumers(ctx, stdout, stderr, client, *ccfg, !*unguarded, *deadline) && ok
	}
	if !ok {
		return 1
	}
	return 0
}

// openRedis returns a client of the Redis at url, or of an embedded
// miniredis when url is empty, a description of it without credentials, and
// a function that closes both.
func openRedis(ctx context.Context, url string) (*redis.Client, string, func(), error) {
	if url == "" {
		mr := miniredis.NewMiniRedis()
		if err := mr.Start(); err != nil {
			return nil, "", nil, fmt.Errorf("starting miniredis: %w", err)
		}
		c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
		closeAll := func() { c.Close(); mr.Close() }
		return c, "embedded miniredis on " + mr.Addr() + " (in-process; -redis URL to use a real server)", closeAll, nil
	}
	opt, err := redis.ParseURL(url)
	if err != nil {
		return nil, "", nil, fmt.Errorf("-redis: %w", err)
	}
	c := redis.NewClient(opt)
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := c.Ping(pctx).Err(); err != nil {
		c.Close()
		return nil, "", nil, fmt.Errorf("redis at %s: %w", opt.Addr, err)
	}
	where := fmt.Sprintf("redis at %s, db %d", opt.Addr, opt.DB)
	if opt.TLSConfig != nil {
		where += ", TLS"
	}
	return c, where, func() { c.Close() }, nil
}

// newKeeper keeps this run's records under a prefix of their own, for ten
// minutes, so that runs against a shared Redis neither meet nor linger. It
// tells obs of its steps and the middleware's requests.
func newKeeper(c *redis.Client, obs idem.Observer) (*idem.Keeper, error) {
	var id [4]byte
	_, _ = rand.Read(id[:])
	return idem.NewRedis(c, idem.WithPrefix("idem-demo:"+hex.EncodeToString(id[:])+":"),
		idem.WithRetention(10*time.Minute), idem.WithObserver(obs))
}

func randomSeed() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	s := uint64(0)
	for _, x := range b {
		s = s<<8 | uint64(x)
	}
	return max(s, 1)
}

// errDeadline reports a storm cut short by its deadline.
var errDeadline = errors.New("the storm did not finish before -deadline")
