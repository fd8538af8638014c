package idem

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"
)

// Keeper runs each operation at most once per (scope, key) within the
// retention, and answers every later call with the first result. It is safe
// for concurrent use.
type Keeper struct {
	store  recordStore
	policy policy
	codec  Codec
	// msgpack is set when codec is msgpackCodec, whose encoding of []byte
	// and string results Do writes and reads itself (see sealResult).
	msgpack bool
	now     func() time.Time
	// wait is the default of WithWait for every call.
	wait time.Duration
	// observer is told of every step; nil: nothing is reported.
	observer Observer
	// claims makes the claims of Begin: the store, or the coalescing layer
	// in front of it (WithCoalescing).
	claims claimer
	// cache answers replays from memory (WithReplayCache); nil: none.
	cache *replayCache
	// renewals schedules the lease renewals of KeepAlive.
	renewals renewalQueue
	// markers is false for a Keeper made WithoutMarkers: Consume then
	// claims each message in a record of its own.
	markers bool
	// scopeShards is how many shards of a scope its record ids place its
	// keys in (0: none): WithScopeShards' n, or its store's default
	// (defaultScopeShards).
	scopeShards int
	// placed is set once the store has said for good that its keys are
	// placed as this Keeper places them (see placementReady).
	placed atomic.Bool
}

// keeperOn returns a Keeper on store, with the options that apply to a
// Keeper (see NewRedis); the others are refused with ErrInvalidConfig.
func keeperOn(store recordStore, opts ...Option) (*Keeper, error) {
	if store == nil {
		return nil, fmt.Errorf("%w: nil store", ErrInvalidConfig)
	}
	s := defaultSettings()
	if err := s.apply(toKeeper, "New", opts); err != nil {
		return nil, err
	}
	return buildKeeper(store, &s)
}

// buildKeeper returns a Keeper with the Keeper's part of s.
func buildKeeper(store recordStore, s *settings) (*Keeper, error) {
	if err := s.policy.validate(); err != nil {
		return nil, err
	}
	switch {
	case s.codec == nil:
		return nil, fmt.Errorf("%w: nil codec", ErrInvalidConfig)
	case s.now == nil:
		return nil, fmt.Errorf("%w: nil clock", ErrInvalidConfig)
	case s.wait < 0:
		return nil, fmt.Errorf("%w: wait %s is negative", ErrInvalidConfig, s.wait)
	case s.scopeShards < 0 || s.scopeShards > maxScopeShards:
		return nil, fmt.Errorf("%w: %d scope shards, not 0 to %d", ErrInvalidConfig, s.scopeShards, maxScopeShards)
	}
	shards := s.scopeShards
	if !s.scopeShardsSet {
		shards = defaultScopeShards(store)
	}
	k := &Keeper{store: store, policy: s.policy, codec: s.codec, now: s.now, wait: s.wait, observer: s.observer, markers: !s.noMarkers, scopeShards: shards}
	switch s.codec.(type) {
	case msgpackCodec, *msgpackCodec:
		k.msgpack = true
	}
	if s.replayCache != nil {
		if err := s.replayCache.validate(); err != nil {
			return nil, err
		}
		k.cache = newReplayCache(s.replayCache)
	}
	k.renewals.init(k.policy.lease)
	if rs, ok := store.(*redisStore); ok {
		rs.addKeeper(k.scopeShards)
	}
	k.claims = storeClaimer{k}
	if s.coalesce {
		k.claims = newFlights(k.claims, func() time.Time { return k.now() })
	}
	return k, nil
}

