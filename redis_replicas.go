package idem

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrNotReplicated reports that a write reached the Redis master but fewer
// replicas than WithReplicas asks for acknowledged it within its timeout. The
// error is a *ReplicationError; errors.Is(err, ErrUnavailable) also reports
// true for it, because the store could not give the durability it was asked
// for.
var ErrNotReplicated = errors.New("idem: write not acknowledged by enough replicas")

// ReplicationError is returned by a Keeper made WithReplicas when a claim,
// a completion or a lease extension was written on the master but fewer than
// Wanted replicas acknowledged it in time. errors.Is reports true for
// ErrNotReplicated and ErrUnavailable.
//
// The write was not undone: the master holds it, and it is lost only if the
// master fails before a replica copies it and a replica is promoted. So:
//
//   - after a claim (Keeper.Begin, Do): the caller does not get the claim and
//     must not run the operation; the record stays pending on the master until
//     the lease runs out, and a retry then claims it with Claim.Recovered set
//     (or, if a failover lost the pending record, claims it afresh);
//   - after a completion (Claim.Complete, Do): the operation ran and its result
//     is stored on the master, where retries find it; if a failover loses it,
//     a retry runs the operation again. Treat the error as "outcome stored
//     without the asked-for guarantee", not as a failure of the operation;
//   - after an extension (Claim.Extend, Claim.KeepAlive): the lease end that
//     the Claim trusts is not moved, so KeepAlive cancels the operation when
//     the old lease runs out unless a later extension gets through.
type ReplicationError struct {
	// Op is the step that was written: "claim", "complete" or "extend".
	Op string
	// Acked is how many replicas acknowledged the write: what WAIT answered,
	// or 0 when WAIT itself failed (Err).
	Acked int
	// Wanted is the n of WithReplicas.
	Wanted int
	// Err is WAIT's own error, if it failed; nil when it timed out.
	Err error
}

