package idem

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"time"
)

// WithCoalescing makes concurrent calls of Begin and Do with the same
// (scope, key) and the same Fingerprint inside this process share the store's
// work, singleflight-style, so that a retry storm on one key costs the store
// one claim instead of one per retry. Default: off.
//
// With it on, for one (scope, key):
//
//   - The first caller (the leader) claims the key in the store as usual.
//     Callers that arrive while its claim is in flight wait for its answer
//     without a call of their own and share it: the stored result if the
//     operation had completed (each gets its own copy of Value), or the same
//     ErrMismatch, *InProgressError, ErrCorrupt or ErrUnavailable. If the
//     leader's own context ended its call, they claim for themselves.
//   - If the leader got the claim, callers that arrive while it holds it get
//     an *InProgressError at once, without a call, its RetryAfter being the
//     time left on the leader's lease. With Wait they wait in the process for
//     the leader's outcome: when it completes they get its result as a
//     replay, and when it releases the claim (or fails to store its result)
//     they claim the key themselves, through the store.
//   - Callers with another fingerprint than the leader's make their own call,
//     and get ErrMismatch from the store when the leader's record is there.
//
// Only the store hands out claims, so at most one caller holds a key, and
// fencing tokens and attempt counts are those of the store's claims alone.
//
// The process's clock judges the leader's lease while it holds the claim: once
// the lease has run out by that clock (measured from before the claim was
// sent, renewed by Claim.Extend and KeepAlive), callers go to the store again,
// where a claim whose lease ran out by Redis's clock can be taken over.
// Calls made on another Keeper, or in another process, are not coalesced.
//
// Turn it on where retries of one key pile up in one process: clients that
// retry quickly while the operation runs, a queue that redelivers to several
// workers of one process. It is off by default because it makes the process,
// not Redis alone, judge a held lease, and costs a map entry per call.
// Applies to a Keeper.
func WithCoalescing(enabled bool) Option {
	return Option{name: "WithCoalescing", to: toKeeper, set: func(s *settings) { s.coalesce = enabled }}
}

// claimer makes the claims of Begin: the store (storeClaimer) or, with
// WithCoalescing, the coalescing layer in front of it. deadline is when a
// caller with a wait stops waiting; zero without one.
type claimer interface {
	claim(ctx context.Context, id string, req claimRequest, deadline time.Time) (Outcome, error)
}

// flights is the coalescing layer: it holds, per record id, the claim a
// leader is making or holds in this process, in shards so that callers of
// different keys rarely meet on one lock, and passes the leaders' claims on
// to next. The zero value is not usable; see newFlights.
type flights struct {
	next   claimer
	now    func() time.Time
	shards [flightShards]flightShard
}

const flightShards = 32

type flightShard struct {
	mu sync.Mutex
	// m holds a flight per record id, from the moment its leader starts the
	// claim until the claim answered without a hold, or until the hold ends
	// (Complete, Release, a lost lease) or is found stale.
	m map[string]*flight
	// sweepAt is the size of m at which the next insertion first drops
	// stale holds, whose leader never completed nor released.
	sweepAt int
}

// minSweep is the smallest size of a shard's map that is ever swept.
const minSweep = 64

// newFlights returns a coalescing layer in front of next.
func newFlights(next claimer, now func() time.Time) *flights {
	f := &flights{next: next, now: now}
	for i := range f.shards {
		f.shards[i] = flightShard{m: make(map[string]*flight), sweepAt: minSweep}
	}
	return f
}

// shard returns the shard of a record id. Ids are digests in base64url, so
// the six bits of their first character spread them evenly.
func (f *flights) shard(id string) *flightShard {
	if id == "" {
		return &f.shards[0]
	}
	var v byte
	switch c := id[0]; {
	case 'A' <= c && c <= 'Z':
		v = c - 'A'
	case 'a' <= c && c <= 'z':
		v = c - 'a' + 26
	case '0' <= c && c <= '9':
		v = c - '0' + 52
	default: // '-', '_', or not base64url
		v = c
	}
	return &f.shards[v%flightShards]
}

