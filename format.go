package idem

import (
	"fmt"
	"strconv"
	"strings"
	"time"
	"unsafe"
)

// format.go holds what RedisStore keeps in Redis and how its scripts
// answer: the formats of the record, the call record and the index entry,
// the Go readers of the record, and the named reply codes. lua/format.lua
// holds the same for the scripts (the Lua readers and writers of each
// format, and the codes by the same names and values: TestReplyCodesInLua
// holds the codes together). The golden tests pin the formats: a release
// reads every format an earlier one wrote (format_test.go for records,
// format_marker_test.go for the index and call records).
//
// The record, one Redis string at the record key, of two forms:
//
//	"i1" STATE TOKEN ":" ATTEMPT ":" REC ":" UNTIL ":" ATTEMPT_ID ":" FP ":" REST
//	"i1C:" FP ":" TOKEN36 ":" ATTEMPT ":" REC ":" PAYLOAD
//
// STATE is P (pending), C (completed) or R (released); TOKEN the fencing
// token in decimal (TOKEN36 the same in base 36, lower case); ATTEMPT how
// many claims the record has had; REC 1 when the claim took over a lease
// that ran out; UNTIL the lease end, Redis's clock in microseconds; FP the
// request's fingerprint. REST is a pending or released record's
// checkpoints (LEN ":" BYTES fields, a name and a value each) or a
// completed record's payload (see codec.go). The second form is the one
// complete.lua writes.
//
// The call record, one Redis string per call of compact claims, at the
// call record keys' start and the call's token:
//
//	"i2B" LEASE_UNTIL_US ":" DONE_US ":" RESULT_UNTIL_US ":" ATTEMPT_ID ":" FPW ":" STATES FPS
//
// with a state byte per place (P, C, R, X, M, F) and FPW bytes of
// fingerprint per place (see lua/compact_claim.lua).
//
// The index entry, 16 bytes in a block (a field) of an index key:
//
//	DIGEST8 PLACE2 TOKEN6
//
// the first 8 bytes of the record's digest (indexDigest), its place in the
// call that holds it and that call's token modulo 2^48, big-endian. The
// index key's field "" holds its layout and state, "v2 L S N" (see
// lua/lib.lua).

// The reply codes of the scripts in lua/: the number a script's answer
// starts with (the first element of a table reply, or each record's part of
// a batch script's flat reply). One number means different things in
// different scripts, so each family has names of its own; a name shared by
// several scripts means the same in each. Each script's header comment says
// the whole shape of its answers.

// Codes more than one script answers, with one meaning.
const (
	// replyNotOurs: the value at a key is not a record (or call record) of
	// ours: {5, reason}, nothing written. Every script that answers a table
	// answers it; the batch and compact transition scripts answer the
	// reason alone, which splitTransitions reads as {5, reason}.
	replyNotOurs = 5
	// replyAskAgain: claim.lua, inspect.lua and abandon.lua: {10, token},
	// the record's entry in the index is held by the call of token, whose
	// call record key the script was not given: nothing done; ask again
	// with that key as KEYS[3].
	replyAskAgain = 10
)

// complete.lua, release.lua, extend.lua, their batch forms (a bare number
// per record), checkpoint.lua, compact_settle.lua and compact_move.lua.
const (
	// transitionLost: lease lost, nothing written.
	transitionLost = 0
	// transitionDone: done (stored, released, extended, recorded, settled,
	// renewed or moved), or done before by the same token.
	transitionDone = 1
	// completeDoneBefore: complete.lua: the record was completed by this
	// token already; nothing written.
	completeDoneBefore = 2
	// checkpointFull: checkpoint.lua: the record holds as many checkpoints
	// as it may; nothing written.
	checkpointFull = 6
	// compactSettleDoneBefore: compact_settle.lua: the claim was completed
	// or released by this call already (a retried call).
	compactSettleDoneBefore = 2
	// compactSettleMoved: compact_settle.lua: the claim was moved to a
	// record of its own, which answers by the claim's token.
	compactSettleMoved = 3
	// compactMoveMoved: compact_move.lua, renewing: the claim was moved to
	// a record of its own already.
	compactMoveMoved = 3
	// compactMoveCompleted: compact_move.lua, moving: the claim was
	// completed already, as a marker.
	compactMoveCompleted = 4
)

