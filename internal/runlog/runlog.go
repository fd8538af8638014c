// Package runlog is the side-effect log of the chaos kill tests
// (stream_kill_test.go, idemjetstream/kill_test.go): each worker process
// appends one line per handler run and per completion its Observer is told
// of, to a file of its own, and the test reads every worker's file once the
// run is over and counts.
//
// A line is written with one write(2) on a file opened O_APPEND, so it is
// whole in the file once Write returns, even if the process is killed or
// stopped a moment later; a file never fails the way a Redis being
// restarted does, so a run's side effect is in the log exactly when the
// handler got past it.
//
// It does not import idem: package idem's own tests use it.
package runlog

import (
	"bufio"
	"cmp"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// Log is one worker's log file.
type Log struct {
	mu sync.Mutex
	f  *os.File
}

// Open opens (creates) the log at path for appending.
func Open(path string) (*Log, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	return &Log{f: f}, nil
}

// Close closes the file.
func (l *Log) Close() error { return l.f.Close() }

func (l *Log) line(fields ...string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, err := l.f.WriteString(strings.Join(fields, " ") + "\n")
	return err
}

func recovered(r bool) string {
	if r {
		return "1"
	}
	return "0"
}

// Start records that a handler of message id began under the claim of
// record rid (the Keeper's RecordID of the claim's scope and key) with
// token, recovered or not. It is not a side effect: Run is.
func (l *Log) Start(id, rid string, token int64, rec bool) error {
	return l.line("start", id, rid, strconv.FormatInt(token, 10), recovered(rec))
}

// Run is the handler's side effect: it records that the handler of
// message id ran under the claim of record rid with token.
func (l *Log) Run(id, rid string, token int64, rec bool) error {
	return l.line("run", id, rid, strconv.FormatInt(token, 10), recovered(rec))
}

// Stored records that the completion of record rid by the claim of token
// was stored (an Observer's StepComplete, ResultDone).
func (l *Log) Stored(rid string, token int64) error {
	return l.line("stored", rid, strconv.FormatInt(token, 10))
}

// Fenced records that the completion of record rid by the claim of token
// was refused: the claim was no longer the holder (StepComplete,
// ResultLeaseLost).
func (l *Log) Fenced(rid string, token int64) error {
	return l.line("fenced", rid, strconv.FormatInt(token, 10))
}

// A RunLine is a run (or a start) read back.
type RunLine struct {
	ID, RID   string
	Token     int64
	Recovered bool
	File      string // the log it was read from: the worker
}

// Logs is what the logs of one test run hold.
type Logs struct {
	Starts, Runs []RunLine
	// Stored and Fenced are the tokens of each record's completions that
	// were stored, and refused.
	Stored, Fenced map[string][]int64
}

// Read reads the logs at paths; a path whose file does not exist (a worker
// that never wrote) counts as empty.
func Read(paths ...string) (*Logs, error) {
	l := &Logs{Stored: map[string][]int64{}, Fenced: map[string][]int64{}}
	for _, p := range paths {
		f, err := os.Open(p)
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			return nil, err
		}
		s := bufio.NewScanner(f)
		for s.Scan() {
			if err := l.add(s.Text(), p); err != nil {
				f.Close()
				return nil, fmt.Errorf("%s: %w", p, err)
			}
		}
		f.Close()
		if err := s.Err(); err != nil {
			return nil, err
		}
	}
	return l, nil
}

func (l *Logs) add(line, file string) error {
	f := strings.Fields(line)
	bad := fmt.Errorf("a line that is not one of the log's: %q", line)
	switch {
	case len(f) == 5 && (f[0] == "start" || f[0] == "run"):
		tok, err := strconv.ParseInt(f[3], 10, 64)
		if err != nil {
			return bad
		}
		r := RunLine{ID: f[1], RID: f[2], Token: tok, Recovered: f[4] == "1", File: file}
		if f[0] == "start" {
			l.Starts = append(l.Starts, r)
		} else {
			l.Runs = append(l.Runs, r)
		}
	case len(f) == 3 && (f[0] == "stored" || f[0] == "fenced"):
		tok, err := strconv.ParseInt(f[2], 10, 64)
		if err != nil {
			return bad
		}
		if f[0] == "stored" {
			l.Stored[f[1]] = append(l.Stored[f[1]], tok)
		} else {
			l.Fenced[f[1]] = append(l.Fenced[f[1]], tok)
		}
	default:
		return bad
	}
	return nil
}

