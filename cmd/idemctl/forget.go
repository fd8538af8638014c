package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/idemkit/idem"
)

// forgetOutcome is what forget prints with -json: whether this command
// removed the record, and the record as it was.
type forgetOutcome struct {
	Forgotten bool       `json:"forgotten"`
	Record    jsonRecord `json:"record"`
}

// forgetCmd removes one record, after showing it and asking.
func forgetCmd(ctx context.Context, g *globals, args []string, con console) error {
	var (
		t          target
		force, yes bool
	)
	fs := flag.NewFlagSet("forget", flag.ContinueOnError)
	fs.SetOutput(con.err)
	t.flags(fs)
	fs.BoolVar(&force, "force", false, "remove the record even while an attempt holds a live lease on it: the holder's completion then fails (idem.ErrLeaseLost) and the next call runs the operation again, beside the holder if it still runs")
	fs.BoolVar(&yes, "yes", false, "remove without asking (required when the input is not a terminal)")
	fs.BoolVar(&g.json, "json", g.json, "print JSON instead of text")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := t.parse(fs); err != nil {
		return err
	}
	c, err := t.open(g)
	if err != nil {
		return err
	}
	defer c.Close()
	r, err := t.inspect(ctx, c)
	switch {
	case err != nil:
		return err
	case r.State == idem.StateAbsent:
		return reportForget(con, g, r, false)
	case r.State == idem.StatePending && r.LeaseLeft > 0 && !force:
		return refuse(con, r)
	}
	if !yes {
		if err := confirm(con, r); err != nil {
			return err
		}
	}
	gone, err := c.store.Forget(ctx, r.ID, force)
	if errors.Is(err, idem.ErrInProgress) {
		return refuse(con, gone) // claimed since it was shown
	}
	if err != nil {
		return err
	}
	return reportForget(con, g, gone, gone.State != idem.StateAbsent)
}

// refuse says why a record in progress was not removed.
func refuse(con console, r idem.Record) error {
	fmt.Fprintf(con.err, "idemctl: not forgotten: %s is in progress (attempt %d, token %d, lease left %s).\n"+
		"  -force removes it anyway: the holder's completion then fails with ErrLeaseLost, and the next call\n"+
		"  runs the operation again, beside the holder if it is still running.\n",
		r.Key, r.Attempt, r.Token, human(r.LeaseLeft))
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
