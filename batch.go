package idem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// ErrDuplicate reports a key given more than once to one batch of Consume.
// Only its first place is claimed; the later places are answered with an
// error wrapping ErrDuplicate, and MessageResult.First names the first
// place.
var ErrDuplicate = errors.New("idem: key repeated in the batch")

// batchResult is batchBegin's answer for one key.
type batchResult struct {
	// Outcome is what Begin would have answered for the key alone, when Err
	// is nil: a Claim (run the operation, then settle it, alone or with
	// completeClaims or releaseClaims), or the stored result (Replayed).
	Outcome Outcome
	// Err is the error Begin would have answered for the key alone:
	// ErrInvalidKey (the store was not asked), an *InProgressError,
	// ErrMismatch, ErrCorrupt, ErrUnavailable (the key's Redis node could not
	// answer), or the caller's cancellation; or an error wrapping
	// ErrDuplicate for a key given earlier in the batch. Nil with an Outcome.
	Err error
	// First is the place in the batch of the key's first occurrence: the
	// result's own place, unless Err wraps ErrDuplicate.
	First int
}

// batchBegin claims the keys of a batch under scope at once, and answers
// each key as Begin would, in the order of keys: a claim (with its token,
// attempt count, Recovered flag and the checkpoints it took over), the stored
// result, or why not. It costs one round trip per Redis node, however
// many keys; a key whose node
// could not be reached gets ErrUnavailable while the others are answered.
//
// Every promise of Begin holds per key: a claimed key is held by this call
// alone, with a fencing token, until it is settled or its lease runs out; a
// lost reply that go-redis sends again gets the same claims back. A key given
// more than once is claimed once, at its first place; the others get
// ErrDuplicate and First. Invalid keys get ErrInvalidKey without asking the
// store. A batch never waits for a key in progress: it answers
// *InProgressError at once, whatever WithWait says. Claims of a batch do not
// go through the in-process coalescing of WithCoalescing; the store still
// answers the coalesced callers ErrInProgress while a batch holds their key.
//
// Nothing keeps the leases alive: settle the claims within the lease, or
// renew them (extendClaims, or each Claim's KeepAlive). Consume does all of
// that for a batch of messages.
//
// Options that apply: WithFingerprints. The error is non-nil only when
// nothing was asked: an option that does not apply or does not fit
// (ErrInvalidConfig), or ctx already done.
func (k *Keeper) batchBegin(ctx context.Context, scope string, keys []string, opts ...Option) ([]batchResult, error) {
	s, err := k.batchSettings(opts, toBatch, "batchBegin", len(keys))
	if err != nil {
		return nil, err
	}
	return k.beginBatch(ctx, scope, keys, s.fingerprints, s.compact && k.markers, k.policy.lease, false)
}

// WithFingerprints binds each message of a Consume call to a digest of its
// content, as WithFingerprint does for one call: fps[i] is that of the
// i-th message, nil for none. It must hold one fingerprint per message.
// Default: none. Applies to Consume.
func WithFingerprints(fps [][]byte) Option {
	return Option{name: "WithFingerprints", to: toBatch, set: func(s *settings) { s.fingerprints = fps }}
}

// batchSettings reads the options of a batch call of n keys.
func (k *Keeper) batchSettings(opts []Option, what target, who string, n int) (settings, error) {
	var s settings
	if err := s.apply(what, who, opts); err != nil {
		return s, err
	}
	if s.fingerprints != nil && len(s.fingerprints) != n {
		return s, fmt.Errorf("%w: WithFingerprints: %d fingerprints for %d keys", ErrInvalidConfig, len(s.fingerprints), n)
	}
	if s.concurrency < 0 {
		return s, fmt.Errorf("%w: WithConcurrency: %d is negative", ErrInvalidConfig, s.concurrency)
	}
	if s.wait < 0 {
		return s, fmt.Errorf("%w: WithWait: %s is negative", ErrInvalidConfig, s.wait)
	}
	if s.settleSet && (s.settleDelay < 0 || s.settleCount < 1) {
		return s, fmt.Errorf("%w: WithSettleWindow: %s, %d: the delay must not be negative, the count at least 1", ErrInvalidConfig, s.settleDelay, s.settleCount)
	}
	if l := s.policy.lease; l != 0 && (l < time.Millisecond || l > MaxDuration) {
		return s, fmt.Errorf("%w: WithLease: %s is not between 1ms and MaxDuration", ErrInvalidConfig, l)
	}
	return s, nil
}