// Outcome is the answer of Begin when the operation may not be refused: either
// the caller now holds a Claim and must run the operation, or the operation
// had completed and Value holds its stored result.
type Outcome struct {
	// Claim is set when the caller holds the key: run the operation, then
	// Complete or Release the claim.
	Claim *Claim
	// Replayed is true when the operation had completed; Claim is nil then.
	Replayed bool
	// Value is the stored result when Replayed: the bytes given to
	// Claim.Complete, or, for a result stored by Do, its encoding by the
	// Keeper's Codec, or the stored form of a final error (see Err): its
	// message, or with a code or details (FinalCode) their encoding.
	Value []byte
	// Err is set when Replayed and the stored result is a final error that
	// Do stored (Final, FinalCode): a *FinalError whose Replayed is true,
	// with the message, Code and Details stored. Nil otherwise.
	Err error
	// Token is the fencing token of the claim that produced the stored result
	// when Replayed, or of Claim.
	Token int64

	kind byte // envelope kind of Value
	// shared is set when Value is not the caller's own but shared with
	// other callers (a replay from the replay cache or of a coalesced
	// leader), and must not be written: Begin hands out a copy (own), and
	// Do copies only what its result would share.
	shared  bool
	attempt int // when Replayed: the attempt count of the completing claim
	// marker is set when the answer came from a marker (claimReply.Marker).
	marker bool
}

// Attempt returns, for a replay, the attempt count of the claim that
// completed the stored result (1 when the first attempt did); for a claim,
// Claim.Attempt; 0 otherwise.
func (out Outcome) Attempt() int {
	if out.Claim != nil {
		return out.Claim.Attempt()
	}
	return out.attempt
}

// own gives out a Value of its own if it shares one.
func (out *Outcome) own() {
	if out.shared {
		out.Value = bytes.Clone(out.Value)
		out.shared = false
	}
}

// Begin claims (scope, key) for one run of an operation, in one round trip.
// It returns an Outcome holding either a Claim or the stored result, or one of
// these errors: ErrInvalidKey (the store was not touched), an *InProgressError
// (another attempt holds the key; see WithWait), ErrMismatch (the key was used
// with another WithFingerprint), ErrCorrupt, ErrUnavailable, or, when ctx ends before
// the store answers, an error for which errors.Is(err, context.Canceled) (or
// context.DeadlineExceeded) reports true and errors.Is(err, ErrUnavailable)
// does not: the caller's own cancellation is never reported as the store's
// failure.
func (k *Keeper) Begin(ctx context.Context, scope, key string, opts ...Option) (Outcome, error) {
	return k.beginCall(ctx, scope, key, opts, true)
}

// beginCall is Begin. A replayed Value is the caller's own if own is set;
// else it may be shared (Outcome.shared), as Do takes it.
func (k *Keeper) beginCall(ctx context.Context, scope, key string, opts []Option, own bool) (Outcome, error) {
	c := call{wait: k.wait}
	var err error
	if len(opts) > 0 {
		c, err = k.callOptions(opts) // apart, so that only options put c on the heap
	}
	var started time.Time
	if k.observer != nil {
		started = k.now()
	}
	if err == nil {
		err = ValidateKey(key)
	}
	if err == nil && ctx.Err() != nil {
		err = canceled(ctx, "claim")
	}
	var id string
	var out Outcome
	if err == nil {
		var attempt string
		id, attempt = k.claimIDs(scope, key)
		out, err = k.begin(ctx, id, attempt, &c)
		if out.Claim != nil {
			out.Claim.scope, out.Claim.key = scope, key
			out.Claim.inRequest = k.observer != nil && inRequest(ctx)
		}
	}
	if k.observer != nil || c.info != nil {
		k.reportClaim(ctx, scope, id, started, c.info, out, err)
	}
	if own {
		out.own()
	}
	return out, err
}

