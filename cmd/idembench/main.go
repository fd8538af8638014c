// Command idembench puts idem under load against a Redis and reports what it
// costs: operations per second, latency percentiles, Redis commands and Redis
// CPU per operation, allocations per operation, and how many operations ran
// more than once (which must be none). With -baseline it also runs, at the
// same concurrency and interleaved with the idem run, the least an
// application could do in idem's place, and prints the ratio between the two,
// so that a figure always comes with the speed of the same Redis, client and
// machine.
//
// Usage:
//
//	idembench [flags]
//
// Without -redis or -cluster it starts an embedded miniredis, which runs Lua
// in a Go interpreter several times slower than Redis and has no INFO
// commandstats: fine to try the tool, not to judge idem. Point it at a real
// server for figures:
//
//	idembench -redis redis://127.0.0.1:6379 -autopipeline -c 256 -d 20s -workload first -baseline pair
//	idembench -redis redis://127.0.0.1:6379 -autopipeline -c 256 -d 20s -workload replay -baseline get
//	idembench -redis redis://127.0.0.1:6379 -mode http -c 64 -d 10s -workload replay -baseline bare
//	idembench -redis redis://127.0.0.1:6379 -workload batch -batch 500 -dup 0.2 -c 4 -messages 1000000 -baseline setnx
//	idembench -redis redis://127.0.0.1:6379 -workload batch -batch 500 -dup 0.2 -c 4 -messages 1000000 -baseline setnx2
//	idembench -redis redis://127.0.0.1:6379 -workload batch -batch 500 -dup 0.2 -c 4 -messages 1000000 -baseline setnx2 -fail 0.01
//	idembench -redis redis://127.0.0.1:6379 -workload batch -baseline setnx2 -rate 4000 -c 3 -d 20s
//
// With -autopipeline, idem's commands go through go-redis's AutoPipeliner,
// with two batches in flight and a 200µs flush delay unless -ap-batches and
// -ap-delay say otherwise: on a small machine whose cores the client and the
// server share, that lets one batch run in Redis while the client prepares
// the next, where go-redis's defaults (one batch, no delay) leave them taking
// turns. The baseline runs on a plain client unless -baseline-autopipeline
// gives it an AutoPipeliner of the same settings.
//
// Modes:
//
//   - do (default): each operation is one idem.Do call whose function
//     returns a -body-byte result.
//   - http: each operation is one POST with an Idempotency-Key, over loopback
//     HTTP with keep-alive, to a server in the process on 127.0.0.1:
//     idemhttp's middleware in front of a handler that answers 200 with a
//     -body-byte JSON body.
//
// Workloads:
//
//   - first: every operation uses a new key: claim, run, complete (two round
//     trips).
//   - replay: -keys keys are completed before the clock starts; every operation
//     then repeats one of them and gets the stored result (one round trip).
//   - mixed: like first, but a share -dup of operations (default 0.5) repeats
//     one of the -keys most recent keys, which is then in progress or
//     completed: the storm of retries a real service sees.
//   - batch: each operation is one message of a queue consumer's batch.
//     Every caller calls idem.Consume on a batch of -batch messages (default
//     100) at a time, one handler after another. Each caller owns its
//     partition of the message ids (caller i of -c has ids i, i+c, i+2c, ...)
//     and delivers them as a queue would: in each batch but its first, a
//     share -dup (default 0) of the -batch messages redelivers ids of its
//     earlier batches (drawn from the last -keys of them, from -seed), the
//     rest are new ids. A message the consumer did not acknowledge (its
//     handler failed) comes again at the head of the caller's next batch,
//     on top of its -batch messages. ops/s is then messages/s,
//     commands_per_op Redis commands per message, redis_usec_per_op Redis
//     µs per message, the latency percentiles are those of a whole batch,
//     and round_trips_per_batch says how many round trips a Consume call
//     took (two on one node: the claim and the completion; one for a batch
//     all redelivered; three when a handler of the batch failed: its
//     release too). It goes with -mode do. The run lasts -d, then each
//     side delivers what it has not had acknowledged, until nothing is
//     left; or, with -messages N, until each side has delivered its N new
//     ids, and again what it did not have acknowledged.
//
// With -prefill N, each side of -workload batch first handles N distinct
// ids ("p" and a number, apart from the stream's) by the path of its
// measured run, idem.Consume or the baseline's pipelines, in big batches
// from every core, with its progress on stderr; then the clock starts, and
// the measured stream finds N ids remembered, as a consumer that has run
// for long does. Nothing of the prefill counts in the figures but the
// memory per id, which divides by the ids prefilled and delivered.
//
// With -marker-retention D, idem's markers, its records and the baseline's
// keys are kept for D, and the memory per id is per live id: used_memory
// after the run minus before, less the connections, over the ids each side
// delivered in the last D of its run. Run for a -d of several times D, so
// that as many markers expire as arrive: the steady state of a consumer.
//
// With -rate N, the consumer of -workload batch is paced, not saturated, as
// one that keeps up with a queue at a steady rate is: messages arrive at N
// a second across the callers, each caller's at N/c a second, evenly
// spaced (and the callers' arrivals interleaved, so that all of them are
// evenly spaced at N a second), and each call (idem.Consume, or the
// baseline's pipelines) takes every message that arrived for its caller
// and was not taken, at least one (it waits for the next to arrive if none
// has), at most -batch; the messages not acknowledged before count as
// arrived, and come on top, as they do unpaced. -dup redelivers that share
// of the messages of the calls in all, carried from call to call. Both
// sides are paced alike, and messages arrive only while a side's slice
// runs: at the start of each slice each caller's arrival clock starts
// again, so that the side that waited has no backlog (what arrived at the
// end of a slice and was not taken is dropped). A run of -messages then
// goes in slices of time, as a run of -d does. The report gives each
// side's mean messages per call (messages / batches) and Redis CPU per
// second of its measured time (the INFO cpu delta over its slices' wall
// time), and warns when a side took fewer than 95% of the messages that
// arrived during its slices: it was saturated, and its figures are not
// those of a paced consumer.
//
// -side idem or -side baseline runs one side of -workload batch alone, and
// -on-measure PROG runs PROG start just before the first measured slice and
// PROG stop just after the last: bench/callgrind.sh counts one side's
// Redis instructions with them.
//
// With -fail F (0 to 0.5), a share F of the handler calls fail with an
// error that is not Final, so that idem releases the key and answers
// MessageRetry: the same calls on both sides, a hash of -seed, the id and
// the attempt (the first call of an id on that side, the second, ...)
// choosing them. The run then reports the ids each side lost (delivered,
// but whose handler never succeeded by the end of the run), which must be
// none for idem.
//
// Baselines (-baseline NAME; none without the flag):
//
//   - setnx: one SET NX of the result under a new key: the least an
//     idempotency check could do.
//   - pair: SET NX PX of a claim under a new key, then SET XX PX of the
//     result: the floor of a first execution, two round trips.
//   - get: GET of one of -keys stored -body-byte values: the floor of a
//     replay.
//   - bare (with -mode http): the same handler without the middleware, over
//     the same HTTP client.
//   - bare-get (with -mode http): a handler that GETs one of -keys stored
//     values from Redis and answers it: the floor of a replay by any
//     middleware that keeps its responses in Redis.
//
// With -workload batch, the baselines are the consumers a user writes by
// hand, in place of idem.Consume, handling the same stream (the same ids,
// redeliveries and batches, by as many callers, each on its partition) in
// slices that alternate with idem's, in a key space of their own, with the
// handler idem's side runs:
//
//   - setnx: one phase. A pipeline of SET id 1 NX EX ttl (-retention) for
//     the batch, then the handler of each message whose SET took: one round
//     trip a batch. A message whose SET did not take is acknowledged as a
//     duplicate; one whose handler failed is not acknowledged and comes
//     again, but its key already marks it handled: the id is lost.
//   - setnx2: two phases. A pipeline of SET id 1 NX PX lease (the Keeper's
//     lease, idem.DefaultLease: 30s), the handlers of the messages whose SET
//     took, then a pipeline of SET id 1 XX EX ttl for those handled: two
//     round trips a batch (one when no message is new). A failed handler
//     leaves its key to run out with the lease; its message, coming again
//     sooner (in the next batch), is acknowledged as a duplicate, and the id
//     is lost as well.
//
// A run of -messages goes in about 20 slices a side, each of the same number
// of batches per caller, idem's first, so that the i-th slice of both sides
// carries the same batches; a run of -d, in slices of time, as the other
// workloads do. The baseline's keys ("<scope>:<baseline>:k<id>", as long as
// idem's "idem:{<22 characters>}" at 6-digit ids) are deleted when the run
// ends, on one server, to measure memory (see below); idem's, and the
// baseline's on a Cluster, are left to run out after -retention.
//
// Redis CPU per operation comes from INFO commandstats, read on the server
// (on a Cluster, every master, summed) before and after each slice of the
// run: the usec of the commands the side sends, summed and divided by its
// operations. A script's usec includes the commands it calls, which
// commandstats also lists on their own; those are not counted again. Redis
// times a command from its start to its end, so on a machine whose cores
// Redis shares, the figure also holds the time Redis was preempted. The
// process CPU of the server (INFO cpu, used_cpu_user plus used_cpu_sys) is
// reported beside it: it also counts reading requests and writing replies,
// which batching makes cheaper, and the server's own background work.
// Client CPU per operation is this process's CPU time (getrusage, user plus
// system) over the side's slices: everything the process did in them, its
// garbage collection (of garbage either side made) included, and in -mode
// http the server in the process, and miniredis when it is embedded.
// Allocations per operation are the process's (runtime.MemStats.Mallocs)
// over the same slices.
//
// With -workload batch, on one server, the run also reports the Redis memory
// per id each side remembers: used_memory (INFO memory) after the run minus
// before, less the memory of the connections (CLIENT LIST tot-mem), divided
// by the ids the side delivered; and the keys its database gained
// (keys_added: one an id for a baseline; idem's as its store lays its
// records out). So that each side's keys have hash tables of their own, the
// baseline's keys live in database -baseline-db (default: idem's database
// plus one); after the run they are deleted, and once Redis has freed that
// database's tables, what remains is idem's. memory_method says so, and
// says when a database held other keys before the run (the keys of an
// earlier run, say), whose hash tables the side's keys then share: measure
// on a server of its own for figures worth quoting. On a Cluster the
// figures are summed over the masters, and both sides' keys share each
// master's database 0 (Redis shrinks its tables once the baseline's keys
// are deleted). Not measured on miniredis.
//
// The text output gives each side's ops/s, latency percentiles and costs per
// operation, and the ratios between idem and the baseline (idem's figure
// over the baseline's). -json prints one object instead (see Result):
// ops_per_sec, p50_us, p95_us, p99_us, commands_per_op, redis_usec_per_op,
// redis_cpu_usec_per_op, client_cpu_usec_per_op, allocs_per_op,
// duplicates, and with -baseline the baseline's name (baseline), its
// baseline_ops_per_sec, baseline_redis_usec_per_op,
// baseline_client_cpu_usec_per_op, baseline_allocs_per_op, ..., ratio,
// idem's ops/s over the baseline's, and ratios, idem's figure over the
// baseline's for each figure both measured. With -workload batch it also
// carries batches, round_trips_per_batch, messages, fail, seed, ids,
// lost_ids, handler_failures, redelivered, used_memory_per_id,
// used_memory_bytes, keys_added and memory_method, with -rate rate,
// messages_per_batch, redis_cpu_usec_per_sec, arrived, taken and
// fell_behind, and with a baseline the same prefixed with baseline_
// (baseline_lost_ids, baseline_duplicates, baseline_round_trips_per_batch,
// baseline_used_memory_per_id, baseline_fell_behind, ...). With
// -cache N the Keeper keeps N completed results in the process
// (idem.WithReplayCache), and cache_hits and cache_hit_rate (hits over the
// calls that looked in the cache) say how many operations it answered
// without Redis.
//
// The tool counts, in the process, how often each key's operation ran. A key
// that ran twice on idem's side is a duplicate execution, and the tool exits
// with status 1; a baseline's duplicates are reported (baseline_duplicates).
// So does an id that idem's side of -workload batch lost, unless the run was
// interrupted; a baseline's lost ids are reported (baseline_lost_ids).
// It also exits with status 1 when an operation failed (the errors are
// printed), and with status 2 on bad flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"strconv"
	"time"

	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
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
		fmt.Fprintln(stderr, "idembench:", err)
		return 2
	}
	res, err := bench(ctx, o, stdout, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "idembench:", err)
		return 1
	}
	if o.json {
		printJSON(stdout, res)
	} else {
		printText(stdout, res)
	}
	return verdict(res, ctx.Err() != nil, stderr)
}