// claim.lua, beside a bare token (a new claim), a bare string (a completed
// record) and a negative number (the lease left of another attempt).
const (
	// claimExisting: {1, token, attempt, recovered[, checkpoints]}: claimed
	// an existing record (lease run out, released, or this attempt asking
	// again).
	claimExisting = 1
	// claimMismatch: {4}: the record was made for another fingerprint.
	claimMismatch = 4
	// claimMarker: {8, token[, attempt]}: completed, as a marker, with an
	// empty result, within the retention its completion asked for.
	claimMarker = 8
	// claimMarkerExpired: {9, token[, attempt]}: completed, as a marker,
	// past that retention: the result is no longer kept.
	claimMarkerExpired = 9
	// claimCallMissing: {11}: the record's entry is younger than a call
	// record lives and its call record is missing: nothing done.
	claimCallMissing = 11
)

// compact_claim.lua: the code of each record in its flat reply, followed by
// as many fields as the code says.
const (
	// compactClaimRecord: 1, token, attempt, recovered, checkpoints:
	// claimed a record.
	compactClaimRecord = 1
	// compactClaimCompleted: 2, record: completed (a record).
	compactClaimCompleted = 2
	// compactClaimInProgress: 3, lease_left_ms: in progress.
	compactClaimInProgress = 3
	// compactClaimMismatch: 4: another fingerprint.
	compactClaimMismatch = 4
	// compactClaimed: 6: claimed compactly by this call.
	compactClaimed = 6
	// compactClaimRefused: 7, error: Redis refused a write, or the record's
	// entry is young and its call record missing: not claimed.
	compactClaimRefused = 7
	// compactClaimMarker: 8, token: completed (a marker), within the
	// retention of its result.
	compactClaimMarker = 8
	// compactClaimMarkerExpired: 9, token: completed (a marker), past
	// that retention.
	compactClaimMarkerExpired = 9
	// compactClaimedBefore: 10, token, place: claimed compactly by an
	// earlier run of this call (its reply was lost).
	compactClaimedBefore = 10
	// compactClaimMarked: 11, token, attempt: a record whose result is a
	// marker's, as compactClaimMarker.
	compactClaimMarked = 11
	// compactClaimMarkedExpired: 12, token, attempt: as
	// compactClaimMarkerExpired.
	compactClaimMarkedExpired = 12
	// compactClaimNewRecord: 13: claimed a new record, its token Redis's
	// clock (the reply's last), attempt 1, not recovered.
	compactClaimNewRecord = 13
)

// inspect.lua, forget.lua and abandon.lua, the operator scripts, answer in
// one shape, which parseRecordReply reads.
const (
	// recordNone: {0, now_s, now_us}: no record at the key and no compact
	// claim or marker; forget.lua: or one of another token, left as it is.
	recordNone = 0
	// recordDone: {1, header, ...}: inspect.lua: the record; forget.lua:
	// removed, as it was; abandon.lua: its lease ended, as it is now.
	recordDone = 1
	// recordUnchanged: abandon.lua: {2, header, ...}: nothing done, the
	// record is completed, released or of another token.
	recordUnchanged = 2
	// recordRefused: forget.lua: {3, header, ...}: refused, the record's
	// lease is live or it holds checkpoints.
	recordRefused = 3
	// recordCompact: inspect.lua: {6, header, ...}: no record at the key,
	// but a compact claim or a marker in the index.
	recordCompact = 6
)

// parseCompleted reads a completed record, of either form:
//
//	"i1C:" FP ":" TOKEN36 ":" ATTEMPT ":" REC ":" PAYLOAD   (complete.lua writes it)
//	"i1C" TOKEN ":" ATTEMPT ":" REC ":" UNTIL ":" ATTEMPT_ID ":" FP ":" PAYLOAD
//
// The script has compared the fingerprint; the header is checked here. The
// Value is the payload, sharing the memory of rec: rec must be a reply
// go-redis read, which nothing else holds (go-redis makes the string of a
// bulk reply from a buffer of its own).
func parseCompleted(rec string) (ClaimReply, error) {
	r := ClaimReply{Status: StatusCompleted}
	rest, ok := strings.CutPrefix(rec, "i1C")
	if !ok {
		return r, fmt.Errorf("%w: unknown format", ErrCorrupt)
	}
	var h header
	var err error
	if short, ok := strings.CutPrefix(rest, ":"); ok {
		h, rest, err = readShortHeader(short)
	} else {
		h, rest, err = readLongHeader(rest)
	}
	if err != nil {
		return r, err
	}
	r.Token, r.Attempt = h.token, h.attempt
	r.Value = unsafe.Slice(unsafe.StringData(rest), len(rest))
	return r, nil
}