// beginBatch is batchBegin once the options are read; fps is nil or holds
// one fingerprint per key; compact asks the store to keep the new claims
// compactly; lease is the claims' lease. consume tells the Observer a
// marker past the result's retention as Consume answers it: a replay
// (ResultReplayed, Marker), not ResultExpired, since for a message it is
// the ordinary answer of a repeat, not a result lost.
func (k *Keeper) beginBatch(ctx context.Context, scope string, keys []string, fps [][]byte, compact bool, lease time.Duration, consume bool) ([]batchResult, error) {
	if ctx.Err() != nil {
		return nil, canceled(ctx, "claim")
	}
	results := make([]batchResult, len(keys))
	req, places := k.batchRequest(scope, keys, fps, results)
	req.Compact, req.Lease, req.Keep = compact, lease, lease+k.policy.retention
	started := k.now()
	replies := k.claimBatch(ctx, req)
	var claims []Claim // the batch's claims, in one allocation
	for j, r := range replies {
		i, id := places[j], req.IDs[j]
		res := &results[i]
		if r.Err != nil {
			res.Err = storeError(ctx, "claim", r.Err)
		} else {
			var cl *Claim
			if r.Reply.Status == statusClaimed {
				if claims == nil {
					claims = make([]Claim, len(replies)-j)
				}
				cl, claims = &claims[0], claims[1:]
			}
			res.Outcome, res.Err = k.outcome(id, r.Reply, started, req.Lease, cl)
		}
		if c := res.Outcome.Claim; c != nil {
			c.scope, c.key, c.marks = scope, keys[i], compact
		}
		if k.observer != nil {
			out, err := res.Outcome, res.Err
			if consume && errors.Is(err, ErrResultExpired) {
				out.Replayed, err = true, nil
			}
			k.reportClaim(ctx, scope, id, started, nil, out, err)
		}
	}
	if k.observer != nil && len(places) < len(keys) {
		// The keys the store was not asked for are told too: an invalid
		// key (ResultInvalid), a repeat of an earlier place
		// (ResultDuplicate), or of it with another fingerprint
		// (ResultMismatch).
		asked := 0
		for i := range keys {
			if asked < len(places) && places[asked] == i {
				asked++
				continue
			}
			k.reportClaim(ctx, scope, k.RecordID(scope, keys[i]), started, nil, Outcome{}, results[i].Err)
		}
	}
	return results, nil
}

// claimBatch is the store's ClaimBatch of req, once the Keeper's placement
// is known to be its store's (see placementReady); each key is refused with
// the error otherwise, nothing claimed.
func (k *Keeper) claimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	if len(req.IDs) > 0 {
		if err := k.placementReady(ctx, true); err != nil {
			replies := make([]batchClaimReply, len(req.IDs))
			for j := range replies {
				replies[j].Err = err
			}
			return replies
		}
	}
	return k.store.ClaimBatch(ctx, req)
}

// batchRequest is the store's request for keys: the record of each valid key,
// once. places[j] is the place in keys of the record req.IDs[j]. It answers
// invalid and repeated keys in results.
func (k *Keeper) batchRequest(scope string, keys []string, fps [][]byte, results []batchResult) (req batchClaimRequest, places []int) {
	req = batchClaimRequest{
		IDs:             make([]string, 0, len(keys)),
		Attempt:         newAttemptID(),
		Lease:           k.policy.lease,
		Keep:            k.policy.pendingKeep(),
		Retention:       k.policy.retention,
		MarkerRetention: k.policy.markerRetention,
		distinct:        true,
	}
	if fps != nil {
		req.Fingerprints = make([]string, 0, len(keys))
	}
	places = make([]int, 0, len(keys))
	first := firstPlaces(len(keys))
	defer putFirstPlaces(first)
	// The ids of the batch, in one allocation.
	idBuf := make([]byte, idLen*len(keys))
	place := k.ids(scope)
	for i, key := range keys {
		results[i].First = i
		if results[i].Err = ValidateKey(key); results[i].Err == nil {
			place.put((*[idLen]byte)(idBuf[idLen*i:]), key)
		}
	}
	ids := string(idBuf)
	for i := range keys {
		if results[i].Err != nil {
			continue
		}
		id := ids[idLen*i : idLen*i+idLen]
		var fp string
		if fps != nil {
			fp = fingerprintDigest(fps[i])
		}
		if j, dup := first[id]; dup {
			at := places[j]
			results[i].First = at
			if fps != nil && req.Fingerprints[j] != fp {
				// Another request under a key the batch uses: never a
				// duplicate of the first, as in the next batch.
				results[i].Err = fmt.Errorf("%w: place %d repeats the key of place %d with another fingerprint", ErrMismatch, i, at)
				continue
			}
			results[i].Err = fmt.Errorf("%w: place %d repeats the key of place %d", ErrDuplicate, i, at)
			continue
		}
		first[id] = len(req.IDs)
		req.IDs = append(req.IDs, id)
		places = append(places, i)
		if fps != nil {
			req.Fingerprints = append(req.Fingerprints, fp)
		}
	}
	return req, places
}