// verdict prints the errors a run met and what failed, if anything, and
// returns the exit status. An interrupted run may leave ids not handled.
func verdict(res *Result, interrupted bool, stderr io.Writer) int {
	for _, s := range res.errorSamples {
		fmt.Fprintln(stderr, "idembench: error:", s)
	}
	switch {
	case res.Duplicates > 0:
		fmt.Fprintf(stderr, "idembench: FAIL: %d operations ran more than once\n", res.Duplicates)
		return 1
	case res.LostIDs > 0 && !interrupted:
		fmt.Fprintf(stderr, "idembench: FAIL: %d message ids delivered to idem.Consume were never handled\n", res.LostIDs)
		return 1
	case res.Errors > 0:
		fmt.Fprintf(stderr, "idembench: FAIL: %d operations failed\n", res.Errors)
		return 1
	case res.Ops == 0 && (res.Side != sideBaseline || res.BaselineOps == 0):
		fmt.Fprintln(stderr, "idembench: FAIL: no operation completed")
		return 1
	}
	return 0
}

// The modes.
const (
	modeDo   = "do"
	modeHTTP = "http"
)

// The baselines.
const (
	baselineSetNX = "setnx"
	baselinePair  = "pair"
	baselineGet   = "get"
	baselineBare  = "bare"
	// baselineBareGet is -mode http's replay floor: the handler GETs a
	// stored value from Redis and answers it.
	baselineBareGet = "bare-get"
	// baselineSetNX2 is -workload batch's two-phase consumer written by
	// hand; baselineSetNX names its one-phase consumer there.
	baselineSetNX2 = "setnx2"
)

