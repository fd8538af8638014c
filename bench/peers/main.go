// Command peers measures idem against what a user would pick instead, one
// after another on the same machine: the seeds' Postgres design (pgx, with
// synchronous and with asynchronous commit), bsm/redislock's lock-then-check
// pattern, Fiber v3's idempotency middleware, bare net/http without any
// idempotency, idem.Do, and idem's HTTP middleware (idemhttp).
//
// It lives in its own module, so that the library's dependencies do not grow
// by pgx, redislock and Fiber. From the repository's root:
//
//	cd bench/peers && go run . [flags]
//	cd bench/peers && go run . -short          # the short form CI runs
//
// It starts the servers it needs and stops them at the end: a redis-server on
// a free loopback port (temporary directory, no persistence), and a Postgres
// (initdb in a temporary directory, listening only on a unix socket there,
// fsync and synchronous commit on; run as the postgres or nobody user when
// the command runs as root, since Postgres refuses root). redis-server comes
// from PATH (-redis-server), Postgres's initdb and postgres from -pg-bin
// (default: pg_config --bindir, else initdb on PATH, else the newest
// /usr/lib/postgresql/*/bin). A peer whose server cannot be found is an
// error; leave it out with -peers.
//
// Every peer guards the same operation: produce a 200-byte JSON result for
// the key. For each peer and each number of callers (-c, default 1 and 64)
// it runs two workloads, -d each (default 5 s) after an unmeasured warm-up:
//
//   - first: every call uses a fresh key, so the operation runs once per call.
//   - replay: every call repeats one of -keys keys that the peer completed
//     before the clock started, so the operation never runs.
//
// The peers (-peers, default all, in this order):
//
//   - postgres: the seeds' design on a logged table, pgx v5, synchronous
//     commit. A call looks for the stored result (SELECT: a replay is that
//     one round trip); on a miss it claims (INSERT ... ON CONFLICT DO
//     NOTHING RETURNING), runs, and writes the result (UPDATE): three round
//     trips and two commits for a first execution. With -pg-design claim, a
//     call starts with the claim instead, which reads a stored result in the
//     same statement: two round trips for a first execution, one heavier
//     statement for a replay.
//   - postgres-async: the same with synchronous_commit off.
//   - redislock: GET the result; on a miss obtain a bsm/redislock lock, GET
//     again, run, SET the result, release: five round trips for a first
//     execution, a bare GET for a replay.
//   - fiber: Fiber v3's middleware/idempotency with its defaults (in-memory
//     storage and in-process lock), over loopback HTTP.
//   - nethttp: the same handler on bare net/http, no idempotency at all: the
//     ceiling of an HTTP peer (its replay runs the operation again).
//   - idem: idem.Do on a plain go-redis client, default options.
//   - idemhttp: idemhttp.New's middleware with default options on net/http,
//     over loopback HTTP.
//
// With -rounds N the whole sequence runs N times, one round after another,
// and each cell reports the median ops/s of its rounds: on a machine that
// others share, a passing load then moves one round, not the verdict.
//
// HTTP peers share one kind of client: net/http with keep-alive, one POST
// with a small JSON body and the peer's key header per call. Every pool
// (go-redis, pgx, HTTP keep-alive) holds one connection per caller (-pool).
//
// The command checks what each cell did: no call failed, every result is the
// key's own 200-byte result, a first execution ran the operation exactly once
// per key, and a replay never ran it (the operation counts its executions per
// key). It prints a table of ops/s, p50/p99 latency and the process's heap
// allocations a call (callers, clients and the in-process HTTP servers) per
// peer, workload and callers, then idem's targets against the peers: ratios of ops/s at the
// largest number of callers, with whether each is met (-json prints one
// object instead). It exits with status 1 when a check fails, 2 on bad flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// run is the command; it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "peers:", err)
		return 2
	}
	rep, err := measureAll(ctx, o, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "peers:", err)
		return 1
	}
	if o.json {
		printJSON(stdout, rep)
	} else {
		printText(stdout, rep)
	}
	for _, p := range rep.Problems {
		fmt.Fprintln(stderr, "peers: FAIL:", p)
	}
	if len(rep.Problems) > 0 {
		return 1
	}
	return 0
}

// options are the command's flags.
type options struct {
	duration    time.Duration
	warmup      time.Duration
	callers     []int
	rounds      int
	keys        int
	peers       []string
	workloads   []string
	pool        int
	pgDesign    string
	redisServer string
	pgBin       string
	json        bool
}

