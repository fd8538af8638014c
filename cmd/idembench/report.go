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
	// ClientCPUUsecPerOp is this process's CPU time (getrusage, user plus
	// system) per operation over the side's slices: everything the process
	// did then, its garbage collection, the meter's reading of the process
	// and, in -mode http, the server in the process and, without -redis, the
	// embedded miniredis included. 0 where it cannot be read.
	ClientCPUUsecPerOp float64 `json:"client_cpu_usec_per_op"`
	// AllocsPerOp is the process's allocations per operation.
	AllocsPerOp float64 `json:"allocs_per_op"`
	Executions  int64   `json:"executions"`
	Replays     int64   `json:"replays"`
	InProgress  int64   `json:"in_progress"`
	// Errors counts the operations that failed, on both sides.
	Errors     int64 `json:"errors"`
	Duplicates int64 `json:"duplicates"`
	// BatchSize is -batch with -workload batch, 0 otherwise; Batches counts
	// the idem.Consume calls, and RoundTripsPerBatch their round trips
	// each. Ops then counts messages.
	BatchSize          int     `json:"batch_size,omitempty"`
	Batches            int64   `json:"batches,omitempty"`
	RoundTripsPerBatch float64 `json:"round_trips_per_batch,omitempty"`

	// The figures of -workload batch, 0 in the other workloads. Messages is
	// -messages, 0 for a run of -d; Fail is -fail, Seed -seed.
	Messages int64   `json:"messages"`
	Fail     float64 `json:"fail"`
	Seed     uint64  `json:"seed"`
	// Markers is -markers.
	Markers bool `json:"markers"`
	// IDs counts the new message ids idem's side delivered; LostIDs those
	// whose handler never succeeded by the end of the run;
	// HandlerFailures the handler calls that -fail made fail; Redelivered
	// the messages not acknowledged, which came again (counted in Ops, as
	// are Executions, Replays and InProgress: the messages idem handled,
	// acknowledged without handling, and found in progress).
	IDs             int64 `json:"ids"`
	LostIDs         int64 `json:"lost_ids"`
	HandlerFailures int64 `json:"handler_failures"`
	Redelivered     int64 `json:"redelivered"`
	// UsedMemoryPerID is the used_memory idem's keys took per id
	// delivered, UsedMemoryBytes all of it, and KeysAdded the keys its
	// database gained. MemoryMethod says how they were measured, or why
	// they were not (then they are 0).
	// MemoryIDs is the ids UsedMemoryPerID divides by: the ids delivered
	// and prefilled or, with -marker-retention, the live ones (see
	// MemoryMethod).
	UsedMemoryPerID float64 `json:"used_memory_per_id"`
	UsedMemoryBytes int64   `json:"used_memory_bytes"`
	KeysAdded       int64   `json:"keys_added"`
	MemoryIDs       int64   `json:"memory_ids"`
	MemoryMethod    string  `json:"memory_method"`
	// Prefill is -prefill: the ids each side handled before the clock
	// started, in batches of PrefillBatch, in PrefillSec seconds (idem's)
	// and BaselinePrefillSec (the baseline's). They are in no figure but
	// the memory per id. MarkerRetentionSec is -marker-retention, 0
	// without it.
	Prefill            int64   `json:"prefill"`
	PrefillBatch       int     `json:"prefill_batch,omitempty"`
	PrefillSec         float64 `json:"prefill_s"`
	BaselinePrefillSec float64 `json:"baseline_prefill_s"`
	MarkerRetentionSec float64 `json:"marker_retention_s"`
	// Side is -side: empty when both sides ran.
	Side string `json:"side,omitempty"`
	// The figures of -rate, 0 without it. Rate is -rate: messages a
	// second across all callers. MessagesPerBatch is the messages a call
	// took, on average: Ops over Batches. RedisCPUUsecPerSec is the
	// server's process CPU time (INFO cpu) over the side's slices per
	// second of their wall time (DurationSec), 0 where the server has no
	// INFO cpu (miniredis). Arrived counts the stream's messages that
	// arrived during the side's slices (the messages not acknowledged,
	// which come again, are not among them), Taken those the calls took;
	// FellBehind is set when Taken is below 95% of Arrived: the side was
	// saturated, and its figures are not those of a paced consumer.
	Rate               float64 `json:"rate"`
	MessagesPerBatch   float64 `json:"messages_per_batch"`
	RedisCPUUsecPerSec float64 `json:"redis_cpu_usec_per_sec"`
	Arrived            int64   `json:"arrived"`
	Taken              int64   `json:"taken"`
	FellBehind         bool    `json:"fell_behind"`

	// CacheEntries is -cache, 0 without a replay cache. CacheHits counts
	// the operations its cache answered without Redis; CacheHitRate is
	// CacheHits over the calls that looked in the cache.
	CacheEntries int     `json:"cache_entries"`
	CacheHits    uint64  `json:"cache_hits"`
	CacheHitRate float64 `json:"cache_hit_rate"`

	// Baseline names the baseline (setnx, setnx2, pair, get, bare,
	// bare-get), empty without -baseline; its figures, and Ratio, are 0
	// then. Each baseline_ figure is the baseline's of the field without
	// the prefix.
	Baseline                   string  `json:"baseline"`
	BaselineAutopipeline       bool    `json:"baseline_autopipeline"`
	BaselineOps                int64   `json:"baseline_ops"`
	BaselineDurationSec        float64 `json:"baseline_duration_s"`
	BaselineOpsPerSec          float64 `json:"baseline_ops_per_sec"`
	BaselineP50us              float64 `json:"baseline_p50_us"`
	BaselineP95us              float64 `json:"baseline_p95_us"`
	BaselineP99us              float64 `json:"baseline_p99_us"`
	BaselineCommandsPerOp      float64 `json:"baseline_commands_per_op"`
	BaselineRedisUsecPerOp     float64 `json:"baseline_redis_usec_per_op"`
	BaselineRedisCPUUsecPerOp  float64 `json:"baseline_redis_cpu_usec_per_op"`
	BaselineClientCPUUsecPerOp float64 `json:"baseline_client_cpu_usec_per_op"`
	BaselineAllocsPerOp        float64 `json:"baseline_allocs_per_op"`
	// The baseline's figures of -workload batch, 0 in the other workloads.
	BaselineExecutions         int64   `json:"baseline_executions"`
	BaselineReplays            int64   `json:"baseline_replays"`
	BaselineRedelivered        int64   `json:"baseline_redelivered"`
	BaselineHandlerFailures    int64   `json:"baseline_handler_failures"`
	BaselineIDs                int64   `json:"baseline_ids"`
	BaselineLostIDs            int64   `json:"baseline_lost_ids"`
	BaselineDuplicates         int64   `json:"baseline_duplicates"`
	BaselineErrors             int64   `json:"baseline_errors"`
	BaselineBatches            int64   `json:"baseline_batches"`
	BaselineRoundTripsPerBatch float64 `json:"baseline_round_trips_per_batch"`
	BaselineUsedMemoryPerID    float64 `json:"baseline_used_memory_per_id"`
	BaselineUsedMemoryBytes    int64   `json:"baseline_used_memory_bytes"`
	BaselineKeysAdded          int64   `json:"baseline_keys_added"`
	BaselineMemoryIDs          int64   `json:"baseline_memory_ids"`
	// The baseline's figures of -rate, 0 without it.
	BaselineMessagesPerBatch   float64 `json:"baseline_messages_per_batch"`
	BaselineRedisCPUUsecPerSec float64 `json:"baseline_redis_cpu_usec_per_sec"`
	BaselineArrived            int64   `json:"baseline_arrived"`
	BaselineTaken              int64   `json:"baseline_taken"`
	BaselineFellBehind         bool    `json:"baseline_fell_behind"`
	// Ratio is idem's ops/s over the baseline's.
	Ratio float64 `json:"ratio"`
	// Ratios holds idem's figure over the baseline's, by the name of the
	// figure (ops_per_sec, redis_usec_per_op, redis_cpu_usec_per_op,
	// client_cpu_usec_per_op, allocs_per_op, commands_per_op, and with
	// -workload batch round_trips_per_batch and used_memory_per_id, and
	// with -rate redis_cpu_usec_per_sec): the figures both sides measured,
	// the baseline's above 0.
	Ratios map[string]float64 `json:"ratios,omitempty"`

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
	c := h.idem.cost.perOp(res.Ops)
	res.RedisUsecPerOp, res.RedisCPUUsecPerOp, res.ClientCPUUsecPerOp, res.AllocsPerOp = c.commandUsec, c.processUsec, c.clientUsec, c.allocs
	res.redisMeasured = h.idem.cost.redis
	res.Executions = s.executed.Load()
	res.Replays = s.replayed.Load()
	res.InProgress = s.inProgress.Load()
	res.Errors = s.errors.Load()
	res.Duplicates = h.w.ran.duplicates.Load()
	if o.workload == workloadBatch {
		res.BatchSize, res.Batches = o.batch, s.batches.Load()
		res.RoundTripsPerBatch = perBatch(h.cnt, res.Batches)
		res.Messages, res.Fail, res.Seed = o.messages, o.fail, o.seed
		res.Markers = o.markers
		res.IDs, res.LostIDs, res.HandlerFailures = batchIDs(h.idem)
		res.Redelivered = s.redelivered.Load()
		res.UsedMemoryPerID, res.UsedMemoryBytes, res.KeysAdded = h.idemMemory.perID(), h.idemMemory.bytes, h.idemMemory.keys
		res.MemoryIDs, res.MemoryMethod = h.idemMemory.ids, h.memoryMethod
		res.Prefill, res.PrefillSec = o.prefill, h.idem.prefillTime.Seconds()
		if o.prefill > 0 {
			res.PrefillBatch, _ = prefillShape(o)
		}
		res.MarkerRetentionSec = o.markerRetention.Seconds()
		res.Side = o.side
		if o.rate > 0 {
			res.Rate = o.rate
			res.MessagesPerBatch, res.RedisCPUUsecPerSec = pacedFigures(h.idem, res.Ops, res.Batches)
			res.Arrived, res.Taken = pacedCounts(h.idem)
			res.FellBehind = behind(res.Arrived, res.Taken)
		}
	}
	res.errorSamples = s.samples()
	res.CacheEntries = o.cache
	st := h.k.ReplayCacheStats()
	res.CacheHits = st.Hits - h.cache0.Hits
	if looked := res.CacheHits + st.Misses - h.cache0.Misses; looked > 0 {
		res.CacheHitRate = float64(res.CacheHits) / float64(looked)
	}
	if h.base != nil {
		h.baselineResult(res)
	}
	return res
}

