package idem

import (
	"context"
	"time"
)

// recordStore keeps idempotency records: every step the Keeper takes on a record
// goes through it, and nothing else. Every method is one atomic step per
// record; redisStore, made by openRedisStore, makes each one Lua script and
// one round trip (per Redis node, for the batch methods).
//
// id is the record's fixed-length id, a digest of (scope, key) made by the
// Keeper; a recordStore never sees raw client keys. Tokens are the fencing tokens
// the recordStore handed out in Claim.
//
// Errors: ErrLeaseLost when the token is not the current holder's,
// ErrCorrupt when the value at the key is not a record, and anything else is
// read as the store being unavailable (ErrUnavailable).
//
// The batch methods answer every record on their own, in the order given: a
// record whose step failed (ErrLeaseLost, ErrCorrupt, its Redis node
// unreachable) does not fail the others, and each answer is exactly that of
// the single-record method. A claim a recordStore keeps compactly
// (batchClaimRequest.Compact) is named by its claimFence, Ref included, in every
// later step: SettleBatch, ExtendBatch and Checkpoint.
type recordStore interface {
	// Claim claims the record for one attempt, or reports its state.
	Claim(ctx context.Context, id string, req claimRequest) (claimReply, error)
	// Complete stores value as the record's result, kept for keep, if token
	// is the current holder's. A retried Complete with the same token
	// succeeds and writes nothing: the record keeps the first result and
	// its retention. stored reports whether this call wrote value; a store
	// that cannot tell reports false (the Keeper then caches nothing of it,
	// see WithReplayCache).
	Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (stored bool, err error)
	// Release gives the claim up, if token is the current holder's, so the
	// next claim runs the operation again; the token and attempt count are
	// remembered for keep. A retried Release with the same token succeeds.
	Release(ctx context.Context, id string, token int64, keep time.Duration) error
	// Extend renews the lease of token to lease from now, and keeps the
	// pending record for keep.
	Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error

	// ClaimBatch claims every record of req, with req's attempt id, lease and
	// keep, and answers each as Claim would.
	ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply
	// SettleBatch stores each item's value, as Complete would, and gives up
	// each claim of release, as Release would, the released marker kept for
	// keep; either may be empty. It answers each item in done and each claim
	// in given.
	SettleBatch(ctx context.Context, items []batchCompletion, release []claimFence, keep time.Duration) (done, given []error)
	// ExtendBatch renews the lease of each claim, as Extend would.
	ExtendBatch(ctx context.Context, claims []claimFence, lease, keep time.Duration) []error

	// Checkpoint records (name, value) in the pending record of claim if
	// its token is the current holder's: ErrLeaseLost otherwise, and an
	// error wrapping ErrInvalidCheckpoint when the record holds
	// MaxCheckpoints other checkpoints; nothing is written then. A
	// checkpoint recorded again under its name replaces the earlier one and
	// becomes the last. A retried Checkpoint with the same arguments
	// succeeds. A compact claim (claim.Ref > 0) is first moved to a record
	// of its own, kept for keep, in the same step.
	//
	// A record's checkpoints are kept while it is pending, handed over to
	// the next claim (claimReply.Checkpoints) when the lease ran out or the
	// claim was released, and dropped when it completes.
	Checkpoint(ctx context.Context, claim claimFence, name string, value []byte, keep time.Duration) error

	// Inspect reads the record id, in one step, without changing it. A
	// record that cannot be read is reported with an error wrapping
	// ErrCorrupt, and the Record then holds at least ID and Key.
	Inspect(ctx context.Context, id string) (Record, error)
	// Forget removes the record id in one atomic step if it is the record
	// of token (compare and delete), and returns it as it was. When there is
	// no record of token (none, or one of another token: a newer claim, or
	// the key completed by another attempt), it removes nothing and returns
	// a Record in StateAbsent and no error. Without force, a record whose
	// lease is live or that holds checkpoints is refused with a
	// *ForgetRefusedError, and the Record says what was found. A value that
	// is not a record is never removed (ErrCorrupt).
	Forget(ctx context.Context, id string, token int64, force bool) (Record, error)
	// Abandon ends, in one atomic step, the lease of the pending claim of
	// token on the record id, keeping everything else of the record, and
	// returns the record as it is after the call. A record that is not a
	// pending claim of token (completed, released, of another token) is left
	// as it is and returned, and no record gives a Record in StateAbsent; no
	// error in either case. A value that is not a record is never changed
	// (ErrCorrupt).
	Abandon(ctx context.Context, id string, token int64) (Record, error)
}

