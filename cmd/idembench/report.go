package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// Result is what a run measured; it is also the JSON the tool prints.
type Result struct {
	Workload     string  `json:"workload"`
	Mode         string  `json:"mode"`
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
	// RedisUsecPerOp is the usec, in INFO commandstats, of the commands the
	// side sent, per operation; RedisCPUUsecPerOp is the server process's
	// CPU time (INFO cpu) per operation. Both are 0 where the server has no
	// INFO commandstats (miniredis).
	RedisUsecPerOp    float64 `json:"redis_usec_per_op"`
	RedisCPUUsecPerOp float64 `json:"redis_cpu_usec_per_op"`
	// AllocsPerOp is the process's allocations per operation.
	AllocsPerOp float64 `json:"allocs_per_op"`
	Executions  int64   `json:"executions"`
	Replays     int64   `json:"replays"`
	InProgress  int64   `json:"in_progress"`
	Errors      int64   `json:"errors"`
	Duplicates  int64   `json:"duplicates"`
	// BatchSize is -batch with -workload batch, 0 otherwise; Batches counts
	// the idem.Consume calls, and RoundTripsPerBatch their round trips
	// each. Ops then counts messages.
	BatchSize          int     `json:"batch_size,omitempty"`
	Batches            int64   `json:"batches,omitempty"`
	RoundTripsPerBatch float64 `json:"round_trips_per_batch,omitempty"`
	// CacheEntries is -cache, 0 without a replay cache. CacheHits counts
	// the operations its cache answered without Redis; CacheHitRate is
	// CacheHits over the calls that looked in the cache.
	CacheEntries int     `json:"cache_entries"`
	CacheHits    uint64  `json:"cache_hits"`
	CacheHitRate float64 `json:"cache_hit_rate"`

	// Baseline names the baseline (setnx, pair, get, bare), empty without
	// -baseline; its figures, and Ratio, are 0 then.
	Baseline                  string  `json:"baseline"`
	BaselineAutopipeline      bool    `json:"baseline_autopipeline"`
	BaselineOps               int64   `json:"baseline_ops"`
	BaselineOpsPerSec         float64 `json:"baseline_ops_per_sec"`
	BaselineP50us             float64 `json:"baseline_p50_us"`
	BaselineP99us             float64 `json:"baseline_p99_us"`
	BaselineRedisUsecPerOp    float64 `json:"baseline_redis_usec_per_op"`
	BaselineRedisCPUUsecPerOp float64 `json:"baseline_redis_cpu_usec_per_op"`
	BaselineAllocsPerOp       float64 `json:"baseline_allocs_per_op"`
	// Ratio is idem's ops/s over the baseline's.
	Ratio float64 `json:"ratio"`

	// redisMeasured is whether the Redis CPU figures could be read.
	redisMeasured bool
	errorSamples  []string
}

// result gathers what the run measured.
func (h *harness) result() *Result {
	o := h.o
	res := &Result{
		Workload: o.workload, Mode: o.mode, Server: h.server, Concurrency: o.concurrency, Body: o.body,
		Dup: o.dup, Autopipeline: o.autopipeline, Coalesce: o.coalesce,
		Baseline: o.baseline, BaselineAutopipeline: o.baselineAP,
	}
	if o.autopipeline {
		res.APBatches, res.APDelayUs = o.apBatches, float64(o.apDelay)/float64(time.Microsecond)
	}

	s := h.idem.stats
	res.Ops = s.ops()
	res.DurationSec = s.elapsed.Seconds()
	res.OpsPerSec = rate(res.Ops, s.elapsed)
	res.P50us, res.P95us, res.P99us = s.hist.Quantile(0.50), s.hist.Quantile(0.95), s.hist.Quantile(0.99)
	if res.Ops > 0 {
		res.CommandsPerOp = float64(h.cnt.commands.Load()) / float64(res.Ops)
		res.RoundTripsPerOp = float64(h.cnt.roundTrips.Load()) / float64(res.Ops)
	}
	res.RedisUsecPerOp, res.RedisCPUUsecPerOp, res.AllocsPerOp = h.idem.cost.perOp(res.Ops)
	res.redisMeasured = h.idem.cost.redis
	res.Executions = s.executed.Load()
	res.Replays = s.replayed.Load()
	res.InProgress = s.inProgress.Load()
	res.Errors = s.errors.Load()
	res.Duplicates = h.w.ran.duplicates.Load()
	if o.workload == workloadBatch {
		res.BatchSize, res.Batches = o.batch, s.batches.Load()
		if res.Batches > 0 {
			res.RoundTripsPerBatch = float64(h.cnt.roundTrips.Load()) / float64(res.Batches)
		}
	}
	res.errorSamples = s.samples()
	res.CacheEntries = o.cache
	st := h.k.ReplayCacheStats()
	res.CacheHits = st.Hits - h.cache0.Hits
	if looked := res.CacheHits + st.Misses - h.cache0.Misses; looked > 0 {
		res.CacheHitRate = float64(res.CacheHits) / float64(looked)
	}

	if b := h.base; b != nil {
		res.BaselineOps = b.stats.ops()
		res.BaselineOpsPerSec = rate(res.BaselineOps, b.stats.elapsed)
		res.BaselineP50us, res.BaselineP99us = b.stats.hist.Quantile(0.50), b.stats.hist.Quantile(0.99)
		res.BaselineRedisUsecPerOp, res.BaselineRedisCPUUsecPerOp, res.BaselineAllocsPerOp = b.cost.perOp(res.BaselineOps)
		res.redisMeasured = res.redisMeasured && b.cost.redis
		if res.BaselineOpsPerSec > 0 {
			res.Ratio = res.OpsPerSec / res.BaselineOpsPerSec
		}
		res.Errors += b.stats.errors.Load()
		res.errorSamples = append(res.errorSamples, b.stats.samples()...)
	}
	return res
}

