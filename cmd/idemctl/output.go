package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// jsonRecord is a record as -json prints it. Durations are milliseconds;
// lease_left_ms is set for a pending record only (zero or less: the lease
// ran out that long ago), result and size for a completed one only.
type jsonRecord struct {
	Key         string `json:"key"`
	ID          string `json:"id"`
	State       string `json:"state"`
	Token       int64  `json:"token,omitempty"`
	Attempt     int    `json:"attempt,omitempty"`
	Recovered   bool   `json:"recovered"`
	Fingerprint bool   `json:"fingerprint"`
	LeaseLeftMS *int64 `json:"lease_left_ms,omitempty"`
	// LeaseEnd is when a pending record's lease ends (or ended), by Redis's
	// clock, RFC 3339.
	LeaseEnd    string           `json:"lease_end,omitempty"`
	AgeMS       int64            `json:"age_ms"`
	ExpiresInMS int64            `json:"expires_in_ms"`
	Result      string           `json:"result,omitempty"`
	Size        *int             `json:"size,omitempty"`
	Checkpoints []jsonCheckpoint `json:"checkpoints,omitempty"`
	// ReadAt is Redis's clock when the record was read, RFC 3339.
	ReadAt string `json:"read_at,omitempty"`
	// Compact is set for a compact claim or a marker (idem.Record.Compact):
	// CompletedAgoMS is a marker's time since completion, Claims a
	// listing's count of the call's claims in the state.
	Compact        bool   `json:"compact,omitempty"`
	CompletedAgoMS *int64 `json:"completed_ago_ms,omitempty"`
	Claims         int    `json:"claims,omitempty"`
	Error          string `json:"error,omitempty"`
}

// jsonCheckpoint is a checkpoint as -json prints it: its name and the size
// of its value in bytes.
type jsonCheckpoint struct {
	Name string `json:"name"`
	Size int    `json:"size"`
}

func toJSON(r idem.Record) jsonRecord {
	j := jsonRecord{
		Key: r.Key, ID: r.ID, State: r.State.String(), Token: r.Token, Attempt: r.Attempt,
		Recovered: r.Recovered, Fingerprint: r.Fingerprint,
		AgeMS: r.Age.Milliseconds(), ExpiresInMS: r.ExpiresIn.Milliseconds(),
	}
	if r.ExpiresIn < 0 {
		j.ExpiresInMS = -1
	}
	if !r.ReadAt.IsZero() {
		j.ReadAt = r.ReadAt.UTC().Format(time.RFC3339Nano)
	}
	switch r.State {
	case idem.StatePending:
		ms := r.LeaseLeft.Milliseconds()
		j.LeaseLeftMS = &ms
		j.LeaseEnd = r.ReadAt.Add(r.LeaseLeft).UTC().Format(time.RFC3339Nano)
	case idem.StateCompleted:
		j.Result, j.Size = r.Stored.String(), &r.Size
		if r.Compact {
			ms := r.CompletedAgo.Milliseconds()
			j.CompletedAgoMS = &ms
		}
	}
	j.Compact, j.Claims = r.Compact, r.Claims
	for _, c := range r.Checkpoints {
		j.Checkpoints = append(j.Checkpoints, jsonCheckpoint{Name: c.Name, Size: c.Size})
	}
	return j
}

// printJSON prints v as one line of JSON.
func printJSON(w io.Writer, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		b = []byte(fmt.Sprintf(`{"error":%q}`, err.Error()))
	}
	fmt.Fprintf(w, "%s\n", b)
}

// printRecord prints a record for a person, one fact a line.
func printRecord(w io.Writer, r idem.Record) {
	line := func(name, format string, args ...any) {
		fmt.Fprintf(w, "%-12s %s\n", name, fmt.Sprintf(format, args...))
	}
	line("record", "%s", r.Key)
	line("state", "%s", r.State)
	if r.State == idem.StateAbsent {
		fmt.Fprintln(w, "(no record: the key was never used under this scope and prefix, or its record expired or was forgotten)")
		return
	}
	if r.Compact {
		line("kept as", "%s", compactText(r))
	}
	line("token", "%d", r.Token)
	line("attempt", "%d", r.Attempt)
	line("recovered", "%s", yesNo(r.Recovered))
	line("fingerprint", "%s", yesNo(r.Fingerprint))
	switch r.State {
	case idem.StatePending:
		for i, text := range leaseText(r) {
			if i == 0 {
				line("lease", "%s", text)
			} else {
				line("", "%s", text)
			}
		}
	case idem.StateCompleted:
		line("result", "%s, %d bytes", r.Stored, r.Size)
		if r.Compact {
			line("completed", "%s ago: a claim gets the empty result for the retention from then, then ErrResultExpired until the marker retention", human(r.CompletedAgo))
		}
	}
	if len(r.Checkpoints) > 0 {
		line("checkpoints", "%s", checkpointsText(r.Checkpoints))
	}
	line("claimed", "%s ago", human(r.Age))
	line("expires in", "%s", expiryText(r.ExpiresIn))
}

