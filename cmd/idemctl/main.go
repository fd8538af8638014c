// Command idemctl looks at and removes idem's records in a Redis, for an
// operator: what happened to a key, which operations are running or were
// abandoned, and letting a customer use a key again.
//
// Usage:
//
//	idemctl [-redis URL | -cluster ADDRS] [-prefix P] [-scope-shards N] [-json] COMMAND ...
//
//	idemctl inspect [-scope S] KEY        state, token, attempt, lease, expiry, result, checkpoints of a record
//	idemctl inspect -record REDISKEY      the same, by the Redis key a listing shows
//	idemctl abandon [-scope S] [-token T] [-yes] KEY | -record REDISKEY
//	idemctl forget [-scope S] [-token T] [-force] [-yes] KEY | -record REDISKEY
//	idemctl pending [-all] [-match GLOB] [-limit N] [-batch N]
//
// A record is named by its scope and key, as the application gave them to
// idem (Do, Begin). A record of the HTTP middleware (package idemhttp) is
// named by the tenant its WithScope function returned for the request (empty
// by default, so -scope can be left out) and the Idempotency-Key header: the
// method and path are in the record's fingerprint, not in its name. The
// records of Keepers made with idem.WithScopeShards(N) are named so with
// -scope-shards N; without it, idemctl places a scope's keys as a Keeper
// made without the option does: in idem.ClusterScopeShards shards with
// -cluster, by their own digests with -redis.
//
// Redis keeps only a digest of the scope and key, so a listing (pending)
// shows Redis keys and ids, not the keys clients sent; inspect and forget take
// such a Redis key with -record. A message handled by idem.Consume has no
// record of its own but a compact claim, then a marker, in the prefix's
// index: inspect, abandon and forget of its scope and key find it there, and
// pending lists them by the call that claimed them (the index keeps 64 bits
// of each id's digest, not the id).
//
// inspect tells what Redis knows of a record: of a pending one, that a claim
// holds the key until its lease ends (a time by Redis's clock) and by which
// attempt, not whether its operation is running: a holder that stopped
// renewing (crashed, paused, cut off) loses the key then.
//
// abandon and forget show the record and ask before acting when their input
// is a terminal (a character device: from </dev/null they read no answer,
// which is no); -yes confirms without asking, and is required when the input
// is not a terminal. Both act on the record they showed, named by its token
// (or by -token, as an earlier inspect showed it): a claim made meanwhile, a
// redelivery say, is never the one they act on; they say so, and leave it
// alone.
//
// abandon is for a claim whose holder is known to be dead (its process was
// killed): it ends the lease and keeps the record, so that the next call
// takes the key over at once, told it is recovered (idem.Claim.Recovered),
// with the attempt count and the checkpoints. forget erases a record, so
// that the next call runs the operation as if the key had never been seen;
// it refuses, unless -force, a record whose lease is live (an operation may
// be running) or that holds checkpoints (steps that happened, which the next
// attempt would do again), and says what would be lost. Forced, the holder
// is fenced off (its completion fails with idem.ErrLeaseLost) and the next
// call runs the operation again from its first step.
//
// Output is text for people, or with -json one JSON object per record (one a
// line for pending). Exit status: 0 when the command did what it was asked
// (inspecting an absent record, forgetting one already gone, abandoning a
// claim whose lease was over or that was taken over included), 1 when it
// could not (Redis unreachable, a record unreadable, a command not
// confirmed, a forget refused, or one whose record was replaced by another
// since it was shown), 2 on bad usage.
//
// The demo's records (cmd/idem-demo -redis URL) live under a prefix of their
// own per run, "idem-demo:" and 8 hex digits: list them with
// idemctl -redis URL pending -all -match 'idem-demo:*:', then inspect or
// forget one with -record.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	redis.SetLogger(quietLogger{}) // every failure is reported once, by run
	os.Exit(run(ctx, os.Args[1:], stdConsole()))
}

// quietLogger drops go-redis's own log lines.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

// console is what the command talks to.
type console struct {
	in       io.Reader
	terminal bool // in is a terminal, where a person can confirm
	out, err io.Writer
}

// stdConsole is the process's standard input and outputs.
func stdConsole() console {
	fi, err := os.Stdin.Stat()
	return console{
		in:       os.Stdin,
		terminal: err == nil && fi.Mode()&os.ModeCharDevice != 0,
		out:      os.Stdout,
		err:      os.Stderr,
	}
}