// baselineResult adds the baseline's figures, and the ratios, to res.
func (h *harness) baselineResult(res *Result) {
	b := h.base
	res.BaselineOps = b.stats.ops()
	res.BaselineOpsPerSec = rate(res.BaselineOps, b.stats.elapsed)
	res.BaselineDurationSec = b.stats.elapsed.Seconds()
	res.BaselineP50us, res.BaselineP95us, res.BaselineP99us = b.stats.hist.Quantile(0.50), b.stats.hist.Quantile(0.95), b.stats.hist.Quantile(0.99)
	if res.BaselineOps > 0 {
		res.BaselineCommandsPerOp = float64(h.baseCnt.commands.Load()) / float64(res.BaselineOps)
	}
	c := b.cost.perOp(res.BaselineOps)
	res.BaselineRedisUsecPerOp, res.BaselineRedisCPUUsecPerOp = c.commandUsec, c.processUsec
	res.BaselineClientCPUUsecPerOp, res.BaselineAllocsPerOp = c.clientUsec, c.allocs
	res.redisMeasured = res.redisMeasured && b.cost.redis
	if b.streams != nil {
		res.BaselineExecutions, res.BaselineReplays = b.stats.executed.Load(), b.stats.replayed.Load()
		res.BaselineRedelivered, res.BaselineDuplicates = b.stats.redelivered.Load(), b.ran.duplicates.Load()
		res.BaselineIDs, res.BaselineLostIDs, res.BaselineHandlerFailures = batchIDs(b)
		res.BaselineBatches = b.stats.batches.Load()
		res.BaselineRoundTripsPerBatch = perBatch(h.baseCnt, res.BaselineBatches)
		res.BaselineUsedMemoryPerID, res.BaselineUsedMemoryBytes, res.BaselineKeysAdded = h.baseMemory.perID(), h.baseMemory.bytes, h.baseMemory.keys
		res.BaselineMemoryIDs, res.BaselinePrefillSec = h.baseMemory.ids, b.prefillTime.Seconds()
		if h.o.rate > 0 {
			res.BaselineMessagesPerBatch, res.BaselineRedisCPUUsecPerSec = pacedFigures(b, res.BaselineOps, res.BaselineBatches)
			res.BaselineArrived, res.BaselineTaken = pacedCounts(b)
			res.BaselineFellBehind = behind(res.BaselineArrived, res.BaselineTaken)
		}
	}
	if res.BaselineOpsPerSec > 0 {
		res.Ratio = res.OpsPerSec / res.BaselineOpsPerSec
	}
	res.Ratios = map[string]float64{}
	ratio := func(name string, ours, theirs float64) {
		if theirs > 0 {
			res.Ratios[name] = ours / theirs
		}
	}
	ratio("ops_per_sec", res.OpsPerSec, res.BaselineOpsPerSec)
	if res.redisMeasured {
		ratio("redis_usec_per_op", res.RedisUsecPerOp, res.BaselineRedisUsecPerOp)
		ratio("redis_cpu_usec_per_op", res.RedisCPUUsecPerOp, res.BaselineRedisCPUUsecPerOp)
		ratio("redis_cpu_usec_per_sec", res.RedisCPUUsecPerSec, res.BaselineRedisCPUUsecPerSec)
	}
	ratio("client_cpu_usec_per_op", res.ClientCPUUsecPerOp, res.BaselineClientCPUUsecPerOp)
	ratio("allocs_per_op", res.AllocsPerOp, res.BaselineAllocsPerOp)
	ratio("commands_per_op", res.CommandsPerOp, res.BaselineCommandsPerOp)
	ratio("round_trips_per_batch", res.RoundTripsPerBatch, res.BaselineRoundTripsPerBatch)
	if res.UsedMemoryPerID > 0 {
		ratio("used_memory_per_id", res.UsedMemoryPerID, res.BaselineUsedMemoryPerID)
	}
	res.BaselineErrors = b.stats.errors.Load()
	res.Errors += res.BaselineErrors
	res.errorSamples = append(res.errorSamples, b.stats.samples()...)
}