// options are the command's flags.
type options struct {
	redisURL     string
	cluster      string
	mode         string
	concurrency  int
	duration     time.Duration
	keys         int
	dup          float64
	body         int
	workload     string
	batch        int
	autopipeline bool
	apBatches    int
	apDelay      time.Duration
	coalesce     bool
	cache        int
	baseline     string
	baselineAP   bool
	retention    time.Duration
	json         bool
	cpuprofile   string
	// messages, fail, seed and baselineDB are -workload batch's -messages,
	// -fail, -seed and -baseline-db (-1: idem's database plus one).
	messages   int64
	fail       float64
	seed       uint64
	baselineDB int
	// markers is -markers.
	markers bool
	// prefill is -prefill; markerRetention -marker-retention, 0 without
	// it.
	prefill         int64
	markerRetention time.Duration
	// scopeShards is -scope-shards: idem.WithScopeShards, given when the
	// flag is (set["scope-shards"]); scopePerCaller is -scope-per-caller.
	scopeShards    int
	scopePerCaller bool
	// rate is -rate: messages a second across all callers, 0 for a run
	// not paced.
	rate float64
	// side is -side: "" for both sides, or sideIdem or sideBaseline;
	// onMeasure is -on-measure.
	side      string
	onMeasure string
	// run names the run (newRunTag), once it starts.
	run string
	// set holds the names of the flags given.
	set map[string]bool
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	var dup share
	fs := o.flagSet(&dup, stderr)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	o.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = true })
	if err := o.check(dup); err != nil {
		return nil, err
	}
	return o, nil
}

