package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/idemkit/idem"
)

// pendingCmd lists the records in progress or abandoned, or with -all every
// record, as they come.
func pendingCmd(ctx context.Context, g *globals, args []string, con console) error {
	var (
		all  bool
		opts idem.ScanOptions
	)
	fs := flag.NewFlagSet("pending", flag.ContinueOnError)
	fs.SetOutput(con.err)
	fs.BoolVar(&all, "all", false, "list every record, completed and released ones too")
	fs.StringVar(&opts.PrefixMatch, "match", "", "a Redis glob standing in for the prefix, such as 'idem-demo:*:' for the demo's runs (default: -prefix, exactly)")
	fs.IntVar(&opts.Limit, "limit", 0, "stop after this many records (default: no limit)")
	fs.IntVar(&opts.Batch, "batch", idem.DefaultScanBatch, fmt.Sprintf("keys asked of Redis per SCAN and records read per round trip, at most %d", idem.MaxScanBatch))
	fs.BoolVar(&g.json, "json", g.json, "print one JSON object per record, one a line")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: pending takes no arguments; got %q", errUsage, fs.Args())
	}
	opts.State = idem.StatePending
	if all {
		opts.State = idem.StateAbsent // every state
	}
	c, err := connect(ctx, g, g.prefix)
	if err != nil {
		return err
	}
	defer c.Close()
	l := listing{con: con, json: g.json, width: keyWidth(len(g.prefix))}
	if opts.PrefixMatch != "" {
		l.width = keyWidth(len(opts.PrefixMatch) + 8)
	}
	for r, err := range c.keeper.Scan(ctx, opts) {
		if err != nil && r.Key == "" {
			if errors.Is(err, idem.ErrInvalidConfig) {
				return fmt.Errorf("%w: %w", errUsage, err)
			}
			return err // the listing ended
		}
		l.add(r, err)
	}
	return l.end(all)
}

// listing prints records as they come.
type listing struct {
	con    console
	json   bool
	width  int
	listed int // records printed
	failed int // records that could not be read
}

// add prints one record, or the error of one that could not be read.
func (l *listing) add(r idem.Record, err error) {
	if err != nil {
		l.failed++
		if l.json {
			printJSON(l.con.out, jsonRecord{Key: r.Key, ID: r.ID, State: "unreadable", Error: err.Error()})
		} else {
			fmt.Fprintf(l.con.err, "idemctl: %s: %v\n", r.Key, err)
		}
		return
	}
	if l.json {
		printJSON(l.con.out, toJSON(r))
	} else {
		if l.listed == 0 {
			listHeader(l.con.out, l.width)
		}
		listRow(l.con.out, l.width, r)
	}
	l.listed++
}

// end sums the listing up.
func (l *listing) end(all bool) error {
	if !l.json {
		what := "record"
		if !all {
			what = "pending record"
		}
		if l.listed != 1 {
			what += "s"
		}
		fmt.Fprintf(l.con.out, "%d %s\n", l.listed, what)
	}
	if l.failed > 0 {
		fmt.Fprintf(l.con.err, "idemctl: %d records could not be read\n", l.failed)
		return errFailed
	}
	return nil
}