// Counts is what Count finds.
type Counts struct {
	// Messages is the number of ids asked about; Runs the handler runs of
	// them (side effects); SecondRuns the runs of an id beyond its first
	// (by token: the claim made first); Recovered those of SecondRuns whose
	// claim was Recovered; Lost the ids that never ran.
	Messages, Runs, SecondRuns, Recovered, Lost int
	// Stored and Fenced count the completions the Observers were told were
	// stored, and refused (lease lost).
	Stored, Fenced int
	// AgainAfterStored counts the runs of an id beyond the one whose
	// outcome was stored: runs under a claim made after it (a higher
	// token), a second run under its token, and a second stored outcome of
	// the id. It must be 0: a handler whose outcome was stored never runs
	// again.
	AgainAfterStored int
	// StoredWithoutRun counts the ids whose outcome was stored by a claim
	// that has no run in the logs: a side effect lost. It must be 0.
	StoredWithoutRun int
	// Problems names the ids behind Lost, AgainAfterStored and second runs
	// not Recovered, a few of each.
	Problems []string
}

// Count counts the runs of ids (the runs of other ids are ignored).
func (l *Logs) Count(ids []string) Counts {
	byID := map[string][]RunLine{}
	for _, r := range l.Runs {
		byID[r.ID] = append(byID[r.ID], r)
	}
	c := Counts{Messages: len(ids)}
	problem := func(format string, a ...any) {
		if len(c.Problems) < 20 {
			c.Problems = append(c.Problems, fmt.Sprintf(format, a...))
		}
	}
	for _, rs := range l.Fenced {
		c.Fenced += len(rs)
	}
	for _, id := range ids {
		runs := byID[id]
		c.Runs += len(runs)
		if len(runs) == 0 {
			c.Lost++
			problem("%s: never ran", id)
			continue
		}
		slices.SortStableFunc(runs, func(a, b RunLine) int { return cmp.Compare(a.Token, b.Token) })
		for _, r := range runs[1:] {
			c.SecondRuns++
			if r.Recovered && r.Token > runs[0].Token {
				c.Recovered++
			} else {
				problem("%s: a second run (token %d, %s) not Recovered; first token %d", id, r.Token, r.File, runs[0].Token)
			}
		}
		stored := l.Stored[runs[0].RID]
		c.Stored += len(stored)
		if len(stored) == 0 {
			continue
		}
		if len(stored) > 1 {
			c.AgainAfterStored += len(stored) - 1
			problem("%s: %d outcomes stored (tokens %v)", id, len(stored), stored)
		}
		first := slices.Min(stored)
		if !slices.ContainsFunc(runs, func(r RunLine) bool { return r.Token == first }) {
			c.StoredWithoutRun++
			problem("%s: its outcome was stored (token %d) and no run of that token is in the logs", id, first)
		}
		atFirst := 0
		for _, r := range runs {
			switch {
			case r.Token > first:
				c.AgainAfterStored++
				problem("%s: ran (token %d, %s) after its outcome was stored (token %d)", id, r.Token, r.File, first)
			case r.Token == first:
				if atFirst++; atFirst > 1 {
					c.AgainAfterStored++
					problem("%s: ran twice under the token whose outcome was stored (%d)", id, first)
				}
			}
		}
	}
	return c
}

// String gives the counts as the tests log them.
func (c Counts) String() string {
	return fmt.Sprintf("%d messages, %d runs, %d second runs (%d of them Recovered), %d lost, "+
		"%d handlers ran again after their outcome was stored; %d completions stored (%d without a run), %d refused (lease lost)",
		c.Messages, c.Runs, c.SecondRuns, c.Recovered, c.Lost, c.AgainAfterStored, c.Stored, c.StoredWithoutRun, c.Fenced)
}

// Unfinished returns the starts in the log at path with no run of the same
// id and token after them: handlers under way (or killed, or stopped) when
// the log was read.
func Unfinished(path string) ([]RunLine, error) {
	l, err := Read(path)
	if err != nil {
		return nil, err
	}
	type k struct {
		id  string
		tok int64
	}
	ran := map[k]bool{}
	for _, r := range l.Runs {
		ran[k{r.ID, r.Token}] = true
	}
	var out []RunLine
	for _, s := range l.Starts {
		if !ran[k{s.ID, s.Token}] {
			out = append(out, s)
		}
	}
	return out, nil
}
