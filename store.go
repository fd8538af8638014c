package idem

import (
	"context"
	"time"
)

// Store keeps idempotency records. Every method is one atomic step; the Redis
// implementation (RedisStore) makes each one Lua script and one round trip.
//
// id is the record's fixed-length id, a digest of (scope, key) made by the
// Keeper; a Store never sees raw client keys. Tokens are the fencing tokens
// the Store handed out in Claim.
//
// Errors: ErrLeaseLost when the token is not the current holder's,
// ErrCorrupt when the value at the key is not a record, and anything else is
// read as the store being unavailable (ErrUnavailable).
type Store interface {
	// Claim claims the record for one attempt, or reports its state.
	Claim(ctx context.Context, id string, req ClaimRequest) (ClaimReply, error)
	// Complete stores value as the record's result, kept for keep, if token
	// is the current holder's. A retried Complete with the same token succeeds.
	Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) error
	// Release gives the claim up, if token is the current holder's, so the
	// next claim runs the operation again; the token and attempt count are
	// remembered for keep. A retried Release with the same token succeeds.
	Release(ctx context.Context, id string, token int64, keep time.Duration) error
	// Extend renews the lease of token to lease from now, and keeps the
	// pending record for keep.
	Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error
}

// ClaimRequest is what a Store needs to claim a record.
type ClaimRequest struct {
	// Fingerprint is a digest of the request, in base64url; may be empty.
	// A record claimed with one fingerprint answers StatusMismatch to another.
	Fingerprint string
	// Attempt identifies this attempt, in base64url. A Claim that finds a
	// pending record with the same Attempt answers StatusClaimed with the same
	// token: the caller is retrying a command whose reply was lost.
	Attempt string
	// Lease is how long the claim may run without renewal.
	Lease time.Duration
	// Keep is how long a pending record is kept, at least Lease.
	Keep time.Duration
	// Retention and MarkerRetention say how a marker answers (see
	// WithMarkerRetention): one younger than Retention as a completed
	// record with an empty result, one younger than MarkerRetention with
	// StatusResultExpired, an older one not at all. Zero: a marker answers
	// as a completed record with an empty result for as long as it is kept.
	Retention, MarkerRetention time.Duration
}

// ClaimStatus is what a Store's Claim found.
type ClaimStatus uint8

// The answers of Store.Claim.
const (
	// StatusClaimed: the caller holds the record and must run the operation.
	StatusClaimed ClaimStatus = iota + 1
	// StatusCompleted: the operation completed; Value holds its result.
	StatusCompleted
	// StatusInProgress: another attempt holds a live lease.
	StatusInProgress
	// StatusMismatch: the record was made for another fingerprint.
	StatusMismatch
	// StatusResultExpired: the operation completed, but only the fact is
	// kept: a marker (see WithMarkerRetention) older than the retention.
	// Token is that of the claim that completed it.
	StatusResultExpired
)

// ClaimReply is the answer of Store.Claim.
type ClaimReply struct {
	Status ClaimStatus
	// Token is the fencing token of the claim (StatusClaimed) or of the claim
	// that completed the record (StatusCompleted); zero otherwise.
	Token int64
	// Attempt counts the claims of this record, this one included, for
	// StatusClaimed and StatusCompleted; zero otherwise.
	Attempt int
	// Recovered is true when the claim took over a lease that had run out:
	// an earlier attempt may have partly run.
	Recovered bool
	// LeaseLeft is the time left on the other attempt's lease
	// (StatusInProgress); zero otherwise.
	LeaseLeft time.Duration
	// Value is the stored result (StatusCompleted); nil otherwise.
	Value []byte
	// Checkpoints are the recovery points an earlier attempt recorded in the
	// record (StatusClaimed), oldest first; nil when there are none or the
	// Store keeps none (see CheckpointStore).
	Checkpoints []Checkpoint
	// Ref is, for a claim a BatchStore made compactly (BatchClaimRequest.
	// Compact), the store's own reference to it, greater than zero, which
	// the Keeper hands back in Fence.Ref; zero for a claim kept in a record
	// of its own.
	Ref int
	// Marker is set when the answer came from a marker, what a compact
	// claim leaves once completed with nothing to keep (StatusCompleted,
	// with an empty result, or StatusResultExpired).
	Marker bool
}