// perBatch returns the round trips cnt counted per batch.
func perBatch(cnt *counter, batches int64) float64 {
	if batches <= 0 {
		return 0
	}
	return float64(cnt.roundTrips.Load()) / float64(batches)
}

// pacedFigures returns, for a side of a run under -rate, the messages a
// call took on average, of ops messages in batches calls, and the
// server's process CPU (INFO cpu) in µs per second of the side's measured
// time, 0 where it was not measured.
func pacedFigures(s *side, ops, batches int64) (perBatch, redisCPUPerSec float64) {
	if batches > 0 {
		perBatch = float64(ops) / float64(batches)
	}
	return perBatch, s.cost.processPerSec(s.stats.elapsed)
}

// pacedCounts returns the stream's messages that arrived for the callers of
// a side under -rate during its slices, and those its calls took.
func pacedCounts(s *side) (arrived, taken int64) {
	for _, st := range s.streams {
		if st.pace != nil {
			arrived += st.pace.arrivedSum
			taken += st.pace.takenSum
		}
	}
	return arrived, taken
}

// batchIDs returns the new ids a batch side delivered, those whose handler
// never succeeded, and its failed handler calls.
func batchIDs(s *side) (ids, lost, failures int64) {
	ids = deliveredIDs(s)
	for _, st := range s.streams {
		failures += st.handlerFailures
	}
	return ids, ids - s.ran.count(), failures
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
	length := o.duration.String()
	if o.messages > 0 {
		length = fmt.Sprintf("%d message ids a side", o.messages)
	}
	workload := o.workload
	if o.workload == workloadBatch {
		markers := "markers off"
		if o.markers {
			markers = "markers on"
		}
		workload = fmt.Sprintf("batch of %d, fail %g, seed %d, %s", o.batch, o.fail, o.seed, markers)
		if o.prefill > 0 {
			batch, callers := prefillShape(o)
			workload += fmt.Sprintf(", prefill of %d ids a side (batches of %d, %d callers; not measured)", o.prefill, batch, callers)
		}
		if o.markerRetention > 0 {
			workload += fmt.Sprintf(", marker retention %s (steady state)", o.markerRetention)
		}
		if o.side != "" {
			workload += ", only the " + o.side + " side runs"
		}
		if o.rate > 0 {
			workload += ", " + pacedAt(o.rate, o.concurrency)
		}
	}
	fmt.Fprintf(w, "idembench: %s, mode %s, workload %s, %d callers, %s, %d-byte results, dup %.2f, %s, coalescing %v\n",
		server, o.mode, workload, o.concurrency, length, o.body, o.dup, client, o.coalesce)
}

