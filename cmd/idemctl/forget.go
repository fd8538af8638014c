package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/idemkit/idem"
)

// forgetOutcome is what forget prints with -json: whether this command
// removed the record, and the record as it was (when removed), or as the
// command found it.
type forgetOutcome struct {
	Forgotten bool       `json:"forgotten"`
	Record    jsonRecord `json:"record"`
}

// forgetCmd removes one record, after showing it and asking, by the token it
// showed: a claim made meanwhile is never the one removed.
func forgetCmd(ctx context.Context, g *globals, args []string, con console) error {
	var (
		t     shown
		force bool
	)
	fs := flag.NewFlagSet("forget", flag.ContinueOnError)
	fs.SetOutput(con.err)
	t.flags(fs, g, "remove", "remove the record")
	fs.BoolVar(&force, "force", false, "remove the record even when an attempt holds a live lease on it, or it holds checkpoints: the holder's completion then fails (idem.ErrLeaseLost), and the next call runs the operation again from its first step, beside the holder if it still runs")
	c, r, err := t.open(ctx, g, fs, args)
	if err != nil {
		return err
	}
	defer c.Close()
	token := t.token
	switch {
	case r.State == idem.StateAbsent:
		return reportForget(con, g, r, false)
	case token != 0 && r.Token != token:
		return changed(con, g, "forgotten", token, r)
	case !force && (r.State == idem.StatePending && r.LeaseLeft > 0 || len(r.Checkpoints) > 0):
		return refuse(con, g, r)
	}
	if !t.yes {
		if err := confirm(con, r, "forget this record?", forgetConsequences(r)); err != nil {
			return err
		}
	}
	gone, err := c.keeper.ForgetRecord(ctx, r.ID, r.Token, force)
	var refused *idem.ForgetRefusedError
	switch {
	case errors.As(err, &refused):
		return refuse(con, g, gone) // changed since it was shown: a checkpoint, a renewal
	case err != nil:
		return err
	case gone.State == idem.StateAbsent:
		// Nothing of the token shown is there any more: gone already, or
		// the key was claimed again since it was shown (left alone).
		now, err := t.inspect(ctx, c)
		if err != nil {
			return err
		}
		if now.State == idem.StateAbsent {
			return reportForget(con, g, now, false)
		}
		return changed(con, g, "forgotten", r.Token, now)
	}
	return reportForget(con, g, gone, true)
}

// forgetConsequences says what forgetting r does, for the question.
func forgetConsequences(r idem.Record) []string {
	lines := []string{"forgotten, the key runs again as if it had never been seen: attempt 1, not told that an earlier attempt ran"}
	if r.State == idem.StatePending {
		lines = append(lines, "(to have the next attempt take the claim over, told it is recovered, use abandon, or let the lease run out)")
	}
	return lines
}

// refuse says why a record was not removed without -force: what would be
// lost.
func refuse(con console, g *globals, r idem.Record) error {
	if g.json {
		printJSON(con.out, forgetOutcome{Record: toJSON(r)})
	}
	fmt.Fprintf(con.err, "idemctl: not forgotten: %s (attempt %d, token %d)", r.Key, r.Attempt, r.Token)
	live := r.State == idem.StatePending && r.LeaseLeft > 0
	if live {
		fmt.Fprintf(con.err, " is held by a live lease (%s left): its operation may be running,\n"+
			"  and the next call would run it again beside the holder, not told so.\n", human(r.LeaseLeft))
	}
	if len(r.Checkpoints) > 0 {
		if live {
			fmt.Fprint(con.err, "  It also")
		} else {
			fmt.Fprint(con.err, "\n  It")
		}
		fmt.Fprintf(con.err, " holds checkpoints of steps that happened, which the next attempt would do again:\n  %s.\n",
			checkpointsText(r.Checkpoints))
	}
	fmt.Fprint(con.err, "  For a holder known to be dead, abandon hands the claim to the next attempt (recovered, with\n"+
		"  its checkpoints); -force removes the record anyway.\n")
	return errFailed
}

// changed says that the record named by token is not the one at the key
// now (now), which was left alone.
func changed(con console, g *globals, what string, token int64, now idem.Record) error {
	if g.json {
		printJSON(con.out, forgetOutcome{Record: toJSON(now)})
	}
	fmt.Fprintf(con.err, "idemctl: not %s: %s no longer holds the record of token %d; it holds a %s record of token %d (attempt %d),\n"+
		"  made or completed since, which was left alone. Inspect it, and name its token if it is the one meant.\n",
		what, now.Key, token, now.State, now.Token, now.Attempt)
	return errFailed
}

// reportForget prints what forget did: removed r (forgotten), or found
// nothing to remove.
func reportForget(con console, g *globals, r idem.Record, forgotten bool) error {
	switch {
	case g.json:
		printJSON(con.out, forgetOutcome{Forgotten: forgotten, Record: toJSON(r)})
	case forgotten:
		fmt.Fprintf(con.out, "forgot %s (%s, attempt %d, token %d): the next call with its key runs the operation\n",
			r.Key, r.State, r.Attempt, r.Token)
	default:
		fmt.Fprintf(con.out, "no record at %s: nothing to forget\n", r.Key)
	}
	return nil
}