// flagSet defines the flags, into o and dup.
func (o *options) flagSet(dup *share, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("idembench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.redisURL, "redis", "", "Redis URL, such as redis://127.0.0.1:6379/0 (default: an embedded miniredis, whose Lua is several times slower than Redis's: use a real server for figures worth quoting)")
	fs.StringVar(&o.cluster, "cluster", "", "Redis Cluster seed nodes, host:port,host:port,... (instead of -redis)")
	fs.StringVar(&o.mode, "mode", modeDo, "do: each operation is an idem.Do call; http: each operation is a POST over loopback HTTP to idemhttp's middleware, in front of a handler in the process")
	fs.IntVar(&o.concurrency, "c", 64, "concurrent callers (goroutines; in -mode http, HTTP clients sharing one keep-alive transport)")
	fs.DurationVar(&o.duration, "d", 10*time.Second, "how long to measure idem (with -baseline the baseline gets as long again, interleaved)")
	fs.IntVar(&o.keys, "keys", 10000, "key space: the keys completed before a replay run, or the recent keys that -dup repeats, or the values the get baseline reads")
	fs.Var(dup, "dup", "share of operations, 0 to 1, that repeat a key instead of using a new one (default: 0 for first, 1 for replay, 0.5 for mixed, 0 for batch, where it is the share of each batch that redelivers keys handled before)")
	fs.IntVar(&o.body, "body", 200, "size in bytes of each operation's result (in -mode http, of the handler's JSON body)")
	fs.StringVar(&o.workload, "workload", "first", "first, replay, mixed or batch")
	fs.IntVar(&o.batch, "batch", 0, fmt.Sprintf("with -workload batch: messages per idem.Consume call (default %d)", defaultBatch))
	fs.BoolVar(&o.autopipeline, "autopipeline", false, "send idem's commands through go-redis's AutoPipeliner, which batches concurrent commands into pipelines")
	fs.IntVar(&o.apBatches, "ap-batches", 2, "with -autopipeline: how many batches may be in flight at once (AutoPipelineOptions.MaxConcurrentBatches; above 1 the batches are unordered, which idem does not mind; go-redis's default is 1)")
	fs.DurationVar(&o.apDelay, "ap-delay", 200*time.Microsecond, "with -autopipeline: how long a batch may wait for more commands (AutoPipelineOptions.MaxFlushDelay; go-redis's default is 0)")
	fs.BoolVar(&o.coalesce, "coalesce", true, "coalesce concurrent calls on one key in the process (idem.WithCoalescing)")
	fs.IntVar(&o.cache, "cache", 0, "keep up to this many completed results in the process (idem.WithReplayCache, with room for that many -body-byte results and -retention as the max age) and report its hit rate; 0: no cache")
	fs.StringVar(&o.baseline, "baseline", "", "also run, at the same concurrency and interleaved with idem, and print the ratio: setnx (SET NX of the result under a new key), pair (SET NX PX, then SET XX PX of the result: the floor of a first execution), get (GET of a stored value: the floor of a replay); with -mode http, bare (the same handler without the middleware) or bare-get (a handler that answers a value it GETs from Redis: the floor of a replay kept in Redis); with -workload batch, the consumers written by hand: setnx (one phase: pipelined SET id 1 NX EX ttl, then the handler of each new message) or setnx2 (two phases: pipelined SET id 1 NX PX lease, the handlers, pipelined SET id 1 XX EX ttl)")
	fs.BoolVar(&o.baselineAP, "baseline-autopipeline", false, "with -autopipeline and a Redis baseline: send the baseline's commands through an AutoPipeliner of the same settings (default: a plain client)")
	fs.DurationVar(&o.retention, "retention", 10*time.Minute, "how long Redis keeps the records (and baseline keys) the run writes")
	fs.BoolVar(&o.json, "json", false, "print one JSON object instead of text")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile of the measured run (idem and baseline) to this file")
	fs.Int64Var(&o.messages, "messages", 0, "with -workload batch: end the run when each side has delivered this many new message ids (and what it did not acknowledge, again), in slices of a number of batches, instead of after -d")
	fs.Float64Var(&o.fail, "fail", 0, "with -workload batch: share of handler calls, 0 to 0.5, that fail transiently (the same calls on both sides: a hash of -seed, the id and the attempt picks them); a message not acknowledged comes again in its caller's next batch")
	fs.Uint64Var(&o.seed, "seed", 1, "with -workload batch: the seed of the stream's redeliveries and of -fail's choice")
	fs.Float64Var(&o.rate, "rate", 0, "with -workload batch: pace the consumer, so that it is not saturated: messages arrive at this many a second across all callers (each caller's at -rate/-c a second, evenly spaced, and only while its side's slice runs), and each call takes every message that arrived for it and was not taken (a message not acknowledged counts as arrived), at least one, waiting for it, at most -batch; the report gives the mean messages per call and Redis CPU per second, and warns when a side fell behind the rate. 0 (the default): not paced, each call takes -batch messages at once, as fast as it can")
	fs.BoolVar(&o.markers, "markers", true, "with -workload batch: keep each handled message as a compact marker (false: idem.WithoutMarkers, a record a message)")
	fs.Int64Var(&o.prefill, "prefill", 0, fmt.Sprintf("with -workload batch: before the clock starts, handle this many distinct ids (not measured) on each side, by the path of the measured run (idem.Consume; the baseline's pipelines), in batches of -batch or %d if larger, from -c callers or twice the cores if more, with progress on stderr; the measured stream then finds them remembered, as a consumer that has run for long does. Its ids are counted among the ids remembered in the memory per id, and in no other figure", prefillMinBatch))
	fs.DurationVar(&o.markerRetention, "marker-retention", 0, "with -workload batch: the steady state of memory. idem's markers are kept this long (idem.WithMarkerRetention; at least the lease, 30s), and so are its records and the baseline's keys (-retention is set to it); run for -d of several times as long, so that as many markers expire as arrive. The memory per id is then per live id: used_memory after the run minus before, less the connections, over the ids the side delivered in the last marker retention before its last slice ended (the markers, or baseline keys, still live; those that expired and were not yet swept or evicted count in the bytes, not in the ids). The report says when the run lasted less than twice the marker retention, which is not yet steady")
	fs.IntVar(&o.scopeShards, "scope-shards", 0, "idem.WithScopeShards: the run's scope in this many shards, each one Cluster slot, so that a batch costs a few script calls; 0: keys placed by their own digests (default: the Keeper's, idem.ClusterScopeShards with -cluster, 0 otherwise)")
	fs.BoolVar(&o.scopePerCaller, "scope-per-caller", false, "with -workload batch: each caller consumes its messages in a scope of its own (the run's scope, \"/\" and the caller's number), as consumers of a partition each do; default: one scope shared by every caller")
	fs.StringVar(&o.side, "side", "", "with -workload batch and -baseline: run only this side, idem or baseline (default: both, interleaved), after the prefill of that side alone; for counting one side's Redis instructions (bench/callgrind.sh)")
	fs.StringVar(&o.onMeasure, "on-measure", "", "a program to run, and wait for, with the argument start just before the first measured slice (after -prefill) and stop just after the last (before the memory is read): bench/callgrind.sh turns valgrind's instrumentation on and off with it")
	fs.IntVar(&o.baselineDB, "baseline-db", -1, "with -workload batch, a baseline and -redis: the database of the baseline's keys, so that each side's used_memory can be told apart (default: idem's database plus one)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: idembench [flags]\n\nPuts idem under load and reports ops/s, latency, Redis commands and Redis CPU per operation and duplicate executions.\nWithout -redis or -cluster it uses an embedded miniredis: a real server is the honest choice.\n\n")
		fs.PrintDefaults()
	}
	return fs
}

