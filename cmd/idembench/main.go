// Command idembench puts idem under load against a Redis and reports what it
// costs: operations per second, latency percentiles, Redis commands per
// operation, and how many operations ran more than once (which must be none).
// With -baseline it also runs plain go-redis SETNX at the same concurrency,
// interleaved with the idem run, and prints the ratio between the two, so
// that a figure always comes with the speed of the same Redis, client and
// machine doing the least an idempotency check could do.
//
// Usage:
//
//	idembench [flags]
//
// Without -redis or -cluster it starts an embedded miniredis, which runs Lua
// in a Go interpreter several times slower than Redis: fine to try the tool,
// not to judge idem. Point it at a real server for figures:
//
//	idembench -redis redis://127.0.0.1:6379 -autopipeline -c 256 -d 20s -workload first -baseline
//
// With -autopipeline, idem's commands go through go-redis's AutoPipeliner,
// with two batches in flight and a 200µs flush delay unless -ap-batches and
// -ap-delay say otherwise: on a small machine whose cores the client and the
// server share, that lets one batch run in Redis while the client prepares
// the next, where go-redis's defaults (one batch, no delay) leave them taking
// turns.
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
//
// The tool counts, in the process, how often each key's operation ran. A key
// that ran twice is a duplicate execution, and the tool exits with status 1.
// It also exits with status 1 when an operation failed (the errors are
// printed), and with status 2 on bad flags.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/bits"
	"math/rand/v2"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// options are the command's flags.
