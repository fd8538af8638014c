package idem

import (
	"context"
	"fmt"
	"iter"
)

// The records by id: what an operator or a tool does with the records Scan
// lists or Inspect shows, which it knows by their id (Record.ID), the raw
// keys not being stored; the Keeper's placement (WithScopeShards) plays no
// part, the id saying where the record is.

// InspectRecord reads the record id (Record.ID, as Scan or Inspect reported
// it) as Inspect reads the record of a key, with Inspect's errors; an id
// no Keeper makes is refused with ErrInvalidKey, the store not touched.
func (k *Keeper) InspectRecord(ctx context.Context, id string) (Record, error) {
	started := k.startStep()
	r, err := checkID(id)
	if err == nil {
		r, err = k.inspectID(ctx, id)
	}
	k.reportRecord(ctx, StepInspect, "", started, r, err)
	return r, err
}

// ForgetRecord removes the record id if it is the record of token: the id
// and fencing token an operator was shown (Record.ID and Record.Token, by
// Inspect, Scan or idemctl), in one atomic step: compare and delete. A record of another token, a claim made
// since the operator looked, or the key completed by another attempt, is
// never touched, and neither is one made before go-redis sends a call whose
// reply was lost again. It returns the record as it was when removed, or,
// when there was nothing of token to remove (no record, or one of another
// token), a Record in StateAbsent and no error: Inspect tells what is at the
// key then. Otherwise it is Forget, whose documentation says what force
// removes and what is lost.
//
// Errors: those of Forget, ErrInvalidKey for an id no Keeper makes, and
// ErrInvalidConfig for a token no claim gets
// (less than 1, or more than 2^53-1); the store is not touched then.
func (k *Keeper) ForgetRecord(ctx context.Context, id string, token int64, force bool) (Record, error) {
	started := k.startStep()
	r, err := checkID(id)
	if err == nil {
		err = checkToken("forget", token)
	}
	if err == nil {
		r, err = k.forgetID(ctx, id, token, force)
	}
	k.reportRecord(ctx, StepForget, "", started, r, err)
	return r, err
}

// AbandonRecord ends the lease of the claim whose fencing token is token on
// the record id (Record.ID and Record.Token, as Inspect, Scan or idemctl
// showed them), and keeps its record, so that the next claim of the key takes it over at once, as it
// would once the lease ran out: Claim.Recovered is true, Attempt counts on,
// and the claim is handed the checkpoints the holder recorded
// (Claim.Checkpointed), its fingerprint still binding the key to its request.
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
// None of these is an error. AbandonRecord is safe to call again, and safe when
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
// Observer is told of each one (StepAbandon).
//
// Errors: ErrInvalidKey for an id no Keeper makes (the store is not
// touched), ErrInvalidConfig for a
// token no claim gets (less than 1, or more than 2^53-1; the store is not
// touched), ErrCorrupt (the value at the key is not a record this version
// can read; it is not changed), ErrUnavailable, the caller's own
// cancellation (as for Begin).
func (k *Keeper) AbandonRecord(ctx context.Context, id string, token int64) (Record, error) {
	started := k.startStep()
	r, err := checkID(id)
	if err == nil {
		err = checkToken("abandon", token)
	}
	if err == nil {
		r, err = k.abandonID(ctx, id, token)
	}
	k.reportRecord(ctx, StepAbandon, "", started, r, err)
	return r, err
}

// checkID refuses an id that no Keeper makes: the Record to return then
// holds the id.
func checkID(id string) (Record, error) {
	r := Record{ID: id}
	if len(id) != idLen {
		return r, fmt.Errorf("%w: record id %q: %d characters, not %d", ErrInvalidKey, id, len(id), idLen)
	}
	if !isBase64URL(id) {
		return r, fmt.Errorf("%w: record id %q: not base64url", ErrInvalidKey, id)
	}
	return r, nil
}

// Scan lists the Keeper's records, read as Inspect reads them, with Redis's
// SCAN: on the server a *redis.Client or *redis.Conn reaches, on every
// master of a *redis.ClusterClient, on every shard of a *redis.Ring, one
// server after the other. It holds at most one batch of records in memory,
// and each call to Redis is bounded: one SCAN with COUNT opts.Batch, then
// one pipeline of at most that many read-only scripts. SCAN walks the whole
// keyspace of each server: it is meant for operators and tools.
//
// Records are ids and Redis keys: the raw client keys are not stored. After
// the records of a server come its compact claims and markers, listed by
// the call that made them (the index keeps 56 bits of each id's digest, not
// the id): one Record with Compact set for each state its claims are in, ID
// empty, Key the call record's key and Claims their number. As with SCAN, a
// record made or removed while the listing runs may or may not be listed,
// one may be listed twice if Redis resizes its keyspace meanwhile, and one
// being moved between Cluster nodes may be missed or reported with a MOVED
// or ASK error.
//
// Each step yields a Record and nil, or an error:
//
//   - for one record that cannot be read (ErrCorrupt, or the error Redis
//     answered for its key), the Record holds its ID and Key, whatever
//     opts.State asks for, and the listing goes on if the loop does;
//   - for the listing itself (ErrInvalidConfig for bad options,
//     ErrUnavailable, the caller's own cancellation, errors.ErrUnsupported
//     for a client that cannot list, such as an AutoPipeliner: make the
//     Keeper on the client itself), the Record is zero and the listing ends.
func (k *Keeper) Scan(ctx context.Context, opts ScanOptions) iter.Seq2[Record, error] {
	rs, err := k.onRedis("scan")
	if err != nil {
		return func(yield func(Record, error) bool) { yield(Record{}, err) }
	}
	return rs.Scan(ctx, opts)
}

// onRedis is the Keeper's store, which its Redis-only methods need.
func (k *Keeper) onRedis(op string) (*redisStore, error) {
	if rs, ok := k.store.(*redisStore); ok {
		return rs, nil
	}
	return nil, fmt.Errorf("%w: %s: the Keeper's store is not a Redis store", ErrInvalidConfig, op)
}