// firstMaps keeps the maps batchRequest finds repeated ids with, emptied,
// for the next batch: a map of a batch's size is the largest allocation of
// a batch that is not returned to the caller.
var firstMaps sync.Pool

// maxPooledFirst is the largest batch whose map is kept for another.
const maxPooledFirst = 4096

// firstPlaces returns an empty map for a batch of n ids.
func firstPlaces(n int) map[string]int {
	if m, ok := firstMaps.Get().(map[string]int); ok {
		return m
	}
	return make(map[string]int, n)
}

// putFirstPlaces empties m and keeps it for another batch, unless it is
// too large to keep.
func putFirstPlaces(m map[string]int) {
	if len(m) > maxPooledFirst {
		return
	}
	clear(m)
	firstMaps.Put(m)
}

// completion is one result for completeClaims.
type completion struct {
	// Claim is the claim to complete; it must come from this Keeper.
	Claim *Claim
	// Value is the result, replayed to later Begin calls as Claim.Complete's.
	Value []byte
	// Retention is how long the result is kept; zero or less: the Keeper's
	// retention. At most MaxDuration.
	Retention time.Duration
}

// completeClaims completes each claim with its value, as Claim.Complete
// would, and answers each in the order given: nil, ErrLeaseLost (the claim
// is no longer the holder; nothing written), ErrCorrupt, ErrUnavailable, or
// ErrInvalidConfig for an item with a nil Claim, a Claim of another Keeper
// or a retention over MaxDuration (that item is not sent). It costs one round
// trip per Redis node. A claim
// completed twice keeps its first result.
func (k *Keeper) completeClaims(ctx context.Context, items []completion) []error {
	s := make([]settlement, len(items))
	for i, it := range items {
		s[i] = settlement{claim: it.Claim, kind: kindBytes, body: it.Value, retention: it.Retention}
	}
	return k.completeBatch(ctx, s)
}

// settlement is a result to store under a claim: the envelope's kind and
// body, and the retention (zero or less: the Keeper's).
type settlement struct {
	claim     *Claim
	kind      byte
	body      []byte
	retention time.Duration
}

// completeBatch stores each settlement, as Claim.complete would.
func (k *Keeper) completeBatch(ctx context.Context, items []settlement) []error {
	errs, _ := k.settleBatch(ctx, items, nil)
	return errs
}

// settleBatch stores each settlement of items, as Claim.complete would, and
// releases each of gives, as Claim.Release would, in one store call
// (SettleBatch): one round trip per node.
func (k *Keeper) settleBatch(ctx context.Context, items []settlement, gives []*Claim) (doneErrs, giveErrs []error) {
	doneErrs = make([]error, len(items))
	send := make([]batchCompletion, 0, len(items))
	sent := make([]int, 0, len(items))
	for i, it := range items {
		if doneErrs[i] = k.ownClaim(it.claim); doneErrs[i] != nil {
			continue
		}
		keep := it.retention
		if keep <= 0 {
			keep = k.policy.retention
		}
		if keep > MaxDuration {
			doneErrs[i] = fmt.Errorf("%w: retention %s is longer than MaxDuration", ErrInvalidConfig, keep)
			continue
		}
		f, env := it.claim.fence(), sealBatch(it.kind, it.body)
		env, keep = k.asMarker(f, it.claim, env, keep)
		send = append(send, batchCompletion{claimFence: f, Value: env, Keep: keep})
		sent = append(sent, i)
	}
	giveErrs = make([]error, len(gives))
	fences, given := k.fences(gives, giveErrs)
	started := k.startStep()
	var cerrs, rerrs []error
	if len(send) > 0 || len(fences) > 0 {
		cerrs, rerrs = k.store.SettleBatch(ctx, send, fences, k.policy.tombstoneTTL())
	}
	for j, err := range cerrs {
		i, c := sent[j], items[sent[j]].claim
		doneErrs[i] = storeError(ctx, "complete", err)
		c.endHold(items[i].kind, items[i].body, doneErrs[i])
		c.report(ctx, StepComplete, started, doneErrs[i])
	}
	for j, err := range rerrs {
		i := given[j]
		giveErrs[i] = storeError(ctx, "release", err)
		gives[i].endHold(0, nil, giveErrs[i])
		gives[i].report(ctx, StepRelease, started, giveErrs[i])
	}
	return doneErrs, giveErrs
}

