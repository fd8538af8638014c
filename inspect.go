package idem

import (
	"context"
	"fmt"
	"strconv"
	"time"
)

// RecordState is the state of a record as Inspect finds it.
type RecordState uint8

// The states of a record.
const (
	// StateAbsent: there is no record; a claim of the key runs the operation
	// (attempt 1). It is the zero value.
	StateAbsent RecordState = iota
	// StatePending: a claim holds the record, or held it and stopped renewing
	// its lease (Record.LeaseLeft says which).
	StatePending
	// StateCompleted: the operation completed; retries get its result.
	StateCompleted
	// StateReleased: the last claim gave the key up; the next claim runs the
	// operation again, with a higher token and the next attempt number.
	StateReleased
)

// String returns "absent", "pending", "completed" or "released".
func (s RecordState) String() string {
	switch s {
	case StateAbsent:
		return "absent"
	case StatePending:
		return "pending"
	case StateCompleted:
		return "completed"
	case StateReleased:
		return "released"
	}
	return "state(" + strconv.Itoa(int(s)) + ")"
}

// StoredKind says what the result of a completed record is. A kind this version does not
// know (written by a later version) is reported as itself, not as an error.
type StoredKind byte

// The kinds of stored result.
const (
	// StoredNone: no result (the record is not completed).
	StoredNone StoredKind = 0
	// StoredBytes: the bytes given to Claim.Complete. A response stored by
	// the HTTP middleware (package idemhttp) is of this kind.
	StoredBytes = StoredKind(kindBytes)
	// StoredValue: a value of Do, encoded by the Keeper's Codec.
	StoredValue = StoredKind(kindValue)
	// StoredError: the message of a final error of Do (Final).
	StoredError = StoredKind(kindError)
	// StoredCodedError: a final error of Do with a code or details
	// (FinalCode).
	StoredCodedError = StoredKind(kindFinal)
)

// String returns "none", "bytes", "value", "error", "coded error", or for a kind this
// version does not know, "unknown" and the kind byte.
func (k StoredKind) String() string {
	switch k {
	case StoredNone:
		return "none"
	case StoredBytes:
		return "bytes"
	case StoredValue:
		return "value"
	case StoredError:
		return "error"
	case StoredCodedError:
		return "coded error"
	}
	return fmt.Sprintf("unknown (%q)", byte(k))
}