func printText(w io.Writer, r *Result) {
	if r.BatchSize > 0 {
		printBatchText(w, r)
		return
	}
	fmt.Fprintf(w, "idem      %10.0f ops/s   p50 %s  p95 %s  p99 %s   %.2f commands/op  %.3f round trips/op\n",
		r.OpsPerSec, us(r.P50us), us(r.P95us), us(r.P99us), r.CommandsPerOp, r.RoundTripsPerOp)
	fmt.Fprintf(w, "          %d ops in %.1fs: %d executed, %d replayed, %d in progress, %d errors; duplicates executed: %d\n",
		r.Ops, r.DurationSec, r.Executions, r.Replays, r.InProgress, r.Errors, r.Duplicates)
	fmt.Fprintf(w, "          %s\n", costLine(r, "op", r.RedisUsecPerOp, r.RedisCPUUsecPerOp, r.ClientCPUUsecPerOp, r.AllocsPerOp))
	if r.CacheEntries > 0 {
		fmt.Fprintf(w, "          replay cache of %d entries: %d hits, hit rate %.3f\n", r.CacheEntries, r.CacheHits, r.CacheHitRate)
	}
	if r.BaselineOps == 0 {
		return
	}
	fmt.Fprintf(w, "baseline  %10.0f ops/s   p50 %s  p99 %s   (%s, same concurrency, interleaved)\n",
		r.BaselineOpsPerSec, us(r.BaselineP50us), us(r.BaselineP99us), describeBaseline(r))
	fmt.Fprintf(w, "          %s\n", costLine(r, "op", r.BaselineRedisUsecPerOp, r.BaselineRedisCPUUsecPerOp, r.BaselineClientCPUUsecPerOp, r.BaselineAllocsPerOp))
	fmt.Fprintf(w, "ratio     %10.2fx idem ops/s over %s ops/s%s\n", r.Ratio, r.Baseline, costRatios(r, "op"))
}