// claimRequest is what a store needs to claim a record.
type claimRequest struct {
	// Fingerprint is a digest of the request, in base64url; may be empty.
	// A record claimed with one fingerprint answers statusMismatch to another.
	Fingerprint string
	// Attempt identifies this attempt, in base64url. A Claim that finds a
	// pending record with the same Attempt answers statusClaimed with the same
	// token: the caller is retrying a command whose reply was lost.
	Attempt string
	// Lease is how long the claim may run without renewal.
	Lease time.Duration
	// Keep is how long a pending record is kept, at least Lease.
	Keep time.Duration
	// Retention and MarkerRetention say how a marker answers (see
	// WithMarkerRetention): one younger than Retention as a completed
	// record with an empty result, one younger than MarkerRetention with
	// statusResultExpired, an older one not at all. Zero: a marker answers
	// as a completed record with an empty result for as long as it is kept.
	Retention, MarkerRetention time.Duration
}

// claimStatus is what a store's Claim found.
type claimStatus uint8

// The answers of recordStore.Claim.
const (
	// statusClaimed: the caller holds the record and must run the operation.
	statusClaimed claimStatus = iota + 1
	// statusCompleted: the operation completed; Value holds its result.
	statusCompleted
	// statusInProgress: another attempt holds a live lease.
	statusInProgress
	// statusMismatch: the record was made for another fingerprint.
	statusMismatch
	// statusResultExpired: the operation completed, but only the fact is
	// kept: a marker (see WithMarkerRetention) older than the retention.
	// Token is that of the claim that completed it.
	statusResultExpired
)

// claimReply is the answer of recordStore.Claim.
type claimReply struct {
	Status claimStatus
	// Token is the fencing token of the claim (statusClaimed) or of the claim
	// that completed the record (statusCompleted); zero otherwise.
	Token int64
	// Attempt counts the claims of this record, this one included, for
	// statusClaimed and statusCompleted; zero otherwise.
	Attempt int
	// Recovered is true when the claim took over a lease that had run out:
	// an earlier attempt may have partly run.
	Recovered bool
	// LeaseLeft is the time left on the other attempt's lease
	// (statusInProgress); zero otherwise.
	LeaseLeft time.Duration
	// Value is the stored result (statusCompleted); nil otherwise.
	Value []byte
	// Checkpoints are the recovery points an earlier attempt recorded in the
	// record (statusClaimed), oldest first; nil when there are none.
	Checkpoints []recoveryPoint
	// Ref is, for a claim a store made compactly (batchClaimRequest.
	// Compact), the store's own reference to it, greater than zero, which
	// the Keeper hands back in claimFence.Ref; zero for a claim kept in a record
	// of its own.
	Ref int
	// Marker is set when the answer came from a marker, what a compact
	// claim leaves once completed with nothing to keep (statusCompleted,
	// with an empty result, or statusResultExpired).
	Marker bool
}

// batchClaimRequest is what a store needs to claim many records.
type batchClaimRequest struct {
	// IDs are the records to claim; an id given twice is answered for its
	// first place only, the later places with ErrInvalidConfig.
	IDs []string
	// Fingerprints holds the fingerprint of each id's request, in base64url
	// (see claimRequest.Fingerprint), or is nil: none for every id.
	Fingerprints []string
	// Attempt identifies this batch call, in base64url: each record checks
	// it as claimRequest.Attempt, so a call whose reply was lost and that is
	// sent again gets the same claims.
	Attempt string
	// Lease, Keep, Retention and MarkerRetention are those of claimRequest,
	// for every record.
	Lease, Keep, Retention, MarkerRetention time.Duration
	// Compact asks the store to keep the new claims compactly, if it can,
	// rather than each in a record of its own: redisStore keeps a claim of
	// a record that is absent as an entry in an index and a place in one
	// record of the call, and what a completion with an empty result
	// leaves of it is a marker, a few bytes kept for MarkerRetention (see
	// WithMarkerRetention). The answers are those of Claim; a compact claim
	// carries a Ref.
	Compact bool

	// distinct is set by the Keeper, which gives each record once: the
	// store need not look for repeated IDs.
	distinct bool
}

// batchClaimReply answers one record of a store's ClaimBatch: Reply as
// Claim returns it, or Err, an error Claim would have returned.
type batchClaimReply struct {
	// Reply is the record's answer when Err is nil.
	Reply claimReply
	// Err is the record's error: ErrCorrupt, ErrInvalidConfig, or, as
	// anything else, the store's failure to answer for it.
	Err error
}

// maxToken is the largest fencing token a store hands out: tokens are 1 to
// 2^53-1, which a double (a Lua number, as redisStore's scripts hold them)
// holds exactly.
const maxToken = 1<<53 - 1

// claimFence names a claim: a record and the fencing token of its holder.
type claimFence struct {
	// ID is the record's id.
	ID string
	// Token is the fencing token the claim got.
	Token int64
	// Ref is claimReply.Ref of the claim: zero for a claim kept in a record
	// of its own.
	Ref int
}

// batchCompletion is one record of a store's SettleBatch.
type batchCompletion struct {
	// claimFence names the claim that completes the record.
	claimFence
	// Value is the result to store, already in its envelope; the store
	// must not change it.
	Value []byte
	// Keep is how long the result is kept.
	Keep time.Duration
}