// Exit statuses.
const (
	exitOK    = 0
	exitFail  = 1
	exitUsage = 2
)

// errUsage marks an error of the command line.
var errUsage = errors.New("usage")

// globals are the flags before the command.
type globals struct {
	redisURL string
	cluster  string
	prefix   string
	// shards is -scope-shards when shardsSet; else the Keeper's default.
	shards    int
	shardsSet bool
	json      bool
}

// run is the whole command; it returns the exit status.
func run(ctx context.Context, args []string, con console) int {
	var g globals
	fs := flag.NewFlagSet("idemctl", flag.ContinueOnError)
	fs.SetOutput(con.err)
	fs.StringVar(&g.redisURL, "redis", "", "Redis URL, redis:// or rediss:// as go-redis parses it (default redis://127.0.0.1:6379/0)")
	fs.StringVar(&g.cluster, "cluster", "", "Redis Cluster seed nodes, host:port,host:port,... (instead of -redis)")
	fs.StringVar(&g.prefix, "prefix", idem.DefaultPrefix, "the prefix of the store's Redis keys (idem.WithPrefix)")
	fs.IntVar(&g.shards, "scope-shards", 0, "the Keepers' idem.WithScopeShards, which a scope and key need to name a record (default: the Keepers' default, idem.ClusterScopeShards (16) with -cluster, none with -redis)")
	fs.BoolVar(&g.json, "json", false, "print JSON instead of text")
	fs.Usage = func() { usage(fs) }
	if err := parseFlags(fs, args); err != nil {
		return exitStatus(err, con)
	}
	fs.Visit(func(f *flag.Flag) { g.shardsSet = g.shardsSet || f.Name == "scope-shards" })
	if fs.NArg() == 0 {
		usage(fs)
		return exitUsage
	}
	cmd, ok := commands[fs.Arg(0)]
	if !ok {
		fmt.Fprintf(con.err, "idemctl: unknown command %q (inspect, abandon, forget or pending)\n", fs.Arg(0))
		return exitUsage
	}
	return exitStatus(cmd(ctx, &g, fs.Args()[1:], con), con)
}

// commands are the subcommands, by name.
var commands = map[string]func(ctx context.Context, g *globals, args []string, con console) error{
	"inspect": inspectCmd,
	"abandon": abandonCmd,
	"forget":  forgetCmd,
	"pending": pendingCmd,
}

// exitStatus prints err, if any, and returns the status it calls for.
func exitStatus(err error, con console) int {
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		return exitOK
	case errors.Is(err, errUsage):
		fmt.Fprintln(con.err, "idemctl:", err)
		return exitUsage
	case errors.Is(err, errBadFlags):
		return exitUsage // the flag package has said what is wrong
	case errors.Is(err, errFailed):
		return exitFail // already said
	}
	fmt.Fprintln(con.err, "idemctl:", err)
	return exitFail
}

// Errors already reported to the user.
var (
	// errFailed is a failure the command has reported.
	errFailed = errors.New("failed")
	// errBadFlags is a command line that the flag package has reported.
	errBadFlags = errors.New("bad flags")
)

// parseFlags parses args into fs, which reports what is wrong itself.
func parseFlags(fs *flag.FlagSet, args []string) error {
	err := fs.Parse(args)
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return err
	}
	return errBadFlags
}

func usage(fs *flag.FlagSet) {
	w := fs.Output()
	fmt.Fprint(w, `Usage: idemctl [-redis URL | -cluster ADDRS] [-prefix P] [-scope-shards N] [-json] COMMAND ...

  inspect [-scope S] KEY | -record REDISKEY
        show a record: state, token, attempt, lease, expiry, result, checkpoints
  abandon [-scope S] [-token T] [-yes] KEY | -record REDISKEY
        end the lease of a claim whose holder is dead, keeping the record: the
        next call takes it over at once, recovered (asks first on a terminal)
  forget [-scope S] [-token T] [-force] [-yes] KEY | -record REDISKEY
        remove a record so that its key runs again (asks first on a terminal)
  pending [-all] [-match GLOB] [-limit N] [-batch N]
        list the records in progress or abandoned (-all: every record); the
        compact claims and markers of idem.Consume are listed by the call
        that claimed them, their ids being kept as digests only

A record of the HTTP middleware is named by its tenant (-scope, what
idemhttp.WithScope returned; empty by default) and its Idempotency-Key.
"idemctl COMMAND -h" describes a command's flags.

Flags:
`)
	fs.PrintDefaults()
}
