package idem

import (
	"context"
)

// Abandon ends the lease of the claim of (scope, key) whose fencing token is
// token (Record.Token, as Inspect or idemctl showed it), and keeps its
// record, so that the next claim of the key takes it over at once, as it
// would once the lease ran out: Claim.Recovered is true, Attempt counts on,
// and the claim is handed the checkpoints the holder recorded
// (Claim.Checkpoints), its fingerprint still binding the key to its request.
// It is the tool for a holder known to be dead (its process was killed, its
// machine lost) whose lease would otherwise block the key until it runs
// out; Forget is for erasing a record.
//
// It returns the record as it is after the call:
//
//   - StatePending, Token == token, LeaseLeft <= 0: the lease is over (this
//     call ended it, or it had run out); the next claim takes the key over;
//   - anything else: nothing was changed: the key was completed (its result
//     replays), released, taken over by a claim made since the operator
//     looked (another Token: that claim is left alone), or has no record
//     (StateAbsent).
//
// None of these is an error. Abandon is safe to call again, and safe when
// go-redis sends it again after a lost reply: the second run finds the lease
// already over, or the claim made since, and changes nothing.
//
// A holder that is in fact alive is not told at once. Until another attempt
// claims the key, its next renewal gives it its lease back (the key is in
// progress again). Once another attempt has claimed the key, the holder's
// next renewal, Complete, Release or Checkpoint gets ErrLeaseLost and writes
// nothing, and Do and KeepAlive cancel its operation's context then: until
// that renewal, at most a third of the holder's lease, both may run.
// Abandon only a claim whose holder is known to be dead. The Keeper's
// Observer is told of each Abandon (StepAbandon).
//
// Errors: ErrInvalidKey (the store is not touched), ErrInvalidConfig for a
// token no claim gets (less than 1, or more than 2^53-1; the store is not
// touched), ErrCorrupt (the value at the key is not a record this version
// can read; it is not changed), ErrUnavailable, the caller's own
// cancellation (as for Begin).
func (k *Keeper) Abandon(ctx context.Context, scope, key string, token int64) (Record, error) {
	started := k.startStep()
	r, err := k.abandon(ctx, scope, key, token)
	k.reportRecord(ctx, StepAbandon, scope, started, r, err)
	return r, err
}

func (k *Keeper) abandon(ctx context.Context, scope, key string, token int64) (Record, error) {
	if err := ValidateKey(key); err != nil {
		return Record{}, err
	}
	if err := checkToken("abandon", token); err != nil {
		return Record{}, err
	}
	if err := k.placementReady(ctx, false); err != nil {
		return Record{}, storeError(ctx, "abandon", err)
	}
	return k.abandonID(ctx, k.RecordID(scope, key), token)
}

// abandonID ends the lease of token on the record id; see Abandon.
func (k *Keeper) abandonID(ctx context.Context, id string, token int64) (Record, error) {
	r, err := k.store.Abandon(ctx, id, token)
	return r, storeError(ctx, "abandon", err)
}
