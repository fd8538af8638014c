package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// printConsumerTable prints what the consumer scenario did and what the
// effects say, in the storm's table format, and reports whether the checks
// passed.
func printConsumerTable(w io.Writer, cfg consumerConfig, rep *consumerReport, v consumerVerdict) bool {
	row := func(name string, n any, note string) {
		if note != "" {
			note = "  " + note
		}
		fmt.Fprintf(w, "  %-36s %8v%s\n", name, n, note)
	}
	row("events published", rep.Entries, fmt.Sprintf("(%d distinct, %d sent twice by the producer)", rep.Events, rep.Duplicates))
	row("deliveries", rep.Deliveries, "")
	row("redeliveries", rep.Redeliveries, "(crashes, rebalances, events in progress elsewhere)")
	row("handled", rep.Handled, "")
	if rep.Guarded {
		row("duplicates suppressed", rep.Suppressed, "(acknowledged without running: handled before, or twice in a batch)")
		row("not acknowledged, delivered again", rep.Retried, "(in progress elsewhere, or the consumer died)")
	}
	row("effects", v.Effects, fmt.Sprintf("(%d steps of %d events)", len(steps), rep.Events))
	row("consumer crashes", rep.Crashes, "(mid-batch: between two steps, or before storing what was handled)")
	row("rebalances mid-batch", rep.Rebalances, fmt.Sprintf("(%d commits refused to the consumer that lost its partition)", rep.StaleCommits))
	if rep.Guarded {
		row("claims recovered from a dead consumer", rep.Recovered, fmt.Sprintf("(%d steps not done again: their checkpoints came with the claim)", rep.StepsSkipped))
		row("batches", rep.Batches, "")
		perBatch := 0.0
		if rep.Batches > 0 {
			perBatch = float64(rep.BatchRoundTrips) / float64(rep.Batches)
		}
		row("round trips per batch", fmt.Sprintf("%.2f", perBatch), fmt.Sprintf("(claim, renewals, completions within the settle window; the %d checkpoints apart, one each)", rep.Checkpoints))
	}
	row("wall time", round(rep.Took), "")
	fmt.Fprintln(w)

	if v.ok() {
		fmt.Fprintf(w, "effects check: OK, every one of %d events took each of its %d steps once (%d effects)\n", rep.Events, len(steps), v.Effects)
		if rep.Guarded {
			fmt.Fprintln(w, "  (crashes strike between steps, after a checkpoint: a step whose effect happened")
			fmt.Fprintln(w, "   but whose checkpoint was not written needs an idempotent or reconciled effect)")
		}
		return true
	}
	fmt.Fprintln(w, "effects check: FAIL")
	problems := append(append([]string(nil), v.Twice...), v.Lost...)
	for i, p := range problems {
		if i == 5 {
			fmt.Fprintf(w, "  ... and %d more\n", len(problems)-i)
			break
		}
		fmt.Fprintf(w, "  %s\n", p)
	}
	fmt.Fprintf(w, "  %d events took a step twice, %d have a step that never took effect\n", countEvents(v.Twice), countEvents(v.Lost))
	fmt.Fprintln(w, "\nidem-demo: FAILED")
	return false
}

// countEvents counts the distinct events named by problems ("order-00042: ...").
func countEvents(problems []string) int {
	seen := map[string]bool{}
	for _, p := range problems {
		id, _, _ := strings.Cut(p, ":")
		seen[id] = true
	}
	return len(seen)
}

// consumerFlags defines the consumer scenario's flags on fs.
func consumerFlags(fs *flag.FlagSet) (cfg *consumerConfig, enabled *bool) {
	c := defaultConsumers()
	cfg = &c
	enabled = fs.Bool("consume", true, "also run the consumer scenario (a stream of orders through crashing, rebalanced consumers)")
	fs.IntVar(&cfg.Events, "events", cfg.Events, "consumer scenario: distinct events the producer publishes")
	fs.IntVar(&cfg.Partitions, "partitions", cfg.Partitions, "consumer scenario: partitions of the stream")
	fs.IntVar(&cfg.Consumers, "consumers", cfg.Consumers, "consumer scenario: consumer processes at any time")
	fs.IntVar(&cfg.Batch, "batch", cfg.Batch, "consumer scenario: most events a consumer takes at once")
	fs.Float64Var(&cfg.DupRate, "dups", cfg.DupRate, "consumer scenario: share of events the producer publishes twice")
	fs.Float64Var(&cfg.CrashRate, "crash", cfg.CrashRate, "consumer scenario: chance that a batch's consumer dies in the middle of it")
	fs.IntVar(&cfg.MaxCrashes, "maxcrashes", cfg.MaxCrashes, "consumer scenario: crashes in all, at most")
	fs.IntVar(&cfg.Rebalances, "rebalances", cfg.Rebalances, "consumer scenario: partitions handed to another consumer in the middle of a batch")
	fs.DurationVar(&cfg.Lease, "lease", cfg.Lease, "consumer scenario: the lease of a claim, after which a dead consumer's events are taken over")
	return cfg, enabled
}

// runConsumers runs the consumer scenario on client's Redis and prints its
// table; it reports whether every check passed.
func runConsumers(ctx context.Context, stdout, stderr io.Writer, client *redis.Client, cfg consumerConfig, guarded bool, deadline time.Duration) bool {
	how := "with idem.Consume and checkpoints"
	if !guarded {
		how = "WITHOUT idem (-unguarded)"
	}
	fmt.Fprintf(stdout, "\nconsumers: %d consumer processes, %s, take batches of up to %d from %d partitions of %d orders (%.0f%% published twice); %.0f%% of batches crash (at most %d), %d partitions handed over mid-batch besides the rebalances crashes cause, lease %s (seed %d: the same events and draws again, not the same interleaving)\n\n",
		cfg.Consumers, how, cfg.Batch, cfg.Partitions, cfg.Events, 100*cfg.DupRate, 100*cfg.CrashRate, cfg.MaxCrashes, cfg.Rebalances, cfg.Lease, cfg.Seed)
	cctx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()
	rep, err := consume(cctx, client, cfg, guarded)
	if err != nil {
		fmt.Fprintf(stderr, "idem-demo: consumers: %v\n", err)
	}
	return printConsumerTable(stdout, cfg, rep, checkEffects(rep)) && err == nil
}
