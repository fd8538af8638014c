package idem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Claim is the right to run one operation, held until Complete or Release, or
// until the lease runs out and another attempt takes it over. A Claim is safe
// for concurrent use.
//
// A nil *Claim, which ClaimFromContext returns for a context that carries
// none, is safe to use: its accessors return zero values and its steps
// (Complete, Release, Extend, Checkpoint) return ErrNoClaim. KeepAlive
// needs a claim.
type Claim struct {
	k         *Keeper
	id        string
	token     int64
	attempt   int
	recovered bool
	// scope and key are what the claim was asked for with (Begin, Do,
	// batchBegin); claimedAt is when, by the Keeper's clock, and inRequest
	// whether for a layer's request (Event.InRequest), for the Observer.
	scope, key string
	claimedAt  time.Time
	inRequest  bool
	// fp is the fingerprint digest the claim was made with, known when
	// fpKnown (a claim of Begin), for the replay cache.
	fp      string
	fpKnown bool

	// hold, when set, is told once the claim is settled or known lost: the
	// shard of the coalescing layer that made the claim ends its in-process
	// hold. It is set before the claim is handed out, and read-only after.
	hold *flightShard

	mu sync.Mutex
	// leaseEnd is when the lease runs out by this process's clock, measured
	// from before the request that last set it was sent, so it is never later
	// than Redis's view.
	leaseEnd time.Time
	// ref is the store's reference to a claim it keeps compactly
	// (claimReply.Ref); zero once the claim has a record of its own.
	ref int
	// lease is the claim's lease: the Keeper's, or that of the call that
	// made it (Consume's WithLease). Read-only.
	lease time.Duration
	// marks is set for a claim of a call that claims compactly (Consume,
	// batchBegin with withCompactClaims), compact or not (a takeover, a
	// claim after a release is a record): its completion with an empty
	// result is remembered for the marker retention. Read-only.
	marks bool
	// checkpoints are the record's recovery points as this claim knows them:
	// those it took over, then those it recorded (see Checkpoint).
	checkpoints []recoveryPoint
}

// Token returns the fencing token: it strictly increases every time the key
// is claimed again and is never handed out twice for a key. Pass it on to
// downstream writes so that they can refuse a stale holder. 0 for a nil
// Claim.
func (c *Claim) Token() int64 {
	if c == nil {
		return 0
	}
	return c.token
}

// Attempt returns how many times the key has been claimed, this claim
// included; 1 for the first. 0 for a nil Claim.
func (c *Claim) Attempt() int {
	if c == nil {
		return 0
	}
	return c.attempt
}

// Recovered reports whether this claim took over a lease that had run out: an
// earlier attempt may have partly run, so reconcile before acting again.
// False for a nil Claim.
func (c *Claim) Recovered() bool { return c != nil && c.recovered }

// Scope returns the scope the claim was made under, as the caller gave it
// to Begin, Do or Consume; under the HTTP middleware, the tenant named by
// its scope function, and under the gRPC interceptor, the full method, a
// space and the tenant. "" for a nil Claim.
func (c *Claim) Scope() string {
	if c == nil {
		return ""
	}
	return c.scope
}

// Key returns the key the claim holds, as the caller gave it (the client's
// Idempotency-Key, a message id): the process keeps it, Redis holds only a
// digest of it. "" for a nil Claim.
func (c *Claim) Key() string {
	if c == nil {
		return ""
	}
	return c.key
}

// Held reports, by this process's clock alone (no round trip), whether the
// claim's lease has more than margin left: nil if it has; an error wrapping
// ErrLeaseLost if it has not, or ErrNoClaim for a nil Claim. Call it just
// before a side effect: a process paused past its lease (SIGSTOP, a frozen
// VM, a long stall) may resume before its work's context is cancelled,
// while another attempt holds the key. The lease end moves only when a
// renewal succeeds, measured from before the renewal was sent, so it is
// never later than Redis's; margin covers the time the side effect takes
// to land. It narrows the gap, it cannot close it: a pause may come after
// the check. What closes it is the fencing token (Token) written with the
// side effect, which the downstream system checks (docs/consumers.md).
func (c *Claim) Held(margin time.Duration) error {
	if c == nil {
		return errNoClaim("Held")
	}
	if left := c.localLeaseEnd().Sub(c.k.now()); left <= margin {
		return fmt.Errorf("%w: %v of the lease left by this process's clock, not more than the margin of %v", ErrLeaseLost, left.Round(time.Millisecond), margin)
	}
	return nil
}

// Complete stores value as the operation's result, replayed to every later
// Begin with the key for retention (zero or less means the Keeper's
// retention; more than MaxDuration is refused with ErrInvalidConfig, nothing
// written). It returns ErrLeaseLost if the claim is no longer the holder;
// nothing is written then.
func (c *Claim) Complete(ctx context.Context, value []byte, retention time.Duration) error {
	if c == nil {
		return errNoClaim("complete")
	}
	return c.complete(ctx, kindBytes, value, retention)
}

