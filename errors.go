package idem

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"
)

// Sentinel errors. Match them with errors.Is: the errors idem returns wrap
// them with detail, and errors from the store also wrap the cause (a network
// error, context.DeadlineExceeded, a Redis error reply).
var (
	// ErrInvalidKey reports a key refused before the store is touched: empty,
	// longer than MaxKeyLen bytes, or holding control characters.
	ErrInvalidKey = errors.New("idem: invalid key")

	// ErrInProgress reports that another attempt holds a live lease on the
	// key. The error is an *InProgressError that says how long the lease has
	// left.
	ErrInProgress = errors.New("idem: operation in progress")

	// ErrMismatch reports that the key was first used with another request
	// (another fingerprint). It is a client error, never a replay.
	ErrMismatch = errors.New("idem: key reused with a different request")

	// ErrLeaseLost reports that a claim is no longer the current holder of its
	// key: its record was released, completed, taken over after the lease ran
	// out, or expired. Nothing was written by the call that returns it. (A
	// Release whose reply was lost and that go-redis sent again can find the
	// key already claimed by the next attempt and return ErrLeaseLost although
	// its first run did release: either way the claim is no longer held.)
	ErrLeaseLost = errors.New("idem: lease lost")

	// ErrUnavailable reports that the store could not answer: connection
	// refused, timeout, a server loading its data or read-only. The outcome of
	// the operation is unknown; it is never reported as "key not seen".
	ErrUnavailable = errors.New("idem: store unavailable")

	// ErrCorrupt reports that the value stored at a key is not an idem record,
	// or cannot be decoded. Nothing is overwritten.
	ErrCorrupt = errors.New("idem: corrupt record")

	// ErrInvalidConfig reports a constructor argument or option that cannot
	// work, such as a nil client or a lease shorter than zero, or a store
	// whose keys are written otherwise than the Keeper would: an index of
	// another layout, or a prefix of another placement (WithScopeShards).
	ErrInvalidConfig = errors.New("idem: invalid configuration")

	// ErrNoClaim reports a step (Complete, Release, Extend, Checkpoint)
	// asked of a nil *Claim: the one ClaimFromContext returns for a context
	// that carries no claim, such as a handler on a route the middleware
	// does not guard or one it runs fail-open. Nothing was written.
	ErrNoClaim = errors.New("idem: no claim")
)

// InProgressError is returned when another attempt holds a live lease on the
// key. errors.Is(err, ErrInProgress) reports true for it.
type InProgressError struct {
	// RetryAfter is the time left on the other attempt's lease, as Redis
	// measured it; at least one millisecond.
	RetryAfter time.Duration
}

// Error implements error.
func (e *InProgressError) Error() string {
	return fmt.Sprintf("%s (lease ends in %s)", ErrInProgress.Error(), e.RetryAfter)
}

// Is reports whether target is ErrInProgress.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// FinalError marks the error of an operation as its final outcome: Do stores
// it like a result, and every later call with the same key gets it back
// instead of running the operation again. Make one with Final, or with
// FinalCode to give it a code and details that callers (and an HTTP or gRPC
// layer) can map, since a replay cannot bring back the error's type.
type FinalError struct {
	// Err is the operation's error. On a replay it is an error whose message is
	// the original message; its type and wrapped errors are not kept: match a
	// replayed error on Code, not with errors.Is.
	Err error
	// Code names the error for programs, such as "card_declined": stored
	// and replayed as is. Empty when there is none.
	Code string
	// Details are small facts about the error, such as {"decline_code":
	// "insufficient_funds"}: stored with the record and replayed as they
	// were, every key and value. Nil when there are none; a replay gets a
	// map of its own. Keep them small: they are kept in Redis with the key
	// for the error retention.
	Details map[string]string
	// Replayed is true when the error comes from the store rather than from
	// this call's operation.
	Replayed bool
}

// Final wraps err so that Do stores it and replays it. Final(nil) is nil.
// A replay gets the message alone; use FinalCode to keep a code too.
func Final(err error) error {
	if err == nil {
		return nil
	}
	return &FinalError{Err: err}
}

// FinalCode wraps err like Final, with a code and details that Do stores
// with the message and gives back on every replay (FinalError.Code and
// Details). details is copied; it may be nil. FinalCode(nil, ...) is nil.
func FinalCode(err error, code string, details map[string]string) error {
	if err == nil {
		return nil
	}
	return &FinalError{Err: err, Code: code, Details: maps.Clone(details)}
}

// Error implements error: the operation's error's message. A FinalError
// made without Err says so, with its code.
func (e *FinalError) Error() string {
	if e.Err == nil {
		return "idem: final error " + strconv.Quote(e.Code)
	}
	return e.Err.Error()
}

// Unwrap returns the operation's error.
func (e *FinalError) Unwrap() error { return e.Err }

// storeError wraps err from a store as ErrUnavailable unless it already
// carries one of idem's sentinels, or unless ctx, the caller's context, has
// ended: the caller's own cancellation is not the store's failure, and is
// reported by canceled.
func storeError(ctx context.Context, op string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrCorrupt) || errors.Is(err, ErrUnavailable) || errors.Is(err, ErrInvalidConfig) {
		return err
	}
	if ctx.Err() != nil {
		return canceled(ctx, op)
	}
	return fmt.Errorf("%w: %s: %w", ErrUnavailable, op, err)
}

// canceled is the error of a call whose caller's context ended: it wraps
// ctx.Err() (context.Canceled or context.DeadlineExceeded) and the context's
// cause, and neither ErrUnavailable nor any other of idem's sentinels.
func canceled(ctx context.Context, op string) error {
	err, cause := ctx.Err(), context.Cause(ctx)
	if cause == nil || cause == err {
		return fmt.Errorf("idem: %s: the caller's context ended: %w", op, err)
	}
	return fmt.Errorf("idem: %s: the caller's context ended: %w: %w", op, err, cause)
}