// check checks the flags and fills in the defaults that depend on others.
func (o *options) check(dup share) error {
	o.dup = -1
	if dup.set {
		if dup.v < 0 || dup.v > 1 {
			return fmt.Errorf("-dup %v: want a share from 0 to 1", dup.v)
		}
		o.dup = dup.v
	}
	switch o.workload {
	case "first":
		o.dup = defaultTo(o.dup, 0)
	case "replay":
		o.dup = defaultTo(o.dup, 1)
	case "mixed":
		o.dup = defaultTo(o.dup, 0.5)
	case workloadBatch:
		o.dup = defaultTo(o.dup, 0)
	default:
		return fmt.Errorf("-workload %q: want first, replay, mixed or batch", o.workload)
	}
	if err := checkBatch(o); err != nil {
		return err
	}
	if err := checkModeAndBaseline(o); err != nil {
		return err
	}
	switch {
	case o.dup < 0 || o.dup > 1:
		return fmt.Errorf("-dup %v: want a share from 0 to 1", o.dup)
	case o.concurrency < 1:
		return fmt.Errorf("-c %d: want at least 1", o.concurrency)
	case o.cache < 0:
		return fmt.Errorf("-cache %d: want 0 (no cache) or more", o.cache)
	case o.duration <= 0:
		return fmt.Errorf("-d %s: want a positive duration", o.duration)
	case o.keys < 1:
		return fmt.Errorf("-keys %d: want at least 1", o.keys)
	case o.body < 0:
		return fmt.Errorf("-body %d: want 0 or more", o.body)
	case o.redisURL != "" && o.cluster != "":
		return errors.New("-redis and -cluster: choose one")
	case o.apBatches < 1:
		return fmt.Errorf("-ap-batches %d: want at least 1", o.apBatches)
	case o.apDelay < 0:
		return fmt.Errorf("-ap-delay %s: want 0 or more", o.apDelay)
	case o.retention < idem.DefaultLease:
		return fmt.Errorf("-retention %s: want at least the lease, %s", o.retention, idem.DefaultLease)
	}
	return nil
}

