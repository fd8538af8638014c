package main

import (
	"encoding/json"
	"fmt"
	"io"
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
	AgeMS       int64  `json:"age_ms"`
	ExpiresInMS int64  `json:"expires_in_ms"`
	Result      string `json:"result,omitempty"`
	Size        *int   `json:"size,omitempty"`
	Error       string `json:"error,omitempty"`
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
	switch r.State {
	case idem.StatePending:
		ms := r.LeaseLeft.Milliseconds()
		j.LeaseLeftMS = &ms
	case idem.StateCompleted:
		j.Result, j.Size = r.Stored.String(), &r.Size
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
	line("token", "%d", r.Token)
	line("attempt", "%d", r.Attempt)
	line("recovered", "%s", yesNo(r.Recovered))
	line("fingerprint", "%s", yesNo(r.Fingerprint))
	switch r.State {
	case idem.StatePending:
		line("lease", "%s", leaseText(r.LeaseLeft))
	case idem.StateCompleted:
		line("result", "%s, %d bytes", r.Stored, r.Size)
	}
	line("claimed", "%s ago", human(r.Age))
	line("expires in", "%s", expiryText(r.ExpiresIn))
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// leaseText describes the lease of a pending record.
func leaseText(left time.Duration) string {
	if left > 0 {
		return human(left) + " left: the operation is running"
	}
	return "ran out " + human(-left) + " ago: abandoned; the next claim takes it over (recovered)"
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
	fmt.Fprintf(w, "%-*s  %-9s  %16d  %7d  %-9s  %-11s  %-11s  %s\n",
		keyWidth, r.Key, r.State, r.Token, r.Attempt, yesNo(r.Recovered), lease, human(r.Age), result)
}

// keyWidth is the width of the KEY column for records under a prefix this
// long: the prefix, then "{", a 22-character id and "}".
func keyWidth(prefix int) int { return prefix + 24 }