// printBatchText prints the figures of -workload batch: for each side,
// messages/s and latency, what became of the messages and ids, and what a
// message cost; then the memory of both sides, and the ratios.
func printBatchText(w io.Writer, r *Result) {
	fmt.Fprintf(w, "idem      %10.0f messages/s   p50 %s  p95 %s  p99 %s (a batch's)   idem.Consume, %.3f commands/message\n",
		r.OpsPerSec, us(r.P50us), us(r.P95us), us(r.P99us), r.CommandsPerOp)
	fmt.Fprintf(w, "          %s\n", messagesLine(r.Ops, r.DurationSec, r.Executions, r.Replays, r.Redelivered, r.HandlerFailures, r.InProgress, r.Errors-r.BaselineErrors))
	fmt.Fprintf(w, "          ids: %d delivered, %d lost; duplicates executed: %d\n", r.IDs, r.LostIDs, r.Duplicates)
	fmt.Fprintf(w, "          %s\n", costLine(r, "message", r.RedisUsecPerOp, r.RedisCPUUsecPerOp, r.ClientCPUUsecPerOp, r.AllocsPerOp))
	if r.Rate > 0 {
		fmt.Fprintf(w, "          batches of at most %d messages: %d batches, %.2f round trips/batch\n", r.BatchSize, r.Batches, r.RoundTripsPerBatch)
		printPaced(w, r, "idem", r.MessagesPerBatch, r.RedisCPUUsecPerSec, r.DurationSec, r.Arrived, r.Taken, r.FellBehind)
	} else {
		fmt.Fprintf(w, "          batches of %d messages: %d batches, %.2f round trips/batch\n", r.BatchSize, r.Batches, r.RoundTripsPerBatch)
	}
	if r.Baseline == "" {
		printPrefill(w, r)
		if r.MemoryMethod != "" {
			fmt.Fprintf(w, "memory    idem %s: %s\n", memoryFigure(r.UsedMemoryPerID, r.MemoryIDs, r.KeysAdded), r.MemoryMethod)
		}
		return
	}
	fmt.Fprintf(w, "baseline  %10.0f messages/s   p50 %s  p95 %s  p99 %s (a batch's)   %s, %.3f commands/message\n",
		r.BaselineOpsPerSec, us(r.BaselineP50us), us(r.BaselineP95us), us(r.BaselineP99us), describeBaseline(r), r.BaselineCommandsPerOp)
	fmt.Fprintf(w, "          %s\n", messagesLine(r.BaselineOps, r.BaselineDurationSec, r.BaselineExecutions, r.BaselineReplays, r.BaselineRedelivered, r.BaselineHandlerFailures, 0, r.BaselineErrors))
	fmt.Fprintf(w, "          ids: %d delivered, %d lost; duplicates executed: %d\n", r.BaselineIDs, r.BaselineLostIDs, r.BaselineDuplicates)
	fmt.Fprintf(w, "          %s\n", costLine(r, "message", r.BaselineRedisUsecPerOp, r.BaselineRedisCPUUsecPerOp, r.BaselineClientCPUUsecPerOp, r.BaselineAllocsPerOp))
	fmt.Fprintf(w, "          %d batches, %.2f round trips/batch; the same stream, by the same callers, in alternating slices\n", r.BaselineBatches, r.BaselineRoundTripsPerBatch)
	if r.Rate > 0 {
		printPaced(w, r, r.Baseline, r.BaselineMessagesPerBatch, r.BaselineRedisCPUUsecPerSec, r.BaselineDurationSec, r.BaselineArrived, r.BaselineTaken, r.BaselineFellBehind)
	}
	printPrefill(w, r)
	if r.UsedMemoryPerID > 0 {
		fmt.Fprintf(w, "memory    idem %s, %s %s: %s\n", memoryFigure(r.UsedMemoryPerID, r.MemoryIDs, r.KeysAdded),
			r.Baseline, memoryFigure(r.BaselineUsedMemoryPerID, r.BaselineMemoryIDs, r.BaselineKeysAdded), r.MemoryMethod)
	} else if r.MemoryMethod != "" {
		fmt.Fprintf(w, "memory    %s\n", r.MemoryMethod)
	}
	fmt.Fprintf(w, "lost      ids whose handler never succeeded: idem %d, %s %d of %d; duplicates executed: idem %d, %s %d\n",
		r.LostIDs, r.Baseline, r.BaselineLostIDs, r.BaselineIDs, r.Duplicates, r.Baseline, r.BaselineDuplicates)
	fmt.Fprintf(w, "ratio     %10.2fx idem messages/s over %s messages/s", r.Ratio, r.Baseline)
	fmt.Fprint(w, costRatios(r, "message"))
	if v, ok := r.Ratios["round_trips_per_batch"]; ok {
		fmt.Fprintf(w, "; round trips/batch %.2fx", v)
	}
	if v, ok := r.Ratios["redis_cpu_usec_per_sec"]; ok {
		fmt.Fprintf(w, "; Redis CPU/s %.2fx (paced)", v)
	}
	if v, ok := r.Ratios["used_memory_per_id"]; ok {
		fmt.Fprintf(w, "; used_memory/id %.2fx", v)
	}
	fmt.Fprintln(w)
}

