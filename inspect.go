package idem

import (
	"context"
	_ "embed"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed lua/inspect.lua
	inspectBody string
	// inspectLua is inspect.lua after lib.lua, whose functions it uses.
	inspectLua    = luaScript(inspectBody)
	inspectScript = redis.NewScript(inspectLua)
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
	// the Store is given. The raw key is not stored and cannot be recovered.
	ID string
	// Key is where the store keeps the record: for a RedisStore, its Redis
	// key (prefix + "{" + ID + "}", or for an ID placed by WithScopeShards
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
	// the store's index: a claim of Consume, or of BeginBatch with
	// WithCompactClaims (see WithMarkerRetention). Its Attempt is 1, it has
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
	r, err := k.store.Inspect(ctx, k.RecordID(scope, key))
	return r, storeError(ctx, "inspect", err)
}

// Inspect implements Store with one read-only script, one round trip.
// id is a record id (Record.ID, or what the Keeper makes of a scope and key).
// Errors: ErrInvalidKey for an id that is not one, ErrCorrupt,
// ErrUnavailable, and the caller's own cancellation.
func (s *RedisStore) Inspect(ctx context.Context, id string) (Record, error) {
	if err := checkRecordID(id); err != nil {
		return Record{}, err
	}
	if ctx.Err() != nil {
		return Record{}, canceled(ctx, "inspect")
	}
	rk := s.key(id)
	keys, args, err := s.withIndex(ctx, id, rk, 0)
	if err != nil {
		return Record{ID: id, Key: rk}, err
	}
	res, err := s.runIndexed(ctx, inspectScript, keys, args)
	if err != nil {
		return Record{ID: id, Key: rk}, storeError(ctx, "inspect", s.layoutError(err))
	}
	code, r, err := parseRecordReply(id, rk, res)
	if err == nil && (code == recordUnchanged || code == recordRefused) {
		return r, unexpected(res)
	}
	return r, err
}

// withIndex returns the keys and the arguments after args with which an
// operator script (inspect.lua, forget.lua, abandon.lua) reads the record
// id at key rk and, when there is none, its compact claim or marker: the
// index key and, for a token not 0, the call record key of that token;
// the first 8 bytes of the record's digest and the start of the call
// record keys (see lib.lua).
func (s *RedisStore) withIndex(ctx context.Context, id, rk string, token int64, args ...any) ([]string, []any, error) {
	if err := s.layoutReady(ctx); err != nil {
		return nil, nil, err
	}
	d8, index, calls := s.compactIndexArgs(id)
	keys := []string{rk, index}
	if token != 0 {
		keys = append(keys, calls+strconv.FormatInt(token, 10))
	}
	return keys, append(args, d8, calls), nil
}

// runIndexed runs the operator script sc with the keys and args withIndex
// made, and, while it answers {10, token} (the record's entry is held by a
// call whose call record it was not given), again with that call record
// as its third key: every key the script reads is one of its keys.
func (s *RedisStore) runIndexed(ctx context.Context, sc *redis.Script, keys []string, args []any) ([]any, error) {
	calls := args[len(args)-1].(string)
	for asked := 0; ; asked++ {
		res, err := sc.Run(ctx, s.client, keys, args...).Slice()
		if err != nil {
			return nil, err
		}
		tok, ok := callAsked(res)
		if !ok {
			return res, nil
		}
		if asked == maxCallAsks {
			return nil, fmt.Errorf("%w: the index entry of the key moved to another call %d times while it was read", ErrUnavailable, asked+1)
		}
		keys = append(keys[:2:2], calls+strconv.FormatInt(tok, 10))
	}
}

// checkRecordID refuses an id that no Keeper makes.
func checkRecordID(id string) error {
	if len(id) != idLen || !isBase64URL(id) {
		return fmt.Errorf("%w: record id %q is not %d base64url characters", ErrInvalidKey, id, idLen)
	}
	return nil
}