// compactText says how a compact claim or marker is kept.
func compactText(r idem.Record) string {
	what := "a compact claim"
	if r.State == idem.StateCompleted {
		what = "a marker"
	}
	return what + " in the index, in the record of the call that claimed it (no record of its own)"
}

// checkpointsText lists checkpoints by name and size.
func checkpointsText(cps []idem.CheckpointInfo) string {
	parts := make([]string, len(cps))
	for i, c := range cps {
		parts[i] = fmt.Sprintf("%q (%d bytes)", c.Name, c.Size)
	}
	return fmt.Sprintf("%d: %s", len(cps), strings.Join(parts, ", "))
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// leaseText describes the lease of a pending record, a line a fact: what
// Redis knows is that a claim holds the key until a time, not whether its
// operation is running.
func leaseText(r idem.Record) []string {
	end := r.ReadAt.Add(r.LeaseLeft).UTC().Format("2006-01-02 15:04:05.000 UTC")
	if r.LeaseLeft > 0 {
		return []string{
			fmt.Sprintf("held by attempt %d until %s (Redis's clock), %s from now", r.Attempt, end, human(r.LeaseLeft)),
			"whether its operation is running is not known: a holder renews its lease while it runs,",
			"and one that stopped (crashed, paused, cut off) loses the key when the lease ends;",
			"when the lease was last renewed is not recorded",
		}
	}
	next := "the next claim takes the key over, told it is recovered"
	if len(r.Checkpoints) > 0 {
		next += ", and is handed the checkpoints"
	}
	return []string{
		fmt.Sprintf("ran out %s ago, at %s (Redis's clock): its holder stopped renewing it, or it was abandoned", human(-r.LeaseLeft), end),
		next,
	}
}

func expiryText(d time.Duration) string {
	if d < 0 {
		return "never"
	}
	return human(d)
}

// human rounds d for a person: to the millisecond under a minute, to the
// second above.
func human(d time.Duration) string {
	if d < time.Minute {
		return d.Round(time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}

// listHeader and listRow print pending's table with fixed widths, so that
// rows can be printed as they come.
func listHeader(w io.Writer, keyWidth int) {
	fmt.Fprintf(w, "%-*s  %-9s  %16s  %7s  %-9s  %-11s  %-11s  %s\n",
		keyWidth, "KEY", "STATE", "TOKEN", "ATTEMPT", "RECOVERED", "LEASE LEFT", "AGE", "RESULT")
}

func listRow(w io.Writer, keyWidth int, r idem.Record) {
	lease, result := "-", "-"
	switch r.State {
	case idem.StatePending:
		lease = human(r.LeaseLeft)
		if r.LeaseLeft <= 0 {
			lease = "ran out"
		}
	case idem.StateCompleted:
		result = fmt.Sprintf("%s, %d bytes", r.Stored, r.Size)
	}
	if r.Claims > 0 {
		// A call's compact claims or markers in one state.
		kind := "compact claims"
		if r.State == idem.StateCompleted {
			kind = "markers"
		}
		result = fmt.Sprintf("%d %s of this call", r.Claims, kind)
	}
	fmt.Fprintf(w, "%-*s  %-9s  %16d  %7d  %-9s  %-11s  %-11s  %s\n",
		keyWidth, r.Key, r.State, r.Token, r.Attempt, yesNo(r.Recovered), lease, human(r.Age), result)
}

// keyWidth is the width of the KEY column for records under a prefix this
// long: the prefix, then "{", a 22-character id and "}".
func keyWidth(prefix int) int { return prefix + 24 }
