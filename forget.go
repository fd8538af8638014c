package idem

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed lua/forget.lua
	forgetLua    string
	forgetScript = redis.NewScript(forgetLua)
)

// Forgetter is implemented by a Store that can remove a record; RedisStore
// does. Keeper.Forget needs it.
type Forgetter interface {
	// Forget removes the record id in one atomic step and returns it as it
	// was (StateAbsent if there was none). A pending record whose lease is
	// live is refused with an *InProgressError, unless force is true. A value
	// that is not a record is never removed (ErrCorrupt).
	Forget(ctx context.Context, id string, force bool) (Record, error)
}

var _ Forgetter = (*RedisStore)(nil)

// Forget removes the record of (scope, key), so that the next call with the
// key runs the operation as if it had never been seen: attempt 1, a new
// token, Recovered false. It returns the record as it was when removed, or a
// Record in StateAbsent, and no error, when there was none. It is meant for
// an operator (a support case: a customer must be able to use a key again),
// not for the paths of an application.
//
// A pending record whose lease is live, an operation running now, is refused
// with an *InProgressError (errors.Is(err, ErrInProgress); RetryAfter is the
// lease left), and the Record says what was found; nothing is removed. With
// force, it is removed anyway, and then:
//
//   - the holder is fenced off: its Complete, Release and Extend return
//     ErrLeaseLost and write nothing, and Do cancels its function's context
//     with ErrLeaseLost at the next lease renewal and stores nothing. Its
//     side effect, if it had one, is not undone;
//   - the next claim runs the operation again, beside the holder if it is
//     still running, and is not told so: the record that would have marked
//     it Recovered is gone. Force only a claim known to be dead, or one whose
//     operation is safe to run twice.
//
// A pending record whose lease has run out (its holder stopped renewing) is
// removed without force. Forgetting erases the key's token: the next claim's
// token is Redis's clock in microseconds, so the tokens of the key still
// increase unless Redis's clock went back, as after a record expires.
//
// A retried Forget is safe: a Forget whose reply was lost, which go-redis
// sends again, finds no record and returns StateAbsent; the record is gone
// either way.
//
// Errors: ErrInvalidKey (the store is not touched), an *InProgressError,
// ErrCorrupt (the value at the key is not a record this version can read; it
// is not removed, even with force), ErrUnavailable, the caller's own
// cancellation (as for Begin), and errors.ErrUnsupported when the Keeper's
// Store does not implement Forgetter.
func (k *Keeper) Forget(ctx context.Context, scope, key string, force bool) (Record, error) {
	started := k.startStep()
	r, err := k.forget(ctx, scope, key, force)
	k.reportRecord(ctx, StepForget, scope, started, r, err)
	return r, err
}

// forget removes the record of (scope, key); see Forget.
func (k *Keeper) forget(ctx context.Context, scope, key string, force bool) (Record, error) {
	if err := ValidateKey(key); err != nil {
		return Record{}, err
	}
	f, ok := k.store.(Forgetter)
	if !ok {
		return Record{}, fmt.Errorf("idem: forget: store %T does not implement Forgetter: %w", k.store, errors.ErrUnsupported)
	}
	id := recordID(scope, key)
	r, err := f.Forget(ctx, id, force)
	if k.cache != nil {
		k.cache.drop(id)
	}
	if err != nil && !errors.Is(err, ErrInProgress) {
		err = storeError(ctx, "forget", err)
	}
	return r, err
}

// Forget implements Forgetter with one script, one round trip. id is a record
// id (Record.ID, or what the Keeper makes of a scope and key). Its contract
// is Keeper.Forget's; an id that is not one is refused with ErrInvalidKey.
func (s *RedisStore) Forget(ctx context.Context, id string, force bool) (Record, error) {
	if err := checkRecordID(id); err != nil {
		return Record{}, err
	}
	if ctx.Err() != nil {
		return Record{}, canceled(ctx, "forget")
	}
	mode := ""
	if force {
		mode = "force"
	}
	rk := s.key(id)
	res, err := forgetScript.Run(ctx, s.client, []string{rk}, mode).Slice()
	if err != nil {
		return Record{ID: id, Key: rk}, storeError(ctx, "forget", err)
	}
	code, r, err := parseRecordReply(id, rk, res)
	if err != nil {
		return r, err
	}
	switch code {
	case 0, 1:
		return r, nil
	case 3:
		return r, fmt.Errorf("idem: forget refused: %w; force removes it anyway", &InProgressError{RetryAfter: max(r.LeaseLeft, time.Millisecond)})
	}
	return r, unexpected(res)
}