// pacedAt says at what rate a run is paced, across all callers and a
// caller.
func pacedAt(perSec float64, callers int) string {
	return fmt.Sprintf("paced at %g messages/s (%.4g/s a caller)", perSec, perSec/float64(callers))
}

// printPaced prints the figures of one side of a run under -rate: its mean
// batch, its Redis CPU per second, the messages that arrived and those
// taken; and a warning when it fell behind the rate.
func printPaced(w io.Writer, r *Result, name string, perBatch, cpuPerSec, seconds float64, arrived, taken int64, fellBehind bool) {
	cpu := "Redis CPU/s: n/a (no INFO cpu)"
	if r.redisMeasured {
		cpu = fmt.Sprintf("Redis CPU %.2f ms/s (%.2f%% of a core; INFO cpu over %.1fs)", cpuPerSec/1000, cpuPerSec/1e4, seconds)
	}
	fmt.Fprintf(w, "          %s: %.2f messages/call (mean); %s; %d of the %d messages that arrived taken\n",
		pacedAt(r.Rate, r.Concurrency), perBatch, cpu, taken, arrived)
	if fellBehind {
		share := 0.0
		if arrived > 0 {
			share = 100 * float64(taken) / float64(arrived)
		}
		fmt.Fprintf(w, "          WARNING: %s fell behind the rate: it took %.1f%% of the messages that arrived (under %.0f%%): it was saturated, and these are not the figures of a paced consumer\n",
			name, share, 100*behindShare)
	}
}