// Error implements error.
func (e *ReplicationError) Error() string {
	s := fmt.Sprintf("%s: %s acknowledged by %d of %d replicas", ErrNotReplicated.Error(), e.Op, e.Acked, e.Wanted)
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Is reports whether target is ErrNotReplicated or ErrUnavailable.
func (e *ReplicationError) Is(target error) bool {
	return target == ErrNotReplicated || target == ErrUnavailable
}

// Unwrap returns WAIT's own error, if any.
func (e *ReplicationError) Unwrap() error { return e.Err }

// WithReplicas makes the store wait, after every claim, completion and lease
// extension it writes, until n replicas have acknowledged the write or timeout
// has passed (Redis WAIT). WAIT is sent in the same round trip as the script,
// pipelined on the same connection, so the option costs no extra round trip
// when the replicas keep up, and at most timeout when they do not. When fewer
// than n acknowledge, the call fails with a *ReplicationError (ErrNotReplicated,
// also ErrUnavailable); its documentation says what state the record is in
// then. Releases and replays do not wait: losing a release only delays a
// retry until the lease runs out.
//
// Redis replicates asynchronously; without this option a failover can lose the
// newest claims and results, and a retry may then run an operation again. WAIT
// narrows that window to writes that failed with ReplicationError, but it does
// not make Redis strongly consistent: a failover may still promote a replica
// that had not acknowledged (n smaller than the number of replicas), and the
// master's own copy is lost if it restarts without persistence.
//
// One gap remains: WAIT counts the replicas that have every write made on its
// connection. If the connection breaks after the script ran and before its
// reply arrived, go-redis sends the script and WAIT again on a new connection
// (MaxRetries); the script finds its own write done and writes nothing, and
// WAIT then does not cover the first write. Set the client's MaxRetries to -1
// to close the gap; a broken connection is then an ErrUnavailable error.
//
// The client must be a *redis.Client (including a failover client), a
// *redis.Conn or a *redis.ClusterClient. On a Cluster the script and WAIT go
// together to the node that holds the record's slot, and the store follows
// MOVED and ASK redirects itself, through go-redis's client of the node named;
// during a slot migration WAIT then counts the replicas of the node that
// imports the slot, where the record is written. The one node it cannot reach
// is one that serves no slot yet (a new node importing its first slot): calls
// that create records in that slot fail with ErrUnavailable until its
// migration ends.
//
// n must be at least 1, timeout at least 1ms and shorter than the client's
// ReadTimeout. Anything else is refused by NewRedis with
// ErrInvalidConfig. Default: no waiting. Applies to a Keeper (NewRedis).
func WithReplicas(n int, timeout time.Duration) Option {
	return Option{name: "WithReplicas", to: toStore, set: func(s *settings) { s.replicas = &durability{replicas: n, timeout: timeout} }}
}

// durability is the setting of WithReplicas.
type durability struct {
	replicas int
	timeout  time.Duration
}

// onePipeliner is a client whose pipelines run on one connection.
type onePipeliner interface {
	redis.Scripter
	Pipeline() redis.Pipeliner
}

// check refuses settings and clients that cannot honour WithReplicas.
func (d *durability) check(client redis.Scripter) error {
	if d.replicas < 1 {
		return fmt.Errorf("%w: WithReplicas: %d replicas, want at least 1", ErrInvalidConfig, d.replicas)
	}
	if d.timeout < time.Millisecond {
		return fmt.Errorf("%w: WithReplicas: timeout %s is shorter than 1ms", ErrInvalidConfig, d.timeout)
	}
	var readTimeout time.Duration
	switch c := client.(type) {
	case *redis.Client:
		readTimeout = c.Options().ReadTimeout
	case *redis.ClusterClient:
		readTimeout = c.Options().ReadTimeout
	case *redis.Conn:
	default:
		return fmt.Errorf("%w: WithReplicas needs a *redis.Client, *redis.Conn or *redis.ClusterClient, so that WAIT runs on the connection that wrote; got %T", ErrInvalidConfig, client)
	}
	if readTimeout > 0 && d.timeout >= readTimeout {
		return fmt.Errorf("%w: WithReplicas: timeout %s is not shorter than the client's ReadTimeout %s", ErrInvalidConfig, d.timeout, readTimeout)
	}
	return nil
}

// waitsAfter returns the name of the step sc writes, if WithReplicas waits
// after it, or "".
func waitsAfter(sc *luaScript) string {
	switch sc {
	case claimScript:
		return "claim"
	case completeScript:
		return "complete"
	case extendScript:
		return "extend"
	}
	return ""
}

// maxClusterRedirects bounds how often a Cluster call is sent again after a
// redirect or a refusal (MOVED, ASK, TRYAGAIN, CLUSTERDOWN: the script did not
// run where it was sent).
const maxClusterRedirects = 4

// run sends sc and WAIT for the step op, and turns a write that too few
// replicas acknowledged into a *ReplicationError.
func (d *durability) run(ctx context.Context, client redis.Scripter, op string, sc *luaScript, keys []string, args ...any) *redis.Cmd {
	var script *redis.Cmd
	var wait *redis.IntCmd
	if cc, ok := client.(*redis.ClusterClient); ok {
		script, wait = d.sendCluster(ctx, cc, sc, keys, args)
	} else {
		script, wait = d.send(ctx, client.(onePipeliner), false, sc, keys, args)
	}
	return d.settle(op, script, wait)
}

// send sends sc (EVALSHA) and WAIT in one pipeline on p, so that WAIT covers
// the script's write. With asking, ASKING goes first: p is the node that
// imports the key's slot, named by an ASK redirect. When p has lost the script
// (NOSCRIPT: a restart, SCRIPT FLUSH, a node that never saw it), send loads it
// on p and sends once more; the script did not run.
func (d *durability) send(ctx context.Context, p onePipeliner, asking bool, sc *luaScript, keys []string, args []any) (*redis.Cmd, *redis.IntCmd) {
	for loaded := false; ; loaded = true {
		pipe := p.Pipeline()
		if asking {
			_ = pipe.Process(ctx, redis.NewStatusCmd(ctx, "asking"))
		}
		script := pipe.EvalSha(ctx, sc.Hash(), keys, args...)
		wait := redis.NewIntCmd(ctx, "wait", d.replicas, d.timeout.Milliseconds())
		_ = pipe.Process(ctx, wait)
		_, _ = pipe.Exec(ctx)
		if loaded || !redis.HasErrorPrefix(script.Err(), "NOSCRIPT") || sc.Load(ctx, p).Err() != nil {
			return script, wait
		}
	}
}

// sendCluster sends sc and WAIT to the master of the key's slot, and follows
// the Cluster's redirects itself: go-redis follows them for the commands it
// routes, but the pipeline goes to a node's own client, which does not.
func (d *durability) sendCluster(ctx context.Context, cc *redis.ClusterClient, sc *luaScript, keys []string, args []any) (*redis.Cmd, *redis.IntCmd) {
	node, err := cc.MasterForKey(ctx, keys[0])
	if err != nil {
		cmd := redis.NewCmd(ctx)
		cmd.SetErr(err)
		return cmd, nil
	}
	asking := false
	for try := 0; ; try++ {
		script, wait := d.send(ctx, node, asking, sc, keys, args)
		if script.Err() == nil {
			return script, wait
		}
		var ok bool
		if node, asking, ok = redirect(ctx, cc, keys[0], script.Err(), try); !ok {
			return script, wait
		}
	}
}

// redirect says where a Cluster call goes next after its pipeline failed with
// err on its try-th sending (from 0), with asking if ASKING must go first, or
// ok false if the call is not sent again and fails with err:
//
//   - MOVED: the slot has a new owner. The call goes there at once, and the
//     client learns the new slot map (nodeAt reloads it), so that later calls
//     go there directly.
//   - ASK: the slot is migrating and the key is not on its old owner (a new
//     key, or one already moved). The call goes to the importing node, after
//     ASKING. The slot map is not changed by a migration until it ends, and
//     the redirect holds for this key only.
//   - TRYAGAIN, CLUSTERDOWN, or MOVED or ASK to a node that is not in the
//     client's slot map: after a backoff, the call goes to the master of the
//     slot again.
//   - anything else, or maxClusterRedirects reached: the call fails. After a
//     network error the client reloads the slot map: the node may be gone.
//
// In each of the first three cases the script did not run where it was sent,
// so sending it again is safe; a script recognises its own earlier run anyway.
func redirect(ctx context.Context, cc *redis.ClusterClient, key string, err error, try int) (next *redis.Client, asking, ok bool) {
	if try >= maxClusterRedirects || !isClusterRedirect(err) {
		if !isRedisReply(err) {
			cc.ReloadState(ctx)
		}
		return nil, false, false
	}
	if addr, ask, found := redirectAddr(err); found {
		if node := nodeAt(ctx, cc, addr); node != nil {
			return node, ask, true
		}
	}
	if sleepOrDone(ctx, time.Duration(10<<try)*time.Millisecond) != nil {
		return nil, false, false
	}
	node, merr := cc.MasterForKey(ctx, key)
	return node, false, merr == nil
}

// redirectAddr returns the node address a MOVED or ASK error names, in the
// host:port form of go-redis's node clients (Redis writes an IPv6 address
// without brackets), and whether it is an ASK.
func redirectAddr(err error) (addr string, ask, ok bool) {
	if addr, ok = redis.IsAskError(err); ok {
		ask = true
	} else if addr, ok = redis.IsMovedError(err); !ok {
		return "", false, false
	}
	if i := strings.LastIndexByte(addr, ':'); i > 0 && addr[0] != '[' {
		addr = net.JoinHostPort(addr[:i], addr[i+1:])
	}
	return addr, ask, true
}

// nodeAt returns go-redis's own client of the Cluster node at addr, or nil if
// the client's slot map, reloaded, does not list it. A node client's
// NodeAddress is the address the Cluster reports, as in MOVED and ASK; its
// Addr may differ, where go-redis rewrote a loopback address.
//
// go-redis keeps a client per node but has no lookup by address, and
// ForEachShard, which visits every node of the slot map, first reloads the map
// (a CLUSTER SLOTS round trip). Redirects happen during failovers and slot
// migrations only, so the round trip is paid rarely, and it leaves the client
// with the current map. The store does not dial clients of its own (it uses
// only the client it is given), so a node that serves no slot yet, and so is
// not in the map, is out of reach: the target of the first slot migrated to a
// new node. Calls that create records in that slot fail while it migrates.
func nodeAt(ctx context.Context, cc *redis.ClusterClient, addr string) *redis.Client {
	var found atomic.Pointer[redis.Client]
	_ = cc.ForEachShard(ctx, func(_ context.Context, c *redis.Client) error {
		if c.NodeAddress() == addr || c.Options().Addr == addr {
			found.Store(c)
		}
		return nil
	})
	return found.Load()
}

// settle returns script, with a *ReplicationError in place of its reply if the
// script wrote but WAIT did not see enough replicas acknowledge the write.
func (d *durability) settle(op string, script *redis.Cmd, wait *redis.IntCmd) *redis.Cmd {
	if !scriptWrote(script) {
		return script
	}
	acked, werr := wait.Result()
	if werr == nil && acked >= int64(d.replicas) {
		return script
	}
	if werr != nil {
		acked = 0
	}
	script.SetErr(&ReplicationError{Op: op, Acked: int(acked), Wanted: d.replicas, Err: werr})
	return script
}

// scriptWrote reports whether a script answered a positive integer (a new
// claim's token; completed or extended: 1) or {1, ...}: claimed, completed
// or extended.
func scriptWrote(cmd *redis.Cmd) bool {
	res, err := cmd.Result()
	if n, ok := res.(int64); ok {
		return err == nil && n > 0
	}
	r, _ := res.([]any)
	c := replyCode(r)
	return err == nil && (c == claimExisting || c == transitionDone)
}

// isClusterRedirect reports whether err refuses a Cluster command before it
// ran, in a way that sending it again may cure: MOVED, ASK, TRYAGAIN or
// CLUSTERDOWN.
func isClusterRedirect(err error) bool {
	if _, ok := redis.IsMovedError(err); ok {
		return true
	}
	if _, ok := redis.IsAskError(err); ok {
		return true
	}
	return redis.IsTryAgainError(err) || redis.IsClusterDownError(err)
}

// isRedisReply reports whether err is an error reply from Redis, rather than
// a network or context error.
func isRedisReply(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
}

func sleepOrDone(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-t.C:
		return nil
	}
}