// flight is one leader's claim of a record. Its fields are guarded by the
// shard's mutex until landed (out, err, retry) and finished (completed,
// result) are set, and read-only after. The channels are made only when a
// follower waits for them, so that a call nobody joins costs no channel.
type flight struct {
	// fp is the leader's fingerprint digest; only callers with the same one
	// join the flight.
	fp string
	// joined counts the callers that joined the flight, the leader excluded.
	joined int

	// landed is set when the leader's claim answered, with out, err and
	// retry; claimed, if a follower made it, is closed then.
	landed  bool
	claimed chan struct{}
	// out is the leader's answer; a replayed Value in it is shared by the
	// followers (Outcome.shared), and never written.
	out Outcome
	err error
	// retry is set when followers must claim for themselves: the leader's
	// own context ended its call.
	retry bool

	// held is set when the leader got the claim (out.Claim). finished is set
	// when the hold ends: completed, with result set, or released, or lost,
	// or the completion failed; done, if a follower made it, is closed then.
	held      bool
	finished  bool
	done      chan struct{}
	completed bool
	// result is the completed result, its Value shared by the followers.
	result Outcome
}

// leaseLeft returns the time left on the leader's lease by the process's
// clock.
func (fl *flight) leaseLeft(now time.Time) time.Duration {
	return fl.out.Claim.localLeaseEnd().Sub(now)
}

// claim implements claimer: the caller leads a new flight, follows the
// flight of a leader with its fingerprint, or, when a leader with another
// fingerprint is in flight, asks the store itself.
func (f *flights) claim(ctx context.Context, id string, req claimRequest, deadline time.Time) (Outcome, error) {
	sh := f.shard(id)
	for {
		fl, leader := sh.join(id, req.Fingerprint, f.now)
		switch {
		case fl == nil:
			return f.next.claim(ctx, id, req, deadline)
		case leader:
			return f.lead(ctx, sh, id, fl, req)
		}
		out, err, again := f.follow(ctx, sh, fl, deadline)
		if !again {
			return out, err
		}
	}
}

// join returns the flight of id that a caller with fingerprint fp follows, or
// a new flight that it leads, or nil when a caller with another fingerprint
// leads. now is read only when a held lease or a sweep needs it.
func (sh *flightShard) join(id, fp string, now func() time.Time) (fl *flight, leader bool) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if fl = sh.m[id]; fl != nil {
		if fl.held && fl.leaseLeft(now()) <= 0 {
			// The leader neither completed nor released within its lease.
			delete(sh.m, id)
		} else if fl.fp != fp {
			return nil, false
		} else {
			fl.joined++
			return fl, false
		}
	}
	if len(sh.m) >= sh.sweepAt {
		sh.sweep(now())
	}
	fl = &flight{fp: fp}
	sh.m[id] = fl
	return fl, true
}

// sweep drops the holds whose lease ran out by now. sh.mu is held.
func (sh *flightShard) sweep(now time.Time) {
	for id, fl := range sh.m {
		if fl.held && fl.leaseLeft(now) <= 0 {
			delete(sh.m, id)
		}
	}
	sh.sweepAt = max(2*len(sh.m), minSweep)
}

// lead makes the leader's claim and publishes its answer to the followers. A
// claim it gets tells the layer when its hold ends (Claim.hold).
func (f *flights) lead(ctx context.Context, sh *flightShard, id string, fl *flight, req claimRequest) (out Outcome, err error) {
	landed := false
	defer func() {
		if !landed { // the store panicked: let the followers try for themselves
			sh.land(id, fl, Outcome{}, errors.New("idem: claim panicked"), true)
		}
	}()
	out, err = f.next.claim(ctx, id, req, time.Time{})
	if c := out.Claim; c != nil {
		c.hold = sh
	}
	landed = true
	sh.land(id, fl, out, err, err != nil && ctx.Err() != nil)
	return out, err
}

// land publishes the leader's answer. A flight whose leader got the claim
// stays, held, until finish.
func (sh *flightShard) land(id string, fl *flight, out Outcome, err error, retry bool) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if out.Replayed && fl.joined > 0 && !out.shared {
		// The leader owns out.Value and may change it once it returns: the
		// followers share a copy that nobody writes.
		out.Value = bytes.Clone(out.Value)
	}
	out.shared = true
	fl.out, fl.err, fl.retry, fl.landed = out, err, retry, true
	if err == nil && out.Claim != nil {
		fl.held = true
	} else if sh.m[id] == fl {
		delete(sh.m, id)
	}
	if fl.claimed != nil {
		close(fl.claimed)
	}
}