// asMarker returns the result env of claim c, whose fence is f, and how
// long to keep it, keep being its retention: a compact claim's empty result
// is kept as a marker for the marker retention, answering as an empty
// result for the retention keep; so is one of a claim of a compact call
// kept in a record of its own (a takeover, a claim after a release). Both
// carry markerEnvelope, which says when the retention ends, so that they
// answer as a marker does.
func (k *Keeper) asMarker(f claimFence, c *Claim, env []byte, keep time.Duration) ([]byte, time.Duration) {
	if !isEmptyResult(env) || f.Ref == 0 && !c.marks {
		return env, keep
	}
	return markerEnvelope(k.now().Add(keep)), max(keep, k.policy.markerRetention)
}

// emptyBytes is the envelope of an empty kindBytes result, which Consume
// stores for every message: shared, read only.
var emptyBytes = seal(kindBytes, nil)

// sealBatch is seal, sharing the envelope of an empty kindBytes result.
func sealBatch(kind byte, body []byte) []byte {
	if kind == kindBytes && len(body) == 0 {
		return emptyBytes
	}
	return seal(kind, body)
}

// releaseClaims gives up each claim, as Claim.Release would, and answers each
// in the order given: nil, ErrLeaseLost, ErrCorrupt, ErrUnavailable, or
// ErrInvalidConfig for a nil Claim or one of another Keeper (not sent). It
// costs one round trip per Redis node.
func (k *Keeper) releaseClaims(ctx context.Context, claims []*Claim) []error {
	_, errs := k.settleBatch(ctx, nil, claims)
	return errs
}

// extendClaims renews the lease of each claim for the Keeper's lease from
// now, as Claim.Extend would, and answers each in the order given: nil,
// ErrLeaseLost, ErrCorrupt, ErrUnavailable, or ErrInvalidConfig for a nil
// Claim or one of another Keeper (not sent). It costs one round trip per Redis
// node.
func (k *Keeper) extendClaims(ctx context.Context, claims []*Claim) []error {
	errs := make([]error, len(claims))
	fences, sent := k.fences(claims, errs)
	started := k.now()
	serrs := make([]error, len(fences))
	// The claims of a Keeper have its lease, unless a call gave its own
	// (Consume's WithLease): one store call per lease.
	for lease, js := range byLease(fences, sent, claims) {
		fs := make([]claimFence, len(js))
		for n, j := range js {
			fs[n] = fences[j]
		}
		keep := lease + k.policy.retention
		errs := k.store.ExtendBatch(ctx, fs, lease, keep)
		for n, j := range js {
			serrs[j] = errs[n]
		}
	}
	for j, err := range serrs {
		i, c := sent[j], claims[sent[j]]
		errs[i] = storeError(ctx, "extend", err)
		c.report(ctx, StepExtend, started, errs[i])
		switch {
		case errs[i] == nil:
			c.extendedAt(started)
		case errors.Is(errs[i], ErrLeaseLost):
			c.endHold(0, nil, errs[i])
		}
	}
	return errs
}

// byLease groups the places in fences by the lease of their claim, claims[sent[j]].
func byLease(fences []claimFence, sent []int, claims []*Claim) map[time.Duration][]int {
	m := map[time.Duration][]int{}
	for j := range fences {
		l := claims[sent[j]].lease
		m[l] = append(m[l], j)
	}
	return m
}

// fences returns the fence of each claim that belongs to k, and its place in
// claims; the others are answered in errs.
func (k *Keeper) fences(claims []*Claim, errs []error) (fences []claimFence, sent []int) {
	fences = make([]claimFence, 0, len(claims))
	sent = make([]int, 0, len(claims))
	for i, c := range claims {
		if errs[i] = k.ownClaim(c); errs[i] == nil {
			fences = append(fences, c.fence())
			sent = append(sent, i)
		}
	}
	return fences, sent
}

// ownClaim refuses a claim that is nil or of another Keeper.
func (k *Keeper) ownClaim(c *Claim) error {
	switch {
	case c == nil:
		return fmt.Errorf("%w: nil claim", ErrInvalidConfig)
	case c.k != k:
		return fmt.Errorf("%w: a claim of another Keeper", ErrInvalidConfig)
	}
	return nil
}

// fence names the claim for the store.
func (c *Claim) fence() claimFence {
	c.mu.Lock()
	defer c.mu.Unlock()
	return claimFence{ID: c.id, Token: c.token, Ref: c.ref}
}

// extendedAt moves the claim's lease end, by this process's clock, to the
// lease from started, when a renewal sent at started got through.
func (c *Claim) extendedAt(started time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if end := started.Add(c.lease); end.After(c.leaseEnd) {
		c.leaseEnd = end
	}
}