func printJSON(w io.Writer, r *Result) {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(r)
}

// printHeader says what is about to run.
func printHeader(w io.Writer, o *options, server string) {
	client := "plain client"
	if o.autopipeline {
		client = fmt.Sprintf("autopipeline (%d batches in flight, %s flush delay)", o.apBatches, o.apDelay)
	}
	fmt.Fprintf(w, "idembench: %s, mode %s, workload %s, %d callers, %s, %d-byte results, dup %.2f, %s, coalescing %v\n",
		server, o.mode, o.workload, o.concurrency, o.duration, o.body, o.dup, client, o.coalesce)
}

func printText(w io.Writer, r *Result) {
	unit := "ops/s"
	if r.BatchSize > 0 {
		unit = "messages/s"
	}
	fmt.Fprintf(w, "idem      %10.0f %s   p50 %s  p95 %s  p99 %s   %.2f commands/op  %.3f round trips/op\n",
		r.OpsPerSec, unit, us(r.P50us), us(r.P95us), us(r.P99us), r.CommandsPerOp, r.RoundTripsPerOp)
	fmt.Fprintf(w, "          %d ops in %.1fs: %d executed, %d replayed, %d in progress, %d errors; duplicates executed: %d\n",
		r.Ops, r.DurationSec, r.Executions, r.Replays, r.InProgress, r.Errors, r.Duplicates)
	fmt.Fprintf(w, "          %s\n", costLine(r, r.RedisUsecPerOp, r.RedisCPUUsecPerOp, r.AllocsPerOp))
	if r.BatchSize > 0 {
		fmt.Fprintf(w, "          batches of %d messages (an op is a message; latency is a batch's): %d batches, %.2f round trips/batch, %.3f commands/message\n",
			r.BatchSize, r.Batches, r.RoundTripsPerBatch, r.CommandsPerOp)
	}
	if r.CacheEntries > 0 {
		fmt.Fprintf(w, "          replay cache of %d entries: %d hits, hit rate %.3f\n", r.CacheEntries, r.CacheHits, r.CacheHitRate)
	}
	if r.BaselineOps == 0 {
		return
	}
	fmt.Fprintf(w, "baseline  %10.0f ops/s   p50 %s  p99 %s   (%s, same concurrency, interleaved)\n",
		r.BaselineOpsPerSec, us(r.BaselineP50us), us(r.BaselineP99us), describeBaseline(r))
	fmt.Fprintf(w, "          %s\n", costLine(r, r.BaselineRedisUsecPerOp, r.BaselineRedisCPUUsecPerOp, r.BaselineAllocsPerOp))
	fmt.Fprintf(w, "ratio     %10.2fx idem ops/s over %s ops/s", r.Ratio, r.Baseline)
	if r.redisMeasured && r.BaselineRedisUsecPerOp > 0 {
		fmt.Fprintf(w, "; Redis command µs/op %.2fx, Redis CPU µs/op %.2fx",
			r.RedisUsecPerOp/r.BaselineRedisUsecPerOp, r.RedisCPUUsecPerOp/r.BaselineRedisCPUUsecPerOp)
	}
	if r.BaselineAllocsPerOp > 0 {
		fmt.Fprintf(w, "; allocs/op %.2fx", r.AllocsPerOp/r.BaselineAllocsPerOp)
	}
	fmt.Fprintln(w)
}

// costLine says what an operation of one side of r cost Redis and the
// process.
func costLine(r *Result, commandUsec, cpuUsec, allocs float64) string {
	redis := "Redis CPU: n/a (no INFO commandstats)"
	if r.redisMeasured {
		redis = fmt.Sprintf("Redis %.2f µs/op in commands (INFO commandstats), %.2f µs/op of process CPU (INFO cpu)", commandUsec, cpuUsec)
	}
	process := "in this process"
	if strings.HasPrefix(r.Server, "miniredis") {
		process = "in this process, miniredis included"
	}
	return fmt.Sprintf("%s; %.1f allocs/op %s", redis, allocs, process)
}

func describeBaseline(r *Result) string {
	client := "plain client"
	if r.BaselineAutopipeline {
		client = "autopipeline"
	}
	switch r.Baseline {
	case baselineSetNX:
		return "plain go-redis SETNX, " + client
	case baselinePair:
		return "SET NX PX, then SET XX PX of the result, " + client
	case baselineGet:
		return "GET of a stored value, " + client
	case baselineBare:
		return "the same handler without the middleware, same HTTP client"
	}
	return r.Baseline
}

func us(v float64) string {
	if v >= 10000 {
		return fmt.Sprintf("%6.1fms", v/1000)
	}
	return fmt.Sprintf("%6.0fµs", v)
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
