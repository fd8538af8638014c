package idem

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrNotReplicated reports that a write reached the Redis master but fewer
// replicas than WithReplicas asks for acknowledged it within its timeout. The
// error is a *ReplicationError; errors.Is(err, ErrUnavailable) also reports
// true for it, because the store could not give the durability it was asked
// for.
var ErrNotReplicated = errors.New("idem: write not acknowledged by enough replicas")

// ReplicationError is returned by a RedisStore made WithReplicas when a claim,
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
// *redis.Conn or a *redis.ClusterClient; on a Cluster, WAIT goes to the master
// of the record's slot over the connection that ran the script. n must be at
// least 1, timeout at least 1ms and shorter than the client's ReadTimeout.
// Anything else is refused by NewRedisStore with ErrInvalidConfig. Default: no
// waiting.
func WithReplicas(n int, timeout time.Duration) RedisOption {
	return func(s *RedisStore) { s.durable = &durability{replicas: n, timeout: timeout} }
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
func waitsAfter(sc *redis.Script) string {
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

// runScript runs sc as Script.Run does (EVALSHA, then EVAL on NOSCRIPT), and
// with WithReplicas, for the steps that need it, pipelines WAIT after it.
func (s *RedisStore) runScript(ctx context.Context, sc *redis.Script, keys []string, args ...any) *redis.Cmd {
	if s.durable != nil {
		if op := waitsAfter(sc); op != "" {
			return s.durable.run(ctx, s.client, op, sc, keys, args...)
		}
	}
	return sc.Run(ctx, s.client, keys, args...)
}

// maxClusterRedirects bounds how often a Cluster call is tried again after the slot
// of its key moved (MOVED, ASK, TRYAGAIN, CLUSTERDOWN: the script did not run).
const maxClusterRedirects = 4

func (d *durability) run(ctx context.Context, client redis.Scripter, op string, sc *redis.Script, keys []string, args ...any) *redis.Cmd {
	cc, cluster := client.(*redis.ClusterClient)
	loaded := false
	for try := 0; ; try++ {
		var p onePipeliner
		if cluster {
			node, err := cc.MasterForKey(ctx, keys[0])
			if err != nil {
				cmd := redis.NewCmd(ctx)
				cmd.SetErr(err)
				return cmd
			}
			p = node
		} else {
			p = client.(onePipeliner)
		}
		pipe := p.Pipeline()
		script := pipe.EvalSha(ctx, sc.Hash(), keys, args...)
		wait := redis.NewIntCmd(ctx, "wait", d.replicas, d.timeout.Milliseconds())
		_ = pipe.Process(ctx, wait)
		_, _ = pipe.Exec(ctx)
		err := script.Err()
		switch {
		case err == nil:
		case redis.HasErrorPrefix(err, "NOSCRIPT") && !loaded:
			// The server lost its script cache (restart, SCRIPT FLUSH, a new
			// master): load the script where the pipeline runs, and try once
			// more. The script did not run.
			loaded = true
			if lerr := sc.Load(ctx, p).Err(); lerr != nil {
				return script
			}
			continue
		case cluster && try < maxClusterRedirects && isClusterRedirect(err):
			// The slot moved or the cluster is changing: the script did not
			// run. Let the client learn the new slot map and try again.
			cc.ReloadState(ctx)
			if serr := sleepOrDone(ctx, time.Duration(10<<try)*time.Millisecond); serr != nil {
				return script
			}
			continue
		default:
			if cluster && !isRedisReply(err) {
				cc.ReloadState(ctx)
			}
			return script
		}
		if !scriptWrote(script) {
			return script
		}
		acked, werr := wait.Result()
		if werr != nil || acked < int64(d.replicas) {
			if werr != nil {
				acked = 0
			}
			script.SetErr(&ReplicationError{Op: op, Acked: int(acked), Wanted: d.replicas, Err: werr})
		}
		return script
	}
}

// scriptWrote reports whether a script answered {1, ...}: claimed, completed or
// extended.
func scriptWrote(cmd *redis.Cmd) bool {
	res, err := cmd.Slice()
	return err == nil && replyCode(res) == 1
}

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