// finish ends the hold of c, if its flight is still the current one: the
// followers waiting for it get body (of kind) as a replay if the completion
// stored it (err nil, kind not 0), or claim the key themselves otherwise.
func (sh *flightShard) finish(c *Claim, kind byte, body []byte, err error) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	fl := sh.m[c.id]
	if fl == nil || !fl.held || fl.out.Claim != c {
		return
	}
	delete(sh.m, c.id)
	fl.finished = true
	if err == nil && kind != 0 && fl.joined > 0 {
		fl.completed = true
		// The caller of Complete may reuse its slice once it returns.
		fl.result = Outcome{Replayed: true, Value: bytes.Clone(body), Token: c.token, attempt: c.attempt, kind: kind, shared: true}
		fl.result.Err, _ = replayedFinal(kind, fl.result.Value) // sealed by this process: readable
	}
	if fl.done != nil {
		close(fl.done)
	}
}

// follow waits for the leader's answer and returns the follower's, or
// again=true when the follower must claim for itself (through claim, so
// possibly as the follower of a newer flight).
func (f *flights) follow(ctx context.Context, sh *flightShard, fl *flight, deadline time.Time) (_ Outcome, _ error, again bool) {
	if err := sh.awaitLanding(ctx, fl); err != nil {
		return Outcome{}, err, false
	}
	switch {
	case fl.retry:
		return Outcome{}, nil, true
	case fl.err != nil:
		var ip *InProgressError
		if errors.As(fl.err, &ip) {
			return Outcome{}, &InProgressError{RetryAfter: ip.RetryAfter}, false
		}
		return Outcome{}, fl.err, false
	case fl.out.Replayed:
		return fl.out, nil, false
	}
	return f.awaitHold(ctx, sh, fl, deadline)
}

// awaitLanding waits until the leader's claim answered, or ctx ends.
func (sh *flightShard) awaitLanding(ctx context.Context, fl *flight) error {
	sh.mu.Lock()
	if fl.landed {
		sh.mu.Unlock()
		return nil
	}
	if fl.claimed == nil {
		fl.claimed = make(chan struct{})
	}
	claimed := fl.claimed
	sh.mu.Unlock()
	select {
	case <-claimed:
		return nil
	case <-ctx.Done():
		return canceled(ctx, "claim")
	}
}

// awaitHold is the answer of a follower while the leader holds the claim:
// in progress at once without a wait, else the leader's result when it
// completes within the wait, or again=true when its hold ends otherwise or
// its lease runs out by the process's clock.
func (f *flights) awaitHold(ctx context.Context, sh *flightShard, fl *flight, deadline time.Time) (_ Outcome, _ error, again bool) {
	for {
		now := f.now()
		left := fl.leaseLeft(now)
		if left <= 0 {
			return Outcome{}, nil, true
		}
		wait := deadline.Sub(now)
		if wait <= 0 {
			return Outcome{}, &InProgressError{RetryAfter: max(left, time.Millisecond)}, false
		}
		sh.mu.Lock()
		if !fl.finished && fl.done == nil {
			fl.done = make(chan struct{})
		}
		done, finished := fl.done, fl.finished
		sh.mu.Unlock()
		if finished {
			return fl.finishedAnswer()
		}
		t := time.NewTimer(min(wait, left))
		select {
		case <-done:
			t.Stop()
			return fl.finishedAnswer()
		case <-ctx.Done():
			t.Stop()
			return Outcome{}, canceled(ctx, "waiting for the attempt in progress"), false
		case <-t.C:
			// The deadline passed or the lease ran out: look again.
		}
	}
}

// finishedAnswer is a waiting follower's answer once the hold ended.
func (fl *flight) finishedAnswer() (_ Outcome, _ error, again bool) {
	if fl.completed {
		return fl.result, nil, false
	}
	return Outcome{}, nil, true
}
