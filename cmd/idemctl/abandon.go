package main

import (
	"context"
	"flag"
	"fmt"

	"github.com/idemkit/idem"
)

// abandonOutcome is what abandon prints with -json: whether the claim's
// lease is over, so that the next claim takes it over, and the record as
// it is after the command.
type abandonOutcome struct {
	Abandoned bool       `json:"abandoned"`
	Record    jsonRecord `json:"record"`
}

// abandonCmd ends the lease of a claim whose holder is known to be dead,
// after showing it and asking, by the token it showed, and keeps the
// record: the next claim takes it over at once, told it is recovered, with
// the attempt count and the checkpoints.
func abandonCmd(ctx context.Context, g *globals, args []string, con console) error {
	var t shown
	fs := flag.NewFlagSet("abandon", flag.ContinueOnError)
	fs.SetOutput(con.err)
	t.flags(fs, g, "abandon", "abandon the claim")
	c, r, err := t.open(ctx, g, fs, args)
	if err != nil {
		return err
	}
	defer c.Close()
	token := t.token
	switch {
	case token != 0 && r.State != idem.StateAbsent && r.Token != token:
		return changedClaim(con, g, token, r)
	case r.State != idem.StatePending:
		return reportAbandon(con, g, r, false)
	case r.LeaseLeft <= 0:
		return reportAbandon(con, g, r, false) // over already: nothing to do
	}
	if !t.yes {
		notes := []string{
			"abandoned, its lease ends now and the record is kept: the next claim takes the key over at once,",
			"told it is recovered, with the attempt count and the checkpoints. Abandon only a claim whose holder",
			"is known to be dead: a live one runs on beside the next attempt until its next renewal.",
		}
		if err := confirm(con, r, "abandon this claim?", notes); err != nil {
			return err
		}
	}
	after, err := c.keeper.AbandonRecord(ctx, r.ID, r.Token)
	if err != nil {
		return err
	}
	if after.State == idem.StatePending && after.Token != r.Token {
		return changedClaim(con, g, r.Token, after)
	}
	return reportAbandon(con, g, after, after.State == idem.StatePending)
}

// changedClaim says that the claim named by token no longer holds the key:
// now, made or completed since, was left alone. The named claim's lease is
// over, which is what abandon is for.
func changedClaim(con console, g *globals, token int64, now idem.Record) error {
	if g.json {
		printJSON(con.out, abandonOutcome{Abandoned: true, Record: toJSON(now)})
		return nil
	}
	fmt.Fprintf(con.out, "nothing to abandon: %s no longer holds the claim of token %d; it holds a %s record of token %d\n"+
		"(attempt %d), made or completed since, which was left alone\n", now.Key, token, now.State, now.Token, now.Attempt)
	return nil
}

// reportAbandon prints what abandon found or did: r is the record after
// it; ended is set when this command ended r's lease.
func reportAbandon(con console, g *globals, r idem.Record, ended bool) error {
	if g.json {
		printJSON(con.out, abandonOutcome{Abandoned: r.State != idem.StatePending || r.LeaseLeft <= 0, Record: toJSON(r)})
		return nil
	}
	recovered := "told it is recovered"
	if len(r.Checkpoints) > 0 {
		recovered += ", with checkpoints " + checkpointsText(r.Checkpoints)
	}
	switch {
	case r.State == idem.StateAbsent:
		fmt.Fprintf(con.out, "no record at %s: nothing to abandon\n", r.Key)
	case ended:
		fmt.Fprintf(con.out, "abandoned %s (attempt %d, token %d): its lease is over; the next claim takes the key over at once,\n%s\n",
			r.Key, r.Attempt, r.Token, recovered)
	case r.State == idem.StatePending:
		fmt.Fprintf(con.out, "nothing to abandon: the lease of %s (attempt %d, token %d) ran out %s ago; the next claim takes the key over,\n%s\n",
			r.Key, r.Attempt, r.Token, human(-r.LeaseLeft), recovered)
	case r.State == idem.StateCompleted:
		fmt.Fprintf(con.out, "nothing to abandon: %s is completed (token %d); its result replays\n", r.Key, r.Token)
	default:
		fmt.Fprintf(con.out, "nothing to abandon: %s is %s (token %d); the next claim runs the operation again\n", r.Key, r.State, r.Token)
	}
	return nil
}
