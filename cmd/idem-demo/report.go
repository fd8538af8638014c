package main

import (
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/idemkit/idem"
)

// printTable prints what the storm did and what the ledger says.
func printTable(w io.Writer, cfg stormConfig, rep *stormReport, v verdict, ev *eventCounts, took time.Duration) {
	lat := slices.Clone(rep.Latencies)
	slices.Sort(lat)
	row := func(name string, n any, note string) {
		if note != "" {
			note = "  " + note
		}
		fmt.Fprintf(w, "  %-36s %8v%s\n", name, n, note)
	}
	row("requests sent", rep.Sent, "")
	row("charges executed", v.Charges, fmt.Sprintf("for %d payments", rep.Payments))
	row("201 from the handler", rep.Fresh, "")
	row("201 replayed (Idempotent-Replayed)", rep.Replays, "")
	row("409 in progress, retried", rep.Conflicts, "")
	row("422 same key, changed amount", rep.Mismatches, "")
	row("400 no key", rep.MissingKey, "")
	if rep.Unavailable > 0 {
		row("503 store unavailable, retried", rep.Unavailable, "")
	}
	row("cut off by client timeout, retried", rep.Timeouts, "")
	if rep.Errors > 0 {
		row("other transport errors, retried", rep.Errors, "")
	}
	row("released for a retry", ev.get(idem.ResultReleased), "(the client left before the charge)")
	row("latency p50 / p99", round(percentile(lat, 50))+" / "+round(percentile(lat, 99)), "")
	row("wall time", round(took), "")
	fmt.Fprintln(w)

	bad := false
	say := func(ok bool, what, good string, problems []string) {
		if ok {
			fmt.Fprintf(w, "%s: OK, %s\n", what, good)
			return
		}
		bad = true
		fmt.Fprintf(w, "%s: FAIL\n", what)
		for i, p := range problems {
			if i == 5 {
				fmt.Fprintf(w, "  ... and %d more\n", len(problems)-i)
				break
			}
			fmt.Fprintf(w, "  %s\n", p)
		}
	}
	var ledger []string
	ledger = append(ledger, v.Double...)
	if v.Charged != rep.Payments {
		ledger = append(ledger, fmt.Sprintf("%d of %d payments charged", v.Charged, rep.Payments))
	}
	say(len(ledger) == 0, "ledger check", fmt.Sprintf("%d charges for %d distinct payments, none charged twice", v.Charges, v.Charged), ledger)
	say(len(v.Differ) == 0, "replay check", fmt.Sprintf("all %d answers of 201 equal the first response of their payment", v.Answers), v.Differ)
	var other []string
	other = append(other, rep.Unexpected...)
	if rep.Unanswered > 0 {
		other = append(other, fmt.Sprintf("%d payments got no 201 in %d tries", rep.Unanswered, maxSends))
	}
	say(len(other) == 0, "answer check", "every answer was one the contract allows", other)
	if bad {
		fmt.Fprintln(w, "\nidem-demo: FAILED")
	}
}
