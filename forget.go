package idem

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ForgetRefusedError is the error of a Forget without force whose record
// holds what removing it would lose; nothing was removed. errors.Is(err,
// ErrInProgress) reports true for it, and errors.As finds an
// *InProgressError in it, when the record's lease is live.
type ForgetRefusedError struct {
	// LeaseLeft is the time left on the record's lease when it is live: a
	// claim holds the key, and its operation may be running. Removed, the
	// record would let the next call run the operation beside it, not told
	// it is Recovered. Zero when no lease is live.
	LeaseLeft time.Duration
	// Checkpoints are the checkpoints the record holds (Claim.Checkpoint):
	// steps of the operation that have happened. Removed, the record would
	// not hand them to the next attempt, which would do those steps again.
	// Nil when there are none.
	Checkpoints []CheckpointInfo
}

// Error implements error: what would be lost.
func (e *ForgetRefusedError) Error() string {
	var b strings.Builder
	b.WriteString("idem: forget refused:")
	if e.LeaseLeft > 0 {
		fmt.Fprintf(&b, " the lease is live (it ends in %s): an operation may be running;", e.LeaseLeft)
	}
	if n := len(e.Checkpoints); n > 0 {
		names := make([]string, n)
		for i, c := range e.Checkpoints {
			names[i] = strconv.Quote(c.Name)
		}
		fmt.Fprintf(&b, " the record holds %d checkpoint(s) (%s): steps that happened, which the next attempt would do again;", n, strings.Join(names, ", "))
	}
	b.WriteString(" force removes it anyway")
	return b.String()
}

// Unwrap returns an *InProgressError when the lease is live, else nil.
func (e *ForgetRefusedError) Unwrap() error {
	if e.LeaseLeft <= 0 {
		return nil
	}
	return &InProgressError{RetryAfter: max(e.LeaseLeft, time.Millisecond)}
}

// Forget removes the record of (scope, key), so that the next call with
// the key runs the operation as if it had never been seen: attempt 1, a
// new token, Recovered false. It is meant for an operator (a customer must
// be able to use a key again), not for an application's paths; an
// operator who was shown a record names it and its token with
// ForgetRecord.
//
// It reads the record and removes it by the token it read: a claim made
// after that read is never touched. It returns the record as it was when
// removed or, when there was nothing to remove, a Record in StateAbsent and
// no error.
//
// Without force it removes nothing and returns a *ForgetRefusedError, its
// Record saying what was found, for a pending record whose lease is live
// (errors.Is(err, ErrInProgress); RetryAfter is the lease left) or a record
// that holds checkpoints. With force it removes the record anyway: the
// holder, if any, gets ErrLeaseLost at its next step and stores nothing (its
// side effect is not undone), and the next claim runs the operation again
// from its first step, not told Recovered. A dead holder's claim is better
// ended by Abandon, which keeps the record (see docs/operating.md).
//
// Errors: ErrInvalidKey (the store is not touched), a *ForgetRefusedError,
// ErrCorrupt (a value that is not a record this version can read; never
// removed, even with force), ErrUnavailable, the caller's own cancellation
// (as for Begin).
func (k *Keeper) Forget(ctx context.Context, scope, key string, force bool) (Record, error) {
	started := k.startStep()
	r, err := k.forget(ctx, scope, key, 0, force)
	k.reportRecord(ctx, StepForget, scope, started, r, err)
	return r, err
}

// forgetToken is ForgetRecord for the record of (scope, key).
func (k *Keeper) forgetToken(ctx context.Context, scope, key string, token int64, force bool) (Record, error) {
	started := k.startStep()
	var r Record
	err := checkToken("forget", token)
	if err == nil {
		r, err = k.forget(ctx, scope, key, token, force)
	}
	k.reportRecord(ctx, StepForget, scope, started, r, err)
	return r, err
}

// checkToken refuses a token that no claim gets.
func checkToken(op string, token int64) error {
	if token < 1 || token > maxToken {
		return fmt.Errorf("%w: %s: token %d names no claim (tokens are 1 to %d)", ErrInvalidConfig, op, token, int64(maxToken))
	}
	return nil
}

// forget removes the record of (scope, key) of token, or of the token it
// reads first when token is 0; see Forget and ForgetRecord.
func (k *Keeper) forget(ctx context.Context, scope, key string, token int64, force bool) (Record, error) {
	if err := ValidateKey(key); err != nil {
		return Record{}, err
	}
	if err := k.placementReady(ctx, false); err != nil {
		return Record{}, storeError(ctx, "forget", err)
	}
	return k.forgetID(ctx, k.RecordID(scope, key), token, force)
}

// forgetID removes the record id of token, or of the token it reads first
// when token is 0.
func (k *Keeper) forgetID(ctx context.Context, id string, token int64, force bool) (Record, error) {
	if token == 0 {
		r, err := k.store.Inspect(ctx, id)
		if err != nil || r.State == StateAbsent {
			return r, storeError(ctx, "forget", err)
		}
		token = r.Token
	}
	r, err := k.store.Forget(ctx, id, token, force)
	if k.cache != nil {
		k.cache.drop(id)
	}
	var refused *ForgetRefusedError
	if err != nil && !errors.As(err, &refused) {
		err = storeError(ctx, "forget", err)
	}
	return r, err
}