type options struct {
	redisURL     string
	cluster      string
	concurrency  int
	duration     time.Duration
	keys         int
	dup          float64
	body         int
	workload     string
	autopipeline bool
	apBatches    int
	apDelay      time.Duration
	coalesce     bool
	baseline     bool
	retention    time.Duration
	json         bool
	cpuprofile   string
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("idembench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.redisURL, "redis", "", "Redis URL, such as redis://127.0.0.1:6379/0 (default: an embedded miniredis, whose Lua is several times slower than Redis's: use a real server for figures worth quoting)")
	fs.StringVar(&o.cluster, "cluster", "", "Redis Cluster seed nodes, host:port,host:port,... (instead of -redis)")
	fs.IntVar(&o.concurrency, "c", 64, "concurrent callers (goroutines)")
	fs.DurationVar(&o.duration, "d", 10*time.Second, "how long to measure idem (with -baseline the baseline gets as long again, interleaved)")
	fs.IntVar(&o.keys, "keys", 10000, "key space: the keys completed before a replay run, or the recent keys that -dup repeats")
	var dup share
	fs.Var(&dup, "dup", "share of operations, 0 to 1, that repeat a key instead of using a new one (default: 0 for first, 1 for replay, 0.5 for mixed)")
	fs.IntVar(&o.body, "body", 200, "size in bytes of each operation's result")
	fs.StringVar(&o.workload, "workload", "first", "first, replay or mixed")
	fs.BoolVar(&o.autopipeline, "autopipeline", false, "send idem's commands through go-redis's AutoPipeliner, which batches concurrent commands into pipelines")
	fs.IntVar(&o.apBatches, "ap-batches", 2, "with -autopipeline: how many batches may be in flight at once (AutoPipelineOptions.MaxConcurrentBatches; above 1 the batches are unordered, which idem does not mind; go-redis's default is 1)")
	fs.DurationVar(&o.apDelay, "ap-delay", 200*time.Microsecond, "with -autopipeline: how long a batch may wait for more commands (AutoPipelineOptions.MaxFlushDelay; go-redis's default is 0)")
	fs.BoolVar(&o.coalesce, "coalesce", true, "coalesce concurrent calls on one key in the process (idem.WithCoalescing)")
	fs.BoolVar(&o.baseline, "baseline", false, "also run plain go-redis SETNX at the same concurrency on a plain client, interleaved with the idem run, and print the ratio")
	fs.DurationVar(&o.retention, "retention", 10*time.Minute, "how long Redis keeps the records (and baseline keys) the run writes")
	fs.BoolVar(&o.json, "json", false, "print one JSON object instead of text")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile of the measured run (idem and baseline) to this file")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: idembench [flags]\n\nPuts idem under load and reports ops/s, latency, Redis commands per operation and duplicate executions.\nWithout -redis or -cluster it uses an embedded miniredis: a real server is the honest choice.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	o.dup = -1
	if dup.set {
		if dup.v < 0 || dup.v > 1 {
			return nil, fmt.Errorf("-dup %v: want a share from 0 to 1", dup.v)
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
	default:
		return nil, fmt.Errorf("-workload %q: want first, replay or mixed", o.workload)
	}
	switch {
	case o.dup < 0 || o.dup > 1:
		return nil, fmt.Errorf("-dup %v: want a share from 0 to 1", o.dup)
	case o.concurrency < 1:
		return nil, fmt.Errorf("-c %d: want at least 1", o.concurrency)
	case o.duration <= 0:
		return nil, fmt.Errorf("-d %s: want a positive duration", o.duration)
	case o.keys < 1:
		return nil, fmt.Errorf("-keys %d: want at least 1", o.keys)
	case o.body < 0:
		return nil, fmt.Errorf("-body %d: want 0 or more", o.body)
	case o.redisURL != "" && o.cluster != "":
		return nil, errors.New("-redis and -cluster: choose one")
	case o.apBatches < 1:
		return nil, fmt.Errorf("-ap-batches %d: want at least 1", o.apBatches)
	case o.apDelay < 0:
		return nil, fmt.Errorf("-ap-delay %s: want 0 or more", o.apDelay)
	case o.retention < idem.DefaultLease:
		return nil, fmt.Errorf("-retention %s: want at least the lease, %s", o.retention, idem.DefaultLease)
	}
	return o, nil
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

// Result is what a run measured; it is also the JSON the tool prints.
type Result struct {
	Workload     string  `json:"workload"`
	Server       string  `json:"server"`
	Concurrency  int     `json:"concurrency"`
	DurationSec  float64 `json:"duration_s"`
	Body         int     `json:"body_bytes"`
	Dup          float64 `json:"dup"`
	Autopipeline bool    `json:"autopipeline"`
	APBatches    int     `json:"autopipeline_batches,omitempty"`
	APDelayUs    float64 `json:"autopipeline_delay_us,omitempty"`
	Coalesce     bool    `json:"coalesce"`

	Ops           int64   `json:"ops"`
	OpsPerSec     float64 `json:"ops_per_sec"`
	P50us         float64 `json:"p50_us"`
	P95us         float64 `json:"p95_us"`
	P99us         float64 `json:"p99_us"`
	CommandsPerOp float64 `json:"commands_per_op"`
	// RoundTripsPerOp counts a pipeline as one round trip, however many
	// operations' commands it carried.
	RoundTripsPerOp float64 `json:"round_trips_per_op"`
	Executions      int64   `json:"executions"`
	Replays         int64   `json:"replays"`
	InProgress      int64   `json:"in_progress"`
	Errors          int64   `json:"errors"`
	Duplicates      int64   `json:"duplicates"`

	// The baseline's figures, and Ratio, are 0 without -baseline.
	BaselineOps       int64   `json:"baseline_ops"`
	BaselineOpsPerSec float64 `json:"baseline_ops_per_sec"`
	BaselineP50us     float64 `json:"baseline_p50_us"`
	BaselineP99us     float64 `json:"baseline_p99_us"`
	Ratio             float64 `json:"ratio"`

	errorSamples []string
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
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(res)
	} else {
		printText(stdout, res)
	}
	for _, s := range res.errorSamples {
		fmt.Fprintln(stderr, "idembench: error:", s)
	}
	switch {
	case res.Duplicates > 0:
		fmt.Fprintf(stderr, "idembench: FAIL: %d operations ran more than once\n", res.Duplicates)
		return 1
	case res.Errors > 0:
		fmt.Fprintf(stderr, "idembench: FAIL: %d operations failed\n", res.Errors)
		return 1
	case res.Ops == 0:
		fmt.Fprintln(stderr, "idembench: FAIL: no operation completed")
		return 1
	}
	return 0
}

// client is what the tool needs of a go-redis client: a *redis.Client or a
// *redis.ClusterClient.
type client = redis.UniversalClient

// connect returns two clients of the same server, made alike: one for idem
// and one for the baseline, and a function that closes everything.
func connect(o *options, stderr io.Writer) (idemClient, baseClient client, server string, closeAll func(), err error) {
	var mini *miniredis.Miniredis
	mk := func() (client, error) {
		switch {
		case o.cluster != "":
			return redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(o.cluster, ",")}), nil
		case o.redisURL != "":
			opt, err := redis.ParseURL(o.redisURL)
			if err != nil {
				return nil, fmt.Errorf("-redis: %w", err)
			}
			return redis.NewClient(opt), nil
		default:
			return redis.NewClient(&redis.Options{Addr: mini.Addr()}), nil
		}
	}
	if o.redisURL == "" && o.cluster == "" {
		mini, err = miniredis.Run()
		if err != nil {
			return nil, nil, "", nil, fmt.Errorf("starting miniredis: %w", err)
		}
		fmt.Fprintln(stderr, "idembench: no -redis given: using an embedded miniredis, whose Lua is several times slower than Redis; pass -redis redis://host:port for figures worth quoting")
		server = "miniredis (embedded)"
	}
	if idemClient, err = mk(); err == nil {
		baseClient, err = mk()
	}
	closeAll = func() {
		if idemClient != nil {
			idemClient.Close()
		}
		if baseClient != nil {
			baseClient.Close()
		}
		if mini != nil {
			mini.Close()
		}
	}
	if err != nil {
		closeAll()
		return nil, nil, "", nil, err
	}
	return idemClient, baseClient, server, closeAll, nil
}