// cutFields cuts len(f) fields, each ended by ':', off the front of s.
func cutFields(s string, f []string) (rest string, ok bool) {
	for i := range f {
		if f[i], s, ok = strings.Cut(s, ":"); !ok {
			return "", false
		}
	}
	return s, true
}

// parseToken36 reads a token in base 36, lower case, as a completed record's
// short form keeps it: 1 to maxToken.
func parseToken36(s string) (int64, error) {
	if !isBase36(s) {
		return 0, strconv.ErrSyntax
	}
	tok, err := strconv.ParseInt(s, 36, 64)
	if err == nil && (tok < 1 || tok > maxToken) {
		err = strconv.ErrRange
	}
	return tok, err
}

// isBase36 reports whether s is one or more digits of base 36, lower case.
func isBase36(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'z') {
			return false
		}
	}
	return s != ""
}

// isDigits reports whether s is one or more decimal digits.
func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}

// parseHeader reads a record's header strictly into r; now is Redis's clock
// in microseconds. The header is of the long form,
//
//	"i1" STATE TOKEN ":" ATTEMPT ":" REC ":" UNTIL ":" ATTEMPT_ID ":" FP ":"
//
// or of the short form of a completed record (see complete.lua),
//
//	"i1C:" FP ":" TOKEN36 ":" ATTEMPT ":" REC ":"
func parseHeader(r Record, head string, now int64) (Record, error) {
	rest, ok := strings.CutPrefix(head, "i1")
	if !ok || len(rest) == 0 {
		return r, badHeader("no format marker")
	}
	var state RecordState
	switch rest[0] {
	case 'P':
		state = StatePending
	case 'C':
		state = StateCompleted
	case 'R':
		state = StateReleased
	default:
		return r, badHeader("unknown state")
	}
	var h header
	var err error
	if short, ok := strings.CutPrefix(rest, "C:"); ok {
		h, rest, err = readShortHeader(short)
	} else {
		h, rest, err = readLongHeader(rest[1:])
	}
	if err == nil && rest != "" {
		err = badHeader("trailing bytes")
	}
	if err != nil {
		return r, err
	}
	r.State, r.Token, r.Attempt, r.Recovered = state, h.token, h.attempt, h.recovered
	r.Fingerprint = h.fingerprint != ""
	r.Age = time.Duration(max(now-h.token, 0)) * time.Microsecond
	if state == StatePending {
		r.LeaseLeft = time.Duration(h.until-now) * time.Microsecond
	}
	return r, nil
}

// header is what a record's header holds, of either form.
type header struct {
	token       int64
	attempt     int
	recovered   bool
	until       int64 // the lease end; 0 in the short form
	fingerprint string
}

func badHeader(what string) error {
	return fmt.Errorf("%w: record header: %s", ErrCorrupt, what)
}

// readLongHeader reads TOKEN ":" ATTEMPT ":" REC ":" UNTIL ":" ATTEMPT_ID
// ":" FP ":" off the front of s and returns what follows.
func readLongHeader(s string) (header, string, error) {
	var f [6]string // token, attempt, recovered, lease end, attempt id, fingerprint
	rest, ok := cutFields(s, f[:])
	if !ok {
		return header{}, "", badHeader("too few fields")
	}
	tok, err1 := strconv.ParseInt(f[0], 10, 64)
	n, err2 := strconv.Atoi(f[1])
	until, err3 := strconv.ParseInt(f[3], 10, 64)
	switch {
	case err1 != nil || tok < 1 || len(f[0]) > 16:
		return header{}, "", badHeader("token out of range")
	case err2 != nil || n < 1 || len(f[1]) > 9:
		return header{}, "", badHeader("attempt count out of range")
	case f[2] != "0" && f[2] != "1":
		return header{}, "", badHeader("recovered flag")
	case err3 != nil || len(f[3]) > 16:
		return header{}, "", badHeader("lease end out of range")
	case !isBase64URL(f[4]) || !isBase64URL(f[5]):
		return header{}, "", badHeader("attempt id or fingerprint")
	}
	return header{token: tok, attempt: n, recovered: f[2] == "1", until: until, fingerprint: f[5]}, rest, nil
}