// reportClaim tells the Observer, and info if the caller asked for it, how
// a claim went.
func (k *Keeper) reportClaim(ctx context.Context, scope, id string, started time.Time, info *CallInfo, out Outcome, err error) {
	ev := Event{Step: StepClaim, Result: claimResult(out, err), Scope: scope, ID: id, Token: out.Token, Marker: out.marker, Err: err}
	var ip *InProgressError
	switch c := out.Claim; {
	case c != nil:
		ev.Attempt, ev.Recovered = c.attempt, c.recovered
	case out.Replayed:
		ev.Attempt = out.attempt
	case err != nil && errors.As(err, &ip):
		ev.LeaseLeft = ip.RetryAfter
	}
	if info != nil {
		*info = CallInfo{Replayed: out.Replayed, Token: ev.Token, Attempt: ev.Attempt, Recovered: ev.Recovered}
	}
	if k.observer != nil {
		ev.Took, ev.InRequest = k.now().Sub(started), inRequest(ctx)
		k.observer.Observe(ctx, ev)
	}
}

// claimResult classes the answer of Begin.
func claimResult(out Outcome, err error) Result {
	switch {
	case err == nil && out.Replayed:
		return ResultReplayed
	case err == nil && out.Claim.recovered:
		return ResultRecovered
	case err == nil:
		return ResultClaimed
	}
	return errorResult(err)
}

// errorResult classes an error of a step.
func errorResult(err error) Result {
	var refused *ForgetRefusedError
	switch {
	case errors.As(err, &refused) && refused.LeaseLeft == 0:
		return ResultRefused
	case errors.Is(err, ErrInvalidKey), errors.Is(err, ErrInvalidConfig), errors.Is(err, ErrInvalidCheckpoint):
		return ResultInvalid
	case errors.Is(err, ErrInProgress):
		return ResultInProgress
	case errors.Is(err, ErrResultExpired):
		return ResultExpired
	case errors.Is(err, ErrDuplicate):
		return ResultDuplicate
	case errors.Is(err, ErrMismatch):
		return ResultMismatch
	case errors.Is(err, ErrCorrupt):
		return ResultCorrupt
	case errors.Is(err, ErrLeaseLost):
		return ResultLeaseLost
	case errors.Is(err, ErrUnavailable):
		return ResultUnavailable
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return ResultCanceled
	}
	return ResultUnavailable
}

// call is what the options of one call set.
type call struct {
	fingerprint []byte
	wait        time.Duration
	info        *CallInfo
}

func (k *Keeper) callOptions(opts []Option) (call, error) {
	c := call{wait: k.wait}
	for i := range opts {
		o := &opts[i]
		if apply, err := o.appliesTo(toCall, "a call"); !apply {
			if err != nil {
				return call{}, err
			}
			continue
		}
		o.call.setOn(&c)
	}
	if c.wait < 0 {
		return call{}, fmt.Errorf("%w: wait %s is negative", ErrInvalidConfig, c.wait)
	}
	return c, nil
}

func (k *Keeper) begin(ctx context.Context, id, attempt string, c *call) (Outcome, error) {
	req := claimRequest{
		Fingerprint:     fingerprintDigest(c.fingerprint),
		Attempt:         attempt,
		Lease:           k.policy.lease,
		Keep:            k.policy.pendingKeep(),
		Retention:       k.policy.retention,
		MarkerRetention: k.policy.markerRetention,
	}
	if k.cache != nil {
		if out, ok := k.cache.get(id, req.Fingerprint, k.now()); ok {
			return out, nil
		}
	}
	var deadline time.Time
	if c.wait > 0 {
		deadline = k.now().Add(c.wait)
	}
	backoff := 5 * time.Millisecond
	for {
		out, err := k.claims.claim(ctx, id, req, deadline)
		if c.wait <= 0 || err == nil {
			return out, err
		}
		var ip *InProgressError // declared here: its address escapes
		if !errors.As(err, &ip) {
			return out, err
		}
		left := deadline.Sub(k.now())
		if left <= 0 {
			return out, err
		}
		sleep := min(backoff, ip.RetryAfter, left)
		backoff = min(2*backoff, 250*time.Millisecond)
		t := time.NewTimer(sleep)
		select {
		case <-ctx.Done():
			t.Stop()
			return Outcome{}, canceled(ctx, "waiting for the attempt in progress")
		case <-t.C:
		}
	}
}

