// Package minitime makes the TIME of an embedded miniredis strictly
// increase, so that the fencing tokens the scripts make from it never repeat
// for a key while the test's clock stands still.
//
// A miniredis whose clock was set (SetTime) answers TIME with that instant
// until it is set again. A script that claims a key with no record makes its
// token from TIME, so after a record is removed (Forget) a claim at the same
// instant gets the token of the removed one again, and a stale holder of
// that token is taken for the new one. Real Redis is not affected: its clock
// moves between any two scripts.
//
// Install answers every TIME, a script's included, with the instant the
// owner set (Set), or a microsecond after the last TIME answered if that is
// not earlier: two answers are never equal, and none is earlier than an
// answer before it. Key expiry is left to miniredis's own clock, so time to
// live is not disturbed. A TIME inside a MULTI block is left to miniredis,
// which answers its own clock at EXEC.
package minitime

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/alicebob/miniredis/v2/server"
	"github.com/redis/go-redis/v9"
)

// Time is the TIME of one miniredis. It is safe for concurrent use.
type Time struct {
	m *miniredis.Miniredis

	mu sync.Mutex
	// base is the instant the owner set, in microseconds since 1970; last
	// is the last TIME answered; inMulti holds the connections in a MULTI
	// block, whose TIME miniredis queues itself. Guarded by mu.
	base, last int64
	inMulti    map[*server.Peer]bool

	// errMsg, when set, is answered to every command instead (SetError).
	errMsg atomic.Pointer[string]
	// seen counts the commands the hook saw: a command whose count did not
	// move ran without it (miniredis.SetError replaced it); unseen is set
	// after such a command (Hook).
	seen   atomic.Uint64
	unseen atomic.Bool
}

// Install makes m answer TIME as the package says, from now on, starting at
// now (which must be the instant m was set to); it returns the Time, whose
// Set the owner calls whenever it sets m's clock.
func Install(m *miniredis.Miniredis, now time.Time) *Time {
	t := &Time{m: m, base: now.UnixMicro(), last: now.UnixMicro() - 1, inMulti: map[*server.Peer]bool{}}
	m.Server().SetPreHook(t.hook)
	return t
}

// Set tells t that m's clock was set to now. TIME goes on from now, or from
// just after its last answer if that is later: it never goes back.
func (t *Time) Set(now time.Time) {
	t.mu.Lock()
	t.base = now.UnixMicro()
	t.mu.Unlock()
}

// SetError makes every command answer the error reply msg, as
// miniredis.SetError does, until SetError(""); unlike miniredis.SetError it
// keeps TIME as the package says once msg is cleared.
func (t *Time) SetError(msg string) {
	if msg == "" {
		t.errMsg.Store(nil)
		return
	}
	t.errMsg.Store(&msg)
}

// hook is m's pre-command hook: it answers TIME, and the error set by
// SetError; it leaves every other command to miniredis.
func (t *Time) hook(c *server.Peer, cmd string, args ...string) bool {
	t.seen.Add(1)
	if msg := t.errMsg.Load(); msg != nil {
		c.WriteError(*msg)
		return true
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	switch cmd {
	case "MULTI":
		t.inMulti[c] = true
		return false
	case "EXEC", "DISCARD":
		delete(t.inMulti, c)
		return false
	case "TIME":
	default:
		return false
	}
	if len(args) != 0 || t.inMulti[c] {
		return false // miniredis answers the error, or queues the command
	}
	t.last = max(t.base, t.last+1)
	c.WriteLen(2)
	c.WriteBulk(strconv.FormatInt(t.last/1_000_000, 10))
	c.WriteBulk(strconv.FormatInt(t.last%1_000_000, 10))
	return true
}

// Hook returns a go-redis hook for the clients of m that copes with
// miniredis's own SetError, which replaces t's hook (and SetError("") leaves
// none): after a command that ran without t's hook, the next command first
// sets miniredis's own clock to just after the last TIME answered, so that
// TIME still increases if it runs without the hook too; and a command that
// ran without the hook and succeeded puts it back. The guarantee then holds
// for the commands of those clients, except one sent right after a
// SetError("") that no command of theirs saw the error of; and a
// SetError(msg) that lands between a command and the hook's return is
// undone. Use t.SetError instead, which has neither limit.
func (t *Time) Hook() redis.Hook { return reinstall{t} }

type reinstall struct{ t *Time }

func (r reinstall) DialHook(next redis.DialHook) redis.DialHook { return next }

func (r reinstall) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		before := r.t.before()
		err := next(ctx, cmd)
		r.t.after(before, err)
		return err
	}
}

func (r reinstall) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		before := r.t.before()
		err := next(ctx, cmds)
		r.t.after(before, err)
		return err
	}
}

// before is called as a command is sent: if the last one ran without the
// hook, it moves miniredis's own clock past the last TIME answered. It
// returns the count of commands the hook saw.
func (t *Time) before() uint64 {
	if t.unseen.Load() {
		t.mu.Lock()
		t.last = max(t.base, t.last+1)
		at := time.UnixMicro(t.last)
		t.mu.Unlock()
		t.m.SetTime(at)
	}
	return t.seen.Load()
}

// after is called once a command answered err: if the hook did not see it,
// the hook is missing, and is put back if the command succeeded (redis.Nil
// is an answer), which no error hook would let it.
func (t *Time) after(before uint64, err error) {
	if t.seen.Load() != before {
		t.unseen.Store(false)
		return
	}
	if err == nil || err == redis.Nil {
		t.m.Server().SetPreHook(t.hook)
		t.unseen.Store(false)
		return
	}
	t.unseen.Store(true)
}
