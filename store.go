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
}