// printPrefill says what -prefill did, if anything.
func printPrefill(w io.Writer, r *Result) {
	if r.Prefill == 0 {
		return
	}
	fmt.Fprintf(w, "prefill   %d ids a side handled before the clock started, in batches of %d: idem in %.1fs", r.Prefill, r.PrefillBatch, r.PrefillSec)
	if r.Baseline != "" {
		fmt.Fprintf(w, ", %s in %.1fs", r.Baseline, r.BaselinePrefillSec)
	}
	fmt.Fprintln(w, "; counted in the memory per id, in no other figure")
}

// messagesLine says what became of a side's messages; seconds 0 is left
// out.
func messagesLine(ops int64, seconds float64, executed, replayed, redelivered, failures, inProgress, errs int64) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d messages", ops)
	if seconds > 0 {
		fmt.Fprintf(&b, " in %.1fs", seconds)
	}
	fmt.Fprintf(&b, ": %d handled, %d acknowledged without handling, %d not acknowledged and delivered again (%d handler calls failed)",
		executed, replayed, redelivered, failures)
	if inProgress > 0 {
		fmt.Fprintf(&b, ", %d in progress", inProgress)
	}
	fmt.Fprintf(&b, ", %d errors", errs)
	return b.String()
}

// memoryFigure says what a side's ids took in Redis.
func memoryFigure(perID float64, ids, keys int64) string {
	return fmt.Sprintf("%.0f B/id (%d ids, %d keys)", perID, ids, keys)
}

// costRatios says idem's costs per unit over the baseline's, where both
// were measured.
func costRatios(r *Result, unit string) string {
	var b strings.Builder
	if v, ok := r.Ratios["redis_cpu_usec_per_op"]; ok {
		fmt.Fprintf(&b, "; Redis CPU µs/%s %.2fx (INFO cpu)", unit, v)
	}
	if v, ok := r.Ratios["redis_usec_per_op"]; ok {
		fmt.Fprintf(&b, ", %.2fx in commands (INFO commandstats)", v)
	}
	if v, ok := r.Ratios["client_cpu_usec_per_op"]; ok {
		fmt.Fprintf(&b, "; client CPU µs/%s %.2fx", unit, v)
	}
	if v, ok := r.Ratios["allocs_per_op"]; ok {
		fmt.Fprintf(&b, "; allocs/%s %.2fx", unit, v)
	}
	return b.String()
}

// costLine says what an operation (a message in -workload batch) of one
// side of r cost Redis and the process.
func costLine(r *Result, unit string, commandUsec, cpuUsec, clientUsec, allocs float64) string {
	redis := "Redis CPU: n/a (no INFO commandstats)"
	if r.redisMeasured {
		redis = fmt.Sprintf("Redis %.2f µs/%s of process CPU (INFO cpu), %.2f µs/%s in commands (INFO commandstats)", cpuUsec, unit, commandUsec, unit)
	}
	process, included := "this process", ""
	if strings.HasPrefix(r.Server, "miniredis") {
		process, included = "this process, miniredis included", ", miniredis included"
	}
	client := "client CPU: n/a"
	if clientUsec > 0 {
		client = fmt.Sprintf("client CPU %.2f µs/%s (getrusage: all this process did in the side's slices%s)", clientUsec, unit, included)
	}
	return fmt.Sprintf("%s; %s; %.1f allocs/%s in %s", redis, client, allocs, unit, process)
}

func describeBaseline(r *Result) string {
	client := "plain client"
	if r.BaselineAutopipeline {
		client = "autopipeline"
	}
	if r.Workload == workloadBatch {
		switch r.Baseline {
		case baselineSetNX:
			return "one phase: pipelined SET id 1 NX EX ttl, then the handler of each new message"
		case baselineSetNX2:
			return "two phases: pipelined SET id 1 NX PX lease, the handlers, pipelined SET id 1 XX EX ttl"
		}
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