func (c *Claim) complete(ctx context.Context, kind byte, body []byte, retention time.Duration) error {
	return c.completeSealed(ctx, seal(kind, body), retention)
}

// completeSealed stores env, a result in its envelope, as complete does.
func (c *Claim) completeSealed(ctx context.Context, env []byte, retention time.Duration) error {
	if retention <= 0 {
		retention = c.k.policy.retention
	}
	if retention > MaxDuration {
		return fmt.Errorf("%w: retention %s is longer than MaxDuration", ErrInvalidConfig, retention)
	}
	kind, body := env[1], env[2:]
	started := c.k.startStep()
	var sent time.Time
	if c.k.cache != nil {
		sent = c.k.now()
	}
	stored, err := c.storeComplete(ctx, env, retention)
	err = storeError(ctx, "complete", err)
	if stored && err == nil {
		// Only what the store says this call stored: a record completed by
		// this claim already keeps its first result and retention.
		c.k.cacheStored(c, kind, body, retention, sent)
	}
	// The coalescing layer's hold ends at the claim's first Complete, whose
	// body is what the record holds when it succeeds (a run sent again after
	// a lost reply stores the same body).
	c.endHold(kind, body, err)
	c.report(ctx, StepComplete, started, err)
	return err
}

// Release gives the claim up so that the next Begin with the key runs the
// operation again, with a higher token. It returns ErrLeaseLost if the claim
// is no longer the holder.
func (c *Claim) Release(ctx context.Context) error {
	if c == nil {
		return errNoClaim("release")
	}
	started := c.k.startStep()
	err := storeError(ctx, "release", c.storeRelease(ctx))
	c.endHold(0, nil, err)
	c.report(ctx, StepRelease, started, err)
	return err
}

// Extend renews the lease for the claim's lease from now: the Keeper's, or
// the one Consume was given (WithLease). It returns ErrLeaseLost if the
// claim is no longer the holder.
func (c *Claim) Extend(ctx context.Context) error {
	if c == nil {
		return errNoClaim("extend")
	}
	started := c.k.now()
	err := c.storeExtend(ctx)
	if c.k.observer != nil {
		c.report(ctx, StepExtend, started, storeError(ctx, "extend", err))
	}
	if err != nil {
		err = storeError(ctx, "extend", err)
		if errors.Is(err, ErrLeaseLost) {
			c.endHold(0, nil, err)
		}
		return err
	}
	c.leaseRenewed(started)
	return nil
}

// leaseRenewed moves the local lease end to a lease from started, when a
// renewal sent at started went through, unless it is already later.
func (c *Claim) leaseRenewed(started time.Time) {
	c.mu.Lock()
	if end := started.Add(c.lease); end.After(c.leaseEnd) {
		c.leaseEnd = end
	}
	c.mu.Unlock()
}

// storeComplete stores env, kept for keep, as the claim's result: in its
// record, or, for a compact claim, in the record of the call that made it.
// It reports whether the store says this call stored env (recordStore.Complete);
// a compact claim's completion reports false, so that nothing the store may
// not hold is cached.
func (c *Claim) storeComplete(ctx context.Context, env []byte, keep time.Duration) (stored bool, err error) {
	f := c.fence()
	env, keep = c.k.asMarker(f, c, env, keep)
	if f.Ref > 0 {
		done, _ := c.k.store.SettleBatch(ctx, []batchCompletion{{claimFence: f, Value: env, Keep: keep}}, nil, 0)
		return false, done[0]
	}
	return c.k.store.Complete(ctx, c.id, c.token, env, keep)
}

// storeRelease gives the claim up in the store.
func (c *Claim) storeRelease(ctx context.Context) error {
	if f := c.fence(); f.Ref > 0 {
		_, given := c.k.store.SettleBatch(ctx, nil, []claimFence{f}, c.k.policy.tombstoneTTL())
		return given[0]
	}
	return c.k.store.Release(ctx, c.id, c.token, c.k.policy.tombstoneTTL())
}

// storeExtend renews the claim's lease in the store.
func (c *Claim) storeExtend(ctx context.Context) error {
	if f := c.fence(); f.Ref > 0 {
		return c.k.store.ExtendBatch(ctx, []claimFence{f}, c.lease, c.lease+c.k.policy.retention)[0]
	}
	return c.k.store.Extend(ctx, c.id, c.token, c.lease, c.lease+c.k.policy.retention)
}

// endHold tells the coalescing layer, if it made the claim, that the claim
// is settled (stored, when kind is not 0 and err is nil) or lost.
func (c *Claim) endHold(kind byte, body []byte, err error) {
	if c.hold != nil {
		c.hold.finish(c, kind, body, err)
	}
}

// localLeaseEnd is when the lease runs out by this process's clock.
func (c *Claim) localLeaseEnd() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.leaseEnd
}

// errNoClaim is the error of step on a nil Claim.
func errNoClaim(step string) error {
	return fmt.Errorf("%w: %s on a nil *Claim (the context carries no claim)", ErrNoClaim, step)
}
