package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/idemkit/idem"
)

// target is the record that inspect and forget name: by scope and key, or
// by the Redis key a listing shows (-record).
type target struct {
	scope  string
	key    string
	record string
}

// flags adds -scope and -record to fs.
func (t *target) flags(fs *flag.FlagSet) {
	fs.StringVar(&t.scope, "scope", "", "the scope the key was used under: the tenant of an idemhttp record (default: none)")
	fs.StringVar(&t.record, "record", "", "the record's Redis key, as pending lists it, instead of a scope and key")
}

// parse takes the key from the arguments left after fs's flags.
func (t *target) parse(fs *flag.FlagSet) error {
	switch {
	case t.record != "" && (fs.NArg() > 0 || t.scope != ""):
		return fmt.Errorf("%w: %s: -record names the record alone, without KEY or -scope", errUsage, fs.Name())
	case t.record != "":
		return nil
	case fs.NArg() != 1:
		return fmt.Errorf("%w: %s takes one KEY (or -record REDISKEY); got %d arguments", errUsage, fs.Name(), fs.NArg())
	}
	t.key = fs.Arg(0)
	return nil
}

// open connects to the Redis of g with the store that holds the record.
func (t *target) open(ctx context.Context, g *globals) (*conn, error) {
	prefix := g.prefix
	if t.record != "" {
		var err error
		if prefix, _, err = splitRecordKey(t.record); err != nil {
			return nil, err
		}
	}
	return connect(ctx, g, prefix)
}

// inspect reads the record.
func (t *target) inspect(ctx context.Context, c *conn) (idem.Record, error) {
	var (
		r   idem.Record
		err error
	)
	if t.record != "" {
		_, id, _ := splitRecordKey(t.record)
		r, err = c.keeper.InspectRecord(ctx, id)
	} else {
		r, err = c.keeper.Inspect(ctx, t.scope, t.key)
	}
	if errors.Is(err, idem.ErrInvalidKey) {
		return r, fmt.Errorf("%w: %w", errUsage, err)
	}
	return r, err
}

// shown is the target of a command that acts on the record it shows, named
// by its fencing token (forget, abandon), with the flags they share: -yes
// and -token (and -json).
type shown struct {
	target
	yes   bool
	token int64
}

// flags adds the target's flags, -yes, -token and -json to fs; yes and
// token say what the command does without asking, or by the token.
func (s *shown) flags(fs *flag.FlagSet, g *globals, yes, token string) {
	s.target.flags(fs)
	fs.BoolVar(&s.yes, "yes", false, yes+" without asking (required when the input is not a terminal)")
	fs.Int64Var(&s.token, "token", 0, token+" only if its token is this one, as inspect showed it (default: the token of the record shown now)")
	fs.BoolVar(&g.json, "json", g.json, "print JSON instead of text")
}

// open parses args, opens the store and reads the record the command shows
// and acts on. The caller closes the connection.
func (s *shown) open(ctx context.Context, g *globals, fs *flag.FlagSet, args []string) (*conn, idem.Record, error) {
	if err := parseFlags(fs, args); err != nil {
		return nil, idem.Record{}, err
	}
	if err := s.parse(fs); err != nil {
		return nil, idem.Record{}, err
	}
	if s.token < 0 {
		return nil, idem.Record{}, fmt.Errorf("%w: %s: -token %d is not a token", errUsage, fs.Name(), s.token)
	}
	c, err := s.target.open(ctx, g)
	if err != nil {
		return nil, idem.Record{}, err
	}
	r, err := s.inspect(ctx, c)
	if err != nil {
		c.Close()
		return nil, idem.Record{}, err
	}
	return c, r, nil
}