// workloadBatch is the workload of messages handled in batches by
// idem.Consume.
const workloadBatch = "batch"

// batchFlags are the flags that go with -workload batch only.
var batchFlags = []string{"batch", "messages", "fail", "seed", "baseline-db", "markers", "prefill", "marker-retention", "side", "rate"}

// checkBatch checks -batch, and what goes with -workload batch, and fills in
// its defaults.
func checkBatch(o *options) error {
	if o.workload != workloadBatch {
		for _, name := range batchFlags {
			if o.set[name] {
				return fmt.Errorf("-%s: goes with -workload batch", name)
			}
		}
		return nil
	}
	switch {
	case o.batch < 0 || o.set["batch"] && o.batch == 0:
		return fmt.Errorf("-batch %d: want at least 1", o.batch)
	case o.mode != modeDo:
		return fmt.Errorf("-workload batch: goes with -mode do, not %s", o.mode)
	case o.baseline != "" && o.baseline != baselineSetNX && o.baseline != baselineSetNX2:
		return fmt.Errorf("-baseline %q: -workload batch compares with setnx (one phase) or setnx2 (two phases), the consumers written by hand", o.baseline)
	case o.baselineAP:
		return errors.New("-baseline-autopipeline: the baselines of -workload batch pipeline their batches themselves")
	case o.messages < 0 || o.set["messages"] && o.messages == 0:
		return fmt.Errorf("-messages %d: want at least 1", o.messages)
	case o.messages > 0 && o.set["d"]:
		return errors.New("-messages and -d: choose one (a run of -messages ends when its ids are delivered)")
	case o.messages >= 1<<32:
		return fmt.Errorf("-messages %d: want fewer than 2^32", o.messages)
	case o.fail < 0 || o.fail > maxFail:
		return fmt.Errorf("-fail %v: want a share from 0 to %v", o.fail, maxFail)
	case o.set["baseline-db"] && (o.baseline == "" || o.redisURL == ""):
		return errors.New("-baseline-db: goes with -baseline and -redis (a Cluster has one database)")
	case o.set["baseline-db"] && o.baselineDB < 0:
		return fmt.Errorf("-baseline-db %d: want 0 or more", o.baselineDB)
	case o.scopeShards < 0 || o.scopeShards > 256:
		return fmt.Errorf("-scope-shards %d: want 0 to 256", o.scopeShards)
	case o.prefill < 0 || o.prefill >= 1<<40:
		return fmt.Errorf("-prefill %d: want 0 to 2^40", o.prefill)
	case o.side != "" && o.side != sideIdem && o.side != sideBaseline:
		return fmt.Errorf("-side %q: want idem or baseline", o.side)
	case o.side != "" && o.baseline == "":
		return errors.New("-side: goes with -baseline (without it, only idem's side runs)")
	case !(o.rate >= 0) || math.IsInf(o.rate, 0):
		return fmt.Errorf("-rate %v: want messages a second, 0 (not paced) or more", o.rate)
	}
	if err := checkMarkerRetention(o); err != nil {
		return err
	}
	if o.set["baseline-db"] {
		opt, err := redis.ParseURL(o.redisURL)
		if err != nil {
			return fmt.Errorf("-redis: %w", err)
		}
		if opt.DB == o.baselineDB {
			return fmt.Errorf("-baseline-db %d: idem's database; the baseline needs one of its own", o.baselineDB)
		}
	}
	if o.batch == 0 {
		o.batch = defaultBatch
	}
	if o.messages > 0 && redelivered(o) >= o.batch {
		return fmt.Errorf("-dup %v with -batch %d and -messages: no batch but the first would carry a new id", o.dup, o.batch)
	}
	return nil
}