// Record is what Inspect, Forget, Abandon and Scan read of one record.
// Durations are measured by Redis's clock, at the moment the record was read
// (ReadAt).
type Record struct {
	// ID is the record's id: the fixed-length digest of (scope, key) that
	// the store is given. The raw key is not stored and cannot be recovered.
	ID string
	// Key is where the store keeps the record: its Redis key
	// (prefix + "{" + ID + "}", or for an ID placed by WithScopeShards
	// prefix + "{" + its last 6 characters + "}" + its first 16). Empty
	// when the store does not say.
	Key string
	// State is the record's state; StateAbsent when there is none, and then
	// every other field but ID and Key is zero.
	State RecordState
	// Token is the fencing token of the claim that holds the record
	// (pending), completed it (completed) or gave it up (released).
	Token int64
	// Attempt counts the claims of the key so far, the one of Token included.
	Attempt int
	// Recovered is true when the claim of Token took over an abandoned
	// claim (Claim.Recovered).
	Recovered bool
	// LeaseLeft is, for a pending record, the time left on its lease. Zero or
	// less means the lease has run out that long ago: its holder stopped
	// renewing it (crashed, paused, partitioned), and the next claim takes
	// the key over with Claim.Recovered set. Zero for other states.
	LeaseLeft time.Duration
	// ExpiresIn is the time until Redis drops the record (its PTTL): the
	// retention left for a completed record; -1 when the key has no expiry,
	// which idem never leaves. Zero when absent.
	ExpiresIn time.Duration
	// Age is the time since the claim of Token was made. It is read off the
	// token, which is Redis's clock in microseconds when the claim was made
	// unless the key's tokens had run ahead of the clock (more than one claim
	// of the key in a microsecond); never negative.
	Age time.Duration
	// Fingerprint reports whether the record was claimed with a fingerprint
	// (WithFingerprint; always, for a record of the HTTP middleware). The
	// fingerprint itself is a digest and is not shown.
	Fingerprint bool
	// Stored is the kind of the stored result of a completed record;
	// StoredNone otherwise.
	Stored StoredKind
	// Size is the stored result's size in bytes, without idem's header and
	// envelope: the bytes given to Claim.Complete, the Codec's encoding of a
	// value of Do, a final error's message, or the HTTP middleware's encoding
	// of a response. Zero unless completed.
	Size int
	// Checkpoints are the checkpoints a pending or released record holds
	// (Claim.Checkpoint), oldest first, by name and value size: the steps
	// of the operation that have happened, which the next claim of the key
	// is handed (and which Forget would lose). Their values are not read.
	// Nil when there are none, for other states, and when what follows the
	// header cannot be read as checkpoints (a later version's data): a claim,
	// Forget and Abandon then answer ErrCorrupt.
	Checkpoints []CheckpointInfo
	// Compact is set when the key has no record of its own but a compact
	// claim (StatePending, StateReleased) or a marker (StateCompleted) in
	// the store's index: a claim of Consume (see WithMarkerRetention). Its
	// Attempt is 1, it has
	// no checkpoints, and a marker's result is empty (StoredBytes, Size 0);
	// ExpiresIn is how long Redis keeps the record of the call that made it,
	// the longest a marker can answer. In a Scan, a Record with Compact set
	// stands for the claims of one call in one State: see Claims.
	Compact bool
	// CompletedAgo is, for a marker, the time since its claim was completed:
	// it answers as a completed operation for the retention from then, and
	// as one whose result is no longer kept (ErrResultExpired) for the
	// marker retention. Zero otherwise.
	CompletedAgo time.Duration
	// Claims is, for a Record of Scan with Compact set, how many claims of
	// the call are in State: the index keeps a compact claim by 56 bits of
	// its id's digest, not the whole id, so Scan lists them by call (ID is
	// empty and Key is the call record's key). Zero otherwise.
	Claims int
	// ReadAt is Redis's clock when the record was read, from which
	// LeaseLeft, ExpiresIn and Age are measured: a pending record's lease
	// ends at ReadAt.Add(LeaseLeft), and its holder, if it stopped renewing,
	// loses the key then. Zero when absent.
	ReadAt time.Time
}

// CheckpointInfo describes one checkpoint of a record, as Inspect reads it:
// its name and the size of its value, not the value itself.
type CheckpointInfo struct {
	// Name is the checkpoint's name, as given to Claim.Checkpoint.
	Name string
	// Size is the length of its value in bytes, 0 to MaxCheckpointValue.
	Size int
}

// Inspect reads the record of (scope, key) without changing it: its state,
// token, attempt count, whether it was recovered, the lease left, when it
// expires, whether it has a fingerprint, the kind and size of its stored
// result, and the names and sizes of its checkpoints. A key with no record
// gives a Record in StateAbsent and no error.
//
// Of a pending record whose lease is live, Inspect knows that a claim holds
// the key until its lease ends (Record.ReadAt plus LeaseLeft), which
// attempt it is, and how long ago the key was claimed (Age); it cannot know
// whether the operation is still running: a holder that stopped renewing (a
// crashed or paused process) loses the key when its lease ends, and the next
// claim takes it over, Recovered. The record does not say when the lease
// was last renewed. Abandon ends the lease of a holder known to be dead.
//
// Errors: ErrInvalidKey (the store is not touched), ErrCorrupt (the value at
// the key is not a record that this version can read; the Record holds ID
// and Key), ErrUnavailable, and the caller's own cancellation (as for
// Begin).
func (k *Keeper) Inspect(ctx context.Context, scope, key string) (Record, error) {
	started := k.startStep()
	r, err := k.inspect(ctx, scope, key)
	k.reportRecord(ctx, StepInspect, scope, started, r, err)
	return r, err
}

// inspect reads the record of (scope, key); see Inspect.
func (k *Keeper) inspect(ctx context.Context, scope, key string) (Record, error) {
	if err := ValidateKey(key); err != nil {
		return Record{}, err
	}
	if err := k.placementReady(ctx, false); err != nil {
		return Record{}, storeError(ctx, "inspect", err)
	}
	return k.inspectID(ctx, k.RecordID(scope, key))
}

// inspectID reads the record id; see Inspect.
func (k *Keeper) inspectID(ctx context.Context, id string) (Record, error) {
	r, err := k.store.Inspect(ctx, id)
	return r, storeError(ctx, "inspect", err)
}