// readShortHeader reads FP ":" TOKEN36 ":" ATTEMPT ":" REC ":" off the front
// of s and returns what follows.
func readShortHeader(s string) (header, string, error) {
	var f [4]string // fingerprint, token, attempt, recovered
	rest, ok := cutFields(s, f[:])
	if !ok || !isBase64URL(f[0]) || !isBase36(f[1]) || !isDigits(f[2]) || f[3] != "0" && f[3] != "1" {
		return header{}, "", fmt.Errorf("%w: unknown format", ErrCorrupt)
	}
	tok, err1 := parseToken36(f[1])
	n, err2 := strconv.Atoi(f[2])
	if err1 != nil || err2 != nil || len(f[2]) > 9 || n < 1 {
		return header{}, "", fmt.Errorf("%w: token or attempt count out of range", ErrCorrupt)
	}
	return header{token: tok, attempt: n, recovered: f[3] == "1", fingerprint: f[0]}, rest, nil
}

// withCheckpoints sets r's checkpoints from the rest of a claim reply: none,
// or the record's checkpoints as checkpoint.lua writes them.
func withCheckpoints(r ClaimReply, rest []any) (ClaimReply, error) {
	if len(rest) == 0 {
		return r, nil
	}
	tail, ok := rest[0].(string)
	if !ok {
		return ClaimReply{}, unexpected(rest)
	}
	cps, err := parseCheckpoints(tail)
	if err != nil {
		return ClaimReply{}, err
	}
	r.Checkpoints = cps
	return r, nil
}

// parseCheckpoints reads the checkpoints that follow a pending record's
// header: LEN ":" NAME LEN ":" VALUE, for each, oldest first.
func parseCheckpoints(tail string) ([]Checkpoint, error) {
	var cps []Checkpoint
	for tail != "" {
		name, rest, ok1 := cutField(tail)
		value, rest, ok2 := cutField(rest)
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("%w: checkpoints unreadable", ErrCorrupt)
		}
		cps = append(cps, Checkpoint{Name: name, Value: []byte(value)})
		tail = rest
	}
	return cps, nil
}

// cutField cuts LEN ":" BYTES off the front of s; LEN is 1 to 9 decimal
// digits, as the scripts read it.
func cutField(s string) (field, rest string, ok bool) {
	l, rest, ok := strings.Cut(s, ":")
	if !ok || l == "" || len(l) > 9 || strings.Trim(l, "0123456789") != "" {
		return "", "", false
	}
	n, _ := strconv.Atoi(l)
	if n > len(rest) {
		return "", "", false
	}
	return rest[:n], rest[n:], true
}

// callRecord is what a call record holds that Go reads (see the format
// above): its lease end and its last completion (Redis's clock,
// microseconds), its fingerprint width and a state byte per place.
type callRecord struct {
	until, done int64
	fpw         int
	states      string
}

// parseCallRecord reads the call record v; false when v is not one.
func parseCallRecord(v string) (callRecord, bool) {
	rest, ok := strings.CutPrefix(v, "i2B")
	fields := strings.SplitN(rest, ":", 6)
	if !ok || len(fields) != 6 {
		return callRecord{}, false
	}
	until, err1 := strconv.ParseInt(fields[0], 10, 64)
	done, err2 := strconv.ParseInt(fields[1], 10, 64)
	fpw, err3 := strconv.Atoi(fields[4])
	tail := fields[5]
	if err1 != nil || err2 != nil || err3 != nil || fpw < 0 || len(tail)%(1+fpw) != 0 {
		return callRecord{}, false
	}
	return callRecord{until: until, done: done, fpw: fpw, states: tail[:len(tail)/(1+fpw)]}, true
}