// parseRecordReply reads a reply of inspect.lua, forget.lua or abandon.lua:
// {code, now_s, now_us} for no record, {code, header, pttl, rest_len,
// rest_head, now_s, now_us[, checkpoints]} for a record (codes 1 to 3),
// {code, header, pttl, rest_len, rest_head, now_s, now_us, 0, done_us} for
// a compact claim or a marker (codes 1 to 3, and 6 for inspect.lua), {5,
// reason} for a value that is not one. It returns the reply's code and the
// record.
func parseRecordReply(id, key string, res []any) (int64, Record, error) {
	r := Record{ID: id, Key: key}
	code := replyCode(res)
	// A record is answered by recordDone, recordUnchanged or recordRefused.
	described := code >= recordDone && code <= recordRefused
	switch {
	case code == replyNotOurs:
		return code, r, corrupt(res)
	case code == recordNone && len(res) == 3:
		return code, r, nil
	case described && (len(res) == 7 || len(res) == 8):
		r, err := parseRecord(r, res)
		return code, r, err
	case (described || code == recordCompact) && len(res) == 9:
		// A compact claim or a marker, described as a record: its call
		// record's PTTL, no checkpoints, when the call completed it.
		r, err := parseRecord(r, res[:7])
		done, ok := res[8].(int64)
		if err == nil && !ok {
			err = unexpected(res)
		}
		r.Compact = true
		if r.State == StateCompleted && done > 0 {
			r.CompletedAgo = max(0, r.ReadAt.Sub(time.UnixMicro(done)))
		}
		return code, r, err
	}
	return code, r, unexpected(res)
}

// parseRecord reads the record in a reply {code, header, pttl, rest_len,
// rest_head, now_s, now_us[, checkpoints]} into r.
func parseRecord(r Record, res []any) (Record, error) {
	head, ok1 := res[1].(string)
	pttl, ok2 := res[2].(int64)
	restLen, ok3 := res[3].(int64)
	restHead, ok4 := res[4].(string)
	if !ok1 || !ok2 || !ok3 || !ok4 {
		return r, unexpected(res)
	}
	now, err := redisNow(res[5], res[6])
	if err != nil {
		return r, err
	}
	if r, err = parseHeader(r, head, now); err != nil {
		return r, err
	}
	r.ExpiresIn = time.Duration(pttl) * time.Millisecond
	if pttl < 0 {
		r.ExpiresIn = -1
	}
	r.ReadAt = time.UnixMicro(now)
	if len(res) == 8 {
		if r.Checkpoints, err = parseCheckpointInfo(res[7]); err != nil {
			return r, err
		}
	}
	return r, r.setResult(restLen, restHead)
}

// parseCheckpointInfo reads the checkpoints of a reply: {name, size, ...}.
func parseCheckpointInfo(v any) ([]CheckpointInfo, error) {
	flat, ok := v.([]any)
	if !ok || len(flat) == 0 || len(flat)%2 != 0 {
		return nil, fmt.Errorf("%w: checkpoints %v", ErrCorrupt, v)
	}
	cps := make([]CheckpointInfo, 0, len(flat)/2)
	for i := 0; i < len(flat); i += 2 {
		name, ok1 := flat[i].(string)
		size, ok2 := flat[i+1].(int64)
		if !ok1 || !ok2 || name == "" || size < 0 {
			return nil, fmt.Errorf("%w: checkpoints %v", ErrCorrupt, v)
		}
		cps = append(cps, CheckpointInfo{Name: name, Size: int(size)})
	}
	return cps, nil
}

// redisNow reads Redis's TIME, seconds and microseconds, as microseconds.
func redisNow(sec, usec any) (int64, error) {
	s, ok1 := sec.(string)
	us, ok2 := usec.(string)
	if ok1 && ok2 {
		a, err1 := strconv.ParseInt(s, 10, 64)
		b, err2 := strconv.ParseInt(us, 10, 64)
		if err1 == nil && err2 == nil {
			return a*1_000_000 + b, nil
		}
	}
	return 0, fmt.Errorf("%w: unexpected TIME %v %v", ErrCorrupt, sec, usec)
}

// setResult reads what follows the header: for a completed record, the
// envelope of its result, of which restHead holds the first two bytes and
// restLen counts every byte. What follows the header of a pending or
// released record is not a result, and is left to the version that wrote it.
func (r *Record) setResult(restLen int64, restHead string) error {
	if r.State != StateCompleted {
		return nil
	}
	switch {
	case restLen < 2 || len(restHead) < 2:
		return fmt.Errorf("%w: envelope of %d bytes", ErrCorrupt, restLen)
	case restHead[0] != envelopeV1:
		return fmt.Errorf("%w: envelope format %d unknown", ErrCorrupt, restHead[0])
	case restHead[1] == 0:
		return fmt.Errorf("%w: envelope kind 0", ErrCorrupt)
	}
	r.Stored, r.Size = StoredKind(restHead[1]), int(restLen-2)
	if restHead[1] == kindMarker {
		// An empty result kept as a marker is (markerEnvelope).
		r.Stored, r.Size = StoredBytes, 0
	}
	return nil
}