// The short form's settings, for CI.
const (
	shortDuration = 300 * time.Millisecond
	shortWarmup   = 100 * time.Millisecond
	shortKeys     = 200
)

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	var callers, peers, workloads string
	var short bool
	fs := flag.NewFlagSet("peers", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.DurationVar(&o.duration, "d", 5*time.Second, "how long each cell (peer, workload, callers) is measured")
	fs.DurationVar(&o.warmup, "warmup", time.Second, "how long each cell runs, unmeasured, before it is measured (connections opened, caches warm)")
	fs.StringVar(&callers, "c", "1,64", "numbers of concurrent callers, comma-separated")
	fs.IntVar(&o.rounds, "rounds", 1, "how many times to run every cell, one round of all peers after another; each cell then reports the median ops/s of its rounds")
	fs.IntVar(&o.keys, "keys", 10000, "how many keys each peer completes before its replay cells, which repeat them")
	fs.StringVar(&peers, "peers", strings.Join(peerNames(), ","), "peers to run, comma-separated, in this order")
	fs.StringVar(&workloads, "workloads", "first,replay", "workloads to run, comma-separated: first, replay")
	fs.IntVar(&o.pool, "pool", 0, "connections per pool (go-redis, pgx, HTTP keep-alive) (default: the largest -c)")
	fs.StringVar(&o.pgDesign, "pg-design", pgLookupFirst, "how the Postgres design starts a call: lookup (SELECT the result; on a miss INSERT ... ON CONFLICT DO NOTHING, run, UPDATE) or claim (INSERT ... ON CONFLICT DO NOTHING and the SELECT of a stored result in one statement, then run, UPDATE)")
	fs.StringVar(&o.redisServer, "redis-server", "redis-server", "the redis-server binary (a name on PATH or a path)")
	fs.StringVar(&o.pgBin, "pg-bin", "", "the directory of Postgres's initdb and postgres (default: pg_config --bindir, else initdb on PATH, else the newest /usr/lib/postgresql/*/bin)")
	fs.BoolVar(&o.json, "json", false, "print one JSON object instead of the table")
	fs.BoolVar(&short, "short", false, fmt.Sprintf("the short form, for CI: -d %s -warmup %s -keys %d unless given", shortDuration, shortWarmup, shortKeys))
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: peers [flags]\n\nMeasures idem against the peers a user would pick instead, on servers it starts itself.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if short {
		o.applyShort(fs)
	}
	return o, o.check(callers, peers, workloads)
}

// applyShort sets the short form's settings where the flags did not.
func (o *options) applyShort(fs *flag.FlagSet) {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !set["d"] {
		o.duration = shortDuration
	}
	if !set["warmup"] {
		o.warmup = shortWarmup
	}
	if !set["keys"] {
		o.keys = shortKeys
	}
}

// check checks the flags and parses the lists.
func (o *options) check(callers, peers, workloads string) error {
	var err error
	if o.callers, err = parseCallers(callers); err != nil {
		return err
	}
	if o.peers, err = parseList("-peers", peers, peerNames()); err != nil {
		return err
	}
	if o.workloads, err = parseList("-workloads", workloads, []string{workloadFirst, workloadReplay}); err != nil {
		return err
	}
	switch {
	case o.duration <= 0:
		return fmt.Errorf("-d %s: want a positive duration", o.duration)
	case o.warmup < 0:
		return fmt.Errorf("-warmup %s: want 0 or more", o.warmup)
	case o.rounds < 1:
		return fmt.Errorf("-rounds %d: want at least 1", o.rounds)
	case o.keys < 1:
		return fmt.Errorf("-keys %d: want at least 1", o.keys)
	case o.pool < 0:
		return fmt.Errorf("-pool %d: want 0 (one per caller) or more", o.pool)
	case o.pgDesign != pgLookupFirst && o.pgDesign != pgClaimFirst:
		return fmt.Errorf("-pg-design %q: want %s or %s", o.pgDesign, pgLookupFirst, pgClaimFirst)
	}
	if o.pool == 0 {
		o.pool = slices.Max(o.callers)
	}
	return nil
}

// parseCallers parses -c: positive numbers, comma-separated.
func parseCallers(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("-c %q: want positive numbers, comma-separated", s)
		}
		out = append(out, n)
	}
	return out, nil
}

// parseList parses a comma-separated list of names out of known, and keeps
// them in known's order.
func parseList(flagName, s string, known []string) ([]string, error) {
	asked := map[string]bool{}
	for _, f := range strings.Split(s, ",") {
		name := strings.TrimSpace(f)
		if !slices.Contains(known, name) {
			return nil, fmt.Errorf("%s: unknown %q; want some of %s", flagName, name, strings.Join(known, ","))
		}
		asked[name] = true
	}
	var out []string
	for _, name := range known {
		if asked[name] {
			out = append(out, name)
		}
	}
	return out, nil
}