// checkMarkerRetention checks -marker-retention, and sets -retention to
// it.
func checkMarkerRetention(o *options) error {
	if !o.set["marker-retention"] {
		return nil
	}
	switch {
	case o.markerRetention < idem.DefaultLease || o.markerRetention > idem.MaxDuration:
		return fmt.Errorf("-marker-retention %s: want from the lease, %s, to %s", o.markerRetention, idem.DefaultLease, idem.MaxDuration)
	case !o.markers:
		return errors.New("-marker-retention: goes with markers on (-markers)")
	case o.set["retention"] && o.retention != o.markerRetention:
		return errors.New("-retention and -marker-retention: in the steady state both sides keep what they handle for the marker retention; leave -retention out")
	case o.prefill > 0:
		return errors.New("-prefill and -marker-retention: choose one (the prefill's ids would expire during the run)")
	}
	o.retention = o.markerRetention
	return nil
}

// The sides -side names.
const (
	sideIdem     = "idem"
	sideBaseline = "baseline"
)

// maxFail is the largest share -fail takes: a message is delivered until its
// handler succeeds, on average 1/(1-fail) times.
const maxFail = 0.5

// checkModeAndBaseline checks -mode, -baseline and -baseline-autopipeline,
// which depend on each other.
func checkModeAndBaseline(o *options) error {
	switch o.mode {
	case modeDo:
		switch o.baseline {
		case "", baselineSetNX, baselinePair, baselineGet:
		case baselineSetNX2:
			if o.workload != workloadBatch {
				return fmt.Errorf("-baseline %s: the two-phase consumer; it goes with -workload batch", o.baseline)
			}
		case baselineBare, baselineBareGet:
			return fmt.Errorf("-baseline %s: an HTTP handler without the middleware; it goes with -mode http", o.baseline)
		default:
			return fmt.Errorf("-baseline %q: want setnx, pair or get (the former -baseline, with no name, is -baseline setnx)", o.baseline)
		}
	case modeHTTP:
		switch o.baseline {
		case "", baselineBare, baselineBareGet:
		default:
			return fmt.Errorf("-baseline %q: -mode http compares with bare, the same handler without the middleware, or bare-get, that handler answering a value it GETs from Redis", o.baseline)
		}
	default:
		return fmt.Errorf("-mode %q: want do or http", o.mode)
	}
	if o.baselineAP && (!o.autopipeline || o.baseline == "" || o.baseline == baselineBare || o.baseline == baselineBareGet) {
		return errors.New("-baseline-autopipeline: goes with -autopipeline and -baseline setnx, pair or get")
	}
	return nil
}

// share is a flag holding a number, and whether it was given.
type share struct {
	v   float64
	set bool
}

func (s *share) String() string {
	if s == nil || !s.set {
		return ""
	}
	return strconv.FormatFloat(s.v, 'g', -1, 64)
}

func (s *share) Set(v string) error {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil {
		return err
	}
	s.v, s.set = f, true
	return nil
}

func defaultTo(v, def float64) float64 {
	if v < 0 {
		return def
	}
	return v
}