// storeClaimer makes each claim with one recordStore.Claim.
type storeClaimer struct{ k *Keeper }

// claim implements claimer; a store call does not wait.
func (s storeClaimer) claim(ctx context.Context, id string, req claimRequest, _ time.Time) (Outcome, error) {
	k := s.k
	started := k.now()
	if err := k.placementReady(ctx, true); err != nil {
		return Outcome{}, storeError(ctx, "claim", err)
	}
	r, err := k.store.Claim(ctx, id, req)
	if err != nil {
		return Outcome{}, storeError(ctx, "claim", err)
	}
	out, err := k.outcome(id, r, started, req.Lease, nil)
	switch {
	case out.Claim != nil:
		out.Claim.fp, out.Claim.fpKnown = req.Fingerprint, true
	case out.Replayed:
		k.cacheReplayed(id, req.Fingerprint, &out, started)
	}
	return out, err
}

// outcome is Begin's answer for the store's reply r to a claim of id asked
// for at started, with lease; a claim is made in cl if it is not nil (one
// of a batch's), else allocated.
func (k *Keeper) outcome(id string, r claimReply, started time.Time, lease time.Duration, cl *Claim) (Outcome, error) {
	switch r.Status {
	case statusClaimed:
		if cl == nil {
			cl = new(Claim)
		}
		*cl = Claim{
			k: k, id: id, token: r.Token, attempt: r.Attempt, recovered: r.Recovered, ref: r.Ref, lease: lease,
			claimedAt: started, leaseEnd: started.Add(lease), checkpoints: r.Checkpoints,
		}
		return Outcome{Claim: cl, Token: r.Token}, nil
	case statusCompleted:
		if until, ok := markerUntil(r.Value); ok {
			// An empty result kept as a marker, in a record.
			if started.UnixMicro() >= until {
				return Outcome{Token: r.Token, attempt: r.Attempt, marker: true}, ErrResultExpired
			}
			r.Value, r.Marker = emptyBytes, true
		}
		kind, body, err := open(r.Value)
		if err != nil {
			return Outcome{}, err
		}
		out := Outcome{Replayed: true, Value: body, Token: r.Token, attempt: r.Attempt, kind: kind, marker: r.Marker}
		if out.Err, err = replayedFinal(kind, body); err != nil {
			return Outcome{}, err
		}
		return out, nil
	case statusInProgress:
		return Outcome{}, &InProgressError{RetryAfter: max(r.LeaseLeft, time.Millisecond)}
	case statusMismatch:
		return Outcome{}, ErrMismatch
	case statusResultExpired:
		return Outcome{Token: r.Token, attempt: r.Attempt, marker: true}, ErrResultExpired
	}
	return Outcome{}, fmt.Errorf("%w: claim status %d unknown", ErrCorrupt, r.Status)
}

// attemptLen is the length of an attempt id: 64 bits in base64url.
const attemptLen = 11

// newAttemptID returns 64 random bits in base64url.
func newAttemptID() string {
	var b [attemptLen]byte
	putAttemptID(&b)
	return string(b[:])
}

// putAttemptID writes a new attempt id into b.
func putAttemptID(b *[attemptLen]byte) {
	var r [8]byte
	binary.LittleEndian.PutUint64(r[:], rand.Uint64())
	base64.RawURLEncoding.Encode(b[:], r[:])
}

// claimIDs returns the record id of (scope, key) and a new attempt id, both
// slices of one string: one allocation for a claim instead of two.
func (k *Keeper) claimIDs(scope, key string) (id, attempt string) {
	var b [idLen + attemptLen]byte
	k.ids(scope).put((*[idLen]byte)(b[:idLen]), key)
	putAttemptID((*[attemptLen]byte)(b[idLen:]))
	s := string(b[:])
	return s[:idLen], s[idLen:]
}