// BatchStore is a Store that also takes each step for many records at once.
// The Keeper uses it for BeginBatch, CompleteBatch, ReleaseBatch,
// ExtendBatch and Consume when its Store implements it; with any other Store
// it takes the step one record at a time, with the same answers.
//
// Each method answers every record on its own, in the order given: a record
// whose step failed (ErrLeaseLost, ErrCorrupt, its Redis node unreachable)
// does not fail the others. The answers are exactly those of the single-record
// method. RedisStore sends one script call per chunk of up to BatchChunk
// records, all of a node's share in one pipeline: one round trip per Redis
// node and step.
type BatchStore interface {
	Store
	// ClaimBatch claims every record of req, with req's attempt id, lease and
	// keep, and answers each as Claim would.
	ClaimBatch(ctx context.Context, req BatchClaimRequest) []BatchClaimReply
	// CompleteBatch stores each item's value, as Complete would.
	CompleteBatch(ctx context.Context, items []BatchCompletion) []error
	// ReleaseBatch gives up each claim, as Release would, the released
	// marker kept for keep.
	ReleaseBatch(ctx context.Context, claims []Fence, keep time.Duration) []error
	// ExtendBatch renews the lease of each claim, as Extend would.
	ExtendBatch(ctx context.Context, claims []Fence, lease, keep time.Duration) []error
}

// BatchClaimRequest is what a BatchStore needs to claim many records.
type BatchClaimRequest struct {
	// IDs are the records to claim; an id given twice is answered for its
	// first place only, the later places with ErrInvalidConfig.
	IDs []string
	// Fingerprints holds the fingerprint of each id's request, in base64url
	// (see ClaimRequest.Fingerprint), or is nil: none for every id.
	Fingerprints []string
	// Attempt identifies this batch call, in base64url: each record checks
	// it as ClaimRequest.Attempt, so a call whose reply was lost and that is
	// sent again gets the same claims.
	Attempt string
	// Lease, Keep, Retention and MarkerRetention are those of ClaimRequest,
	// for every record.
	Lease, Keep, Retention, MarkerRetention time.Duration
	// Compact asks the store to keep the new claims compactly, if it can,
	// rather than each in a record of its own: RedisStore keeps a claim of
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

// BatchClaimReply answers one record of a BatchStore's ClaimBatch: Reply as
// Claim returns it, or Err, an error Claim would have returned.
type BatchClaimReply struct {
	// Reply is the record's answer when Err is nil.
	Reply ClaimReply
	// Err is the record's error: ErrCorrupt, ErrInvalidConfig, or, as
	// anything else, the store's failure to answer for it.
	Err error
}

// Fence names a claim: a record and the fencing token of its holder.
type Fence struct {
	// ID is the record's id.
	ID string
	// Token is the fencing token the claim got.
	Token int64
	// Ref is ClaimReply.Ref of the claim: zero for a claim kept in a record
	// of its own.
	Ref int
}

// BatchCompletion is one record of a BatchStore's CompleteBatch.
type BatchCompletion struct {
	// Fence names the claim that completes the record.
	Fence
	// Value is the result to store, already in its envelope; the store
	// must not change it.
	Value []byte
	// Keep is how long the result is kept.
	Keep time.Duration
}

// CheckpointStore is a Store that keeps recovery points in pending records.
// Claim.Checkpoint needs it; RedisStore implements it.
//
// A record's checkpoints are written under its claim's fence, kept while it is
// pending, handed over to the next claim (ClaimReply.Checkpoints) when the
// lease ran out or the claim was released, and dropped when it completes.
type CheckpointStore interface {
	Store
	// Checkpoint records (name, value) in the pending record id if token is
	// the current holder's: ErrLeaseLost otherwise, and an error wrapping
	// ErrInvalidCheckpoint when the record holds MaxCheckpoints other
	// checkpoints; nothing is written then. A checkpoint recorded again under
	// its name replaces the earlier one and becomes the last. A retried
	// Checkpoint with the same arguments succeeds.
	Checkpoint(ctx context.Context, id string, token int64, name string, value []byte) error
}