// serverName asks the server for its version.
func serverName(ctx context.Context, c client) string {
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		return "unknown"
	}
	name, version := "redis", ""
	for _, line := range strings.Split(info, "\n") {
		line = strings.TrimSpace(line)
		if v, ok := strings.CutPrefix(line, "redis_version:"); ok {
			version = v
		}
		if v, ok := strings.CutPrefix(line, "redis_mode:"); ok && v == "cluster" {
			name = "redis cluster"
		}
	}
	if version == "" {
		return name
	}
	return name + " " + version
}

// counter is a go-redis hook that counts the commands and round trips a
// client sends, a pipeline being one round trip. The handshake of a new
// connection (HELLO, CLIENT SETINFO) is not counted.
type counter struct {
	on         atomic.Bool
	commands   atomic.Int64
	roundTrips atomic.Int64
}

func (c *counter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if c.on.Load() && !handshake(cmd) {
			c.commands.Add(1)
			c.roundTrips.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (c *counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if c.on.Load() && len(cmds) > 0 && !handshake(cmds[0]) {
			c.commands.Add(int64(len(cmds)))
			c.roundTrips.Add(1)
		}
		return next(ctx, cmds)
	}
}

func handshake(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "client", "auth", "select":
		return true
	}
	return false
}

func bench(ctx context.Context, o *options, stdout, stderr io.Writer) (*Result, error) {
	idemClient, baseClient, server, closeAll, err := connect(o, stderr)
	if err != nil {
		return nil, err
	}
	defer closeAll()
	if err := idemClient.Ping(ctx).Err(); err != nil {
		return nil, fmt.Errorf("reaching Redis: %w", err)
	}
	if server == "" {
		server = serverName(ctx, idemClient)
	}
	cnt := &counter{}
	idemClient.AddHook(cnt)
	var scripter redis.Scripter = idemClient
	if o.autopipeline {
		apo := redis.DefaultBlockingAutoPipelineOptions()
		apo.MaxConcurrentBatches = o.apBatches
		apo.Unordered = o.apBatches > 1
		apo.MaxFlushDelay = o.apDelay
		ap, err := idemClient.AutoPipelineWithOptions(apo)
		if err != nil {
			return nil, fmt.Errorf("autopipeline: %w", err)
		}
		defer ap.Close()
		scripter = ap
	}
	store, err := idem.NewRedisStore(scripter)
	if err != nil {
		return nil, err
	}
	if err := store.LoadScripts(ctx); err != nil {
		return nil, err
	}
	k, err := idem.New(store, idem.WithRetention(o.retention), idem.WithCoalescing(o.coalesce))
	if err != nil {
		return nil, err
	}

	var runID [4]byte
	for i := range runID {
		runID[i] = "abcdefghijklmnopqrstuvwxyz"[rand.IntN(26)]
	}
	w := &workload{
		o:     o,
		k:     k,
		scope: "idembench-" + string(runID[:]),
		base:  baseClient,
		body:  make([]byte, o.body),
		ran:   newBitset(),
	}
	for i := range w.body {
		w.body[i] = 'a' + byte(i%26)
	}
	if o.workload == "replay" {
		if !o.json {
			fmt.Fprintf(stdout, "completing %d keys for the replay run...\n", o.keys)
		}
		if err := w.seed(ctx); err != nil {
			return nil, err
		}
	}

	res := &Result{
		Workload: o.workload, Server: server, Concurrency: o.concurrency, Body: o.body,
		Dup: o.dup, Autopipeline: o.autopipeline, Coalesce: o.coalesce,
	}
	if o.autopipeline {
		res.APBatches, res.APDelayUs = o.apBatches, float64(o.apDelay)/float64(time.Microsecond)
	}
	if !o.json {
		mode := "plain client"
		if o.autopipeline {
			mode = fmt.Sprintf("autopipeline (%d batches in flight, %s flush delay)", o.apBatches, o.apDelay)
		}
		fmt.Fprintf(stdout, "idembench: %s, workload %s, %d callers, %s, %d-byte results, dup %.2f, %s, coalescing %v\n",
			server, o.workload, o.concurrency, o.duration, o.body, o.dup, mode, o.coalesce)
	}

	// The run: slices of idem, and of the baseline if asked, in turn, so
	// that both see the same machine.
	slice := o.duration
	if o.baseline {
		slice = min(time.Second, max(o.duration/4, 100*time.Millisecond))
	}
	var progress *progressLine
	if !o.json && o.duration > 3*time.Second && isTerminal(stdout) {
		progress = &progressLine{w: stdout, total: o.duration}
	}
	idemStats, baseStats := newStats(), newStats()
	if o.cpuprofile != "" {
		f, err := os.Create(o.cpuprofile)
		if err != nil {
			return nil, fmt.Errorf("-cpuprofile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return nil, fmt.Errorf("-cpuprofile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	for done := time.Duration(0); done < o.duration && ctx.Err() == nil; {
		d := min(slice, o.duration-done)
		cnt.on.Store(true)
		runSlice(ctx, w, d, idemStats, w.idemOp, progress)
		progress.show(idemStats.elapsed, idemStats.ops(), idemStats.ops(), idemStats.elapsed)
		cnt.on.Store(false)
		if o.baseline {
			runSlice(ctx, w, d, baseStats, w.baselineOp, nil)
		}
		done += d
	}
	progress.clear()

	res.Ops = idemStats.ops()
	res.DurationSec = idemStats.elapsed.Seconds()
	res.OpsPerSec = rate(res.Ops, idemStats.elapsed)
	res.P50us, res.P95us, res.P99us = idemStats.hist.quantile(0.50), idemStats.hist.quantile(0.95), idemStats.hist.quantile(0.99)
	if res.Ops > 0 {
		res.CommandsPerOp = float64(cnt.commands.Load()) / float64(res.Ops)
		res.RoundTripsPerOp = float64(cnt.roundTrips.Load()) / float64(res.Ops)
	}
	res.Executions = idemStats.executed.Load()
	res.Replays = idemStats.replayed.Load()
	res.InProgress = idemStats.inProgress.Load()
	res.Errors = idemStats.errors.Load() + baseStats.errors.Load()
	res.Duplicates = w.ran.duplicates.Load()
	res.errorSamples = append(idemStats.samples(), baseStats.samples()...)
	if o.baseline {
		res.BaselineOps = baseStats.ops()
		res.BaselineOpsPerSec = rate(res.BaselineOps, baseStats.elapsed)
		res.BaselineP50us, res.BaselineP99us = baseStats.hist.quantile(0.50), baseStats.hist.quantile(0.99)
		if res.BaselineOpsPerSec > 0 {
			res.Ratio = res.OpsPerSec / res.BaselineOpsPerSec
		}
	}
	return res, nil
}

func rate(n int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

func printText(w io.Writer, r *Result) {
	fmt.Fprintf(w, "idem      %10.0f ops/s   p50 %s  p95 %s  p99 %s   %.2f commands/op  %.3f round trips/op\n",
		r.OpsPerSec, us(r.P50us), us(r.P95us), us(r.P99us), r.CommandsPerOp, r.RoundTripsPerOp)
	fmt.Fprintf(w, "          %d ops in %.1fs: %d executed, %d replayed, %d in progress, %d errors; duplicates executed: %d\n",
		r.Ops, r.DurationSec, r.Executions, r.Replays, r.InProgress, r.Errors, r.Duplicates)
	if r.BaselineOps > 0 {
		fmt.Fprintf(w, "baseline  %10.0f ops/s   p50 %s  p99 %s   (plain go-redis SETNX, same concurrency, interleaved)\n",
			r.BaselineOpsPerSec, us(r.BaselineP50us), us(r.BaselineP99us))
		fmt.Fprintf(w, "ratio     %10.2fx idem ops/s over SETNX ops/s\n", r.Ratio)
	}
}

func us(v float64) string {
	if v >= 10000 {
		return fmt.Sprintf("%6.1fms", v/1000)
	}
	return fmt.Sprintf("%6.0fµs", v)
}

// workload makes the operations of a run.
type workload struct {
	o     *options
	k     *idem.Keeper
	scope string
	base  client
	body  []byte
	ran   *bitset

	// fresh is the number of keys handed out; key i is "k<i>".
	fresh    atomic.Uint64
	baseKeys atomic.Uint64
}

// worker is one caller's state.
type worker struct {
	w     *workload
	rng   *rand.Rand
	stats *localStats
	buf   []byte
	// id is the key of the operation under way; ran is set by fn.
	id  uint64
	ran bool
	fn  func(ctx context.Context) ([]byte, error)
}

func (w *workload) newWorker(s *localStats) *worker {
	wk := &worker{w: w, rng: rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())), stats: s, buf: make([]byte, 0, 32)}
	wk.fn = func(ctx context.Context) ([]byte, error) {
		wk.ran = true
		w.ran.mark(wk.id)
		return w.body, nil
	}
	return wk
}

// nextID returns the key of the next operation: a repeat of a recent key
// with probability dup, else a new one.
func (wk *worker) nextID() uint64 {
	w := wk.w
	if w.o.dup > 0 && (w.o.dup >= 1 || wk.rng.Float64() < w.o.dup) {
		if n := w.fresh.Load(); n > 0 {
			span := min(n, uint64(w.o.keys))
			return n - 1 - wk.rng.Uint64N(span)
		}
	}
	return w.fresh.Add(1) - 1
}

func (wk *worker) key(id uint64) string {
	wk.buf = append(wk.buf[:0], 'k')
	wk.buf = strconv.AppendUint(wk.buf, id, 10)
	return string(wk.buf)
}

// idemOp runs one operation through idem.Do.
func (w *workload) idemOp(ctx context.Context, wk *worker) {
	wk.id, wk.ran = wk.nextID(), false
	start := time.Now()
	_, err := idem.Do(ctx, w.k, w.scope, wk.key(wk.id), wk.fn)
	lat := time.Since(start)
	switch {
	case err == nil && wk.ran:
		wk.stats.executed++
	case err == nil:
		wk.stats.replayed++
	case errors.Is(err, idem.ErrInProgress):
		wk.stats.inProgress++
	default:
		wk.stats.fail(err)
		return
	}
	wk.stats.record(lat)
}

// baselineOp is the least an idempotency check could do: one SETNX of the
// result under a new key.
func (w *workload) baselineOp(ctx context.Context, wk *worker) {
	wk.buf = append(wk.buf[:0], w.scope...)
	wk.buf = append(wk.buf, ":setnx:"...)
	wk.buf = strconv.AppendUint(wk.buf, w.baseKeys.Add(1), 10)
	start := time.Now()
	err := w.base.SetNX(ctx, string(wk.buf), w.body, w.o.retention).Err()
	lat := time.Since(start)
	if err != nil {
		wk.stats.fail(err)
		return
	}
	wk.stats.executed++
	wk.stats.record(lat)
}

// seed completes keys 0 to keys-1, for the replay workload.
func (w *workload) seed(ctx context.Context) error {
	w.fresh.Store(uint64(w.o.keys))
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, w.o.concurrency)
	for i := 0; i < w.o.concurrency; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wk := w.newWorker(&localStats{})
			for {
				id := next.Add(1) - 1
				if id >= int64(w.o.keys) || ctx.Err() != nil {
					return
				}
				wk.id = uint64(id)
				if _, err := idem.Do(ctx, w.k, w.scope, wk.key(wk.id), wk.fn); err != nil {
					errs <- fmt.Errorf("completing the keys of the replay run: %w", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return errors.Join(<-errs, ctx.Err())
}

// runSlice runs op on w's callers for d, into s.
func runSlice(ctx context.Context, w *workload, d time.Duration, s *stats, op func(context.Context, *worker), progress *progressLine) {
	var stop atomic.Bool
	var wg sync.WaitGroup
	locals := make([]*localStats, w.o.concurrency)
	start := time.Now()
	for i := range locals {
		locals[i] = &localStats{}
		wg.Add(1)
		go func(ls *localStats) {
			defer wg.Done()
			wk := w.newWorker(ls)
			for !stop.Load() {
				op(ctx, wk)
				ls.done.Add(1)
			}
		}(locals[i])
	}
	t := time.NewTimer(d)
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
loop:
	for {
		select {
		case <-t.C:
			break loop
		case <-ctx.Done():
			t.Stop()
			break loop
		case <-tick.C:
			if progress != nil {
				var n int64
				for _, ls := range locals {
					n += ls.done.Load()
				}
				progress.show(s.elapsed+time.Since(start), s.ops()+n, n, time.Since(start))
			}
		}
	}
	stop.Store(true)
	wg.Wait()
	s.elapsed += time.Since(start)
	for _, ls := range locals {
		s.merge(ls)
	}
}

// stats is what one side (idem or baseline) of a run measured.
type stats struct {
	elapsed    time.Duration
	hist       histogram
	executed   atomic.Int64
	replayed   atomic.Int64
	inProgress atomic.Int64
	errors     atomic.Int64
	errSamples map[string]int
}

func newStats() *stats { return &stats{errSamples: map[string]int{}} }

func (s *stats) ops() int64 {
	return s.executed.Load() + s.replayed.Load() + s.inProgress.Load()
}

func (s *stats) merge(ls *localStats) {
	s.hist.add(&ls.hist)
	s.executed.Add(ls.executed)
	s.replayed.Add(ls.replayed)
	s.inProgress.Add(ls.inProgress)
	s.errors.Add(ls.errors)
	for m, n := range ls.errSamples {
		if len(s.errSamples) < 5 {
			s.errSamples[m] += n
		}
	}
}

func (s *stats) samples() []string {
	var out []string
	for m, n := range s.errSamples {
		out = append(out, fmt.Sprintf("%s (%d times)", m, n))
	}
	return out
}

// localStats is one goroutine's share of a slice, merged at its end.
type localStats struct {
	hist       histogram
	done       atomic.Int64 // operations finished, for the progress line
	executed   int64
	replayed   int64
	inProgress int64
	errors     int64
	errSamples map[string]int
}

func (ls *localStats) record(d time.Duration) { ls.hist.record(d) }

func (ls *localStats) fail(err error) {
	ls.errors++
	if ls.errSamples == nil {
		ls.errSamples = map[string]int{}
	}
	if len(ls.errSamples) < 5 {
		ls.errSamples[err.Error()]++
	}
}

// histogram counts durations in buckets about 3% wide: exact below 64ns,
// then 32 buckets per power of two, up to about 18 minutes.
type histogram struct {
	counts [64 + 35*32]uint64
	n      uint64
}

func bucket(ns uint64) int {
	if ns < 64 {
		return int(ns)
	}
	shift := bits.Len64(ns) - 6 // >= 1
	i := 64 + (shift-1)*32 + int(ns>>shift) - 32
	return min(i, len(histogram{}.counts)-1)
}

// bucketMid returns the middle of bucket i, in nanoseconds.
func bucketMid(i int) float64 {
	if i < 64 {
		return float64(i)
	}
	shift := (i-64)/32 + 1
	lo := uint64(32+(i-64)%32) << shift
	return float64(lo) + float64(uint64(1)<<shift)/2
}

func (h *histogram) record(d time.Duration) {
	h.counts[bucket(uint64(max(d, 0)))]++
	h.n++
}

func (h *histogram) add(o *histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
}

// quantile returns the q-quantile in microseconds, or 0 without samples.
func (h *histogram) quantile(q float64) float64 {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank && c > 0 {
			return bucketMid(i) / 1000
		}
	}
	return bucketMid(len(h.counts)-1) / 1000
}

// bitset records which keys ran, and counts the keys that ran again.
// It grows in chunks, without a lock on the path that marks.
type bitset struct {
	chunks     [1 << 16]atomic.Pointer[[chunkWords]atomic.Uint64]
	duplicates atomic.Int64
}

const chunkWords = 1 << 10 // 65536 keys a chunk; 2^32 keys in all

func newBitset() *bitset { return &bitset{} }

// mark records that key id ran; it returns false, and counts a duplicate, if
// it had run before.
func (b *bitset) mark(id uint64) bool {
	c := id >> 16
	if c >= uint64(len(b.chunks)) {
		panic("idembench: more than 2^32 keys")
	}
	chunk := b.chunks[c].Load()
	if chunk == nil {
		b.chunks[c].CompareAndSwap(nil, new([chunkWords]atomic.Uint64))
		chunk = b.chunks[c].Load()
	}
	bit := uint64(1) << (id & 63)
	if chunk[(id>>6)&(chunkWords-1)].Or(bit)&bit != 0 {
		b.duplicates.Add(1)
		return false
	}
	return true
}

// isTerminal reports whether w is a terminal, where a progress line that
// rewrites itself is welcome.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// progressLine rewrites one line on a terminal with the progress of the idem
// side of the run: time measured, operations, and ops/s (of the slice under
// way, or of the whole run between slices). Its methods do nothing on a nil
// *progressLine.
type progressLine struct {
	w     io.Writer
	total time.Duration
	shown bool
}

func (p *progressLine) show(elapsed time.Duration, ops, sliceOps int64, sliceElapsed time.Duration) {
	if p == nil {
		return
	}
	p.shown = true
	fmt.Fprintf(p.w, "\r  %4.0fs of %.0fs  %d ops  %.0f ops/s   ", elapsed.Seconds(), p.total.Seconds(), ops, rate(sliceOps, sliceElapsed))
}

func (p *progressLine) clear() {
	if p == nil || !p.shown {
		return
	}
	fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", 70))
}
