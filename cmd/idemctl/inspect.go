package main

import (
	"context"
	"flag"
)

// inspectCmd shows one record.
func inspectCmd(ctx context.Context, g *globals, args []string, con console) error {
	var t target
	fs := flag.NewFlagSet("inspect", flag.ContinueOnError)
	fs.SetOutput(con.err)
	t.flags(fs)
	fs.BoolVar(&g.json, "json", g.json, "print JSON instead of text")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := t.parse(fs); err != nil {
		return err
	}
	c, err := t.open(ctx, g)
	if err != nil {
		return err
	}
	defer c.Close()
	r, err := t.inspect(ctx, c)
	if err != nil {
		return err
	}
	if g.json {
		printJSON(con.out, toJSON(r))
	} else {
		printRecord(con.out, r)
	}
	return nil
}
