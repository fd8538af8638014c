package idem

import (
	"fmt"
	"strconv"
	"strings"
	"time"
	"unsafe"
)

// format.go holds what redisStore keeps in Redis and how its scripts
// answer: the formats of the record, the call record and the index entry,
// the Go readers of the record, and the named reply codes. lua/format.lua
// holds the same for the scripts (the Lua readers and writers of each
// format, and the codes by the same names and values: TestReplyCodesInLua
// holds the codes together). The golden tests pin the formats: a release
// reads every format an earlier one wrote (format_test.go for records,
// format_v3_test.go and format_marker_test.go for the index and call
// records: see "The v3 layout" below), and writes only what the last
// release's readers read (format_upgrade_test.go: the grammars of what they
// read, added to only once a release with the reader has shipped).
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
// The index of compact claims and markers and its call records are laid
// out as "The v3 layout" below says.

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
// per record), checkpoint.lua and v3_settle.lua.
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
	// compactSettleDoneBefore: v3_settle.lua: the claim was completed or
	// released by this call already (a retried call).
	compactSettleDoneBefore = 2
	// compactSettleMoved: v3_settle.lua: the claim was moved to a record
	// of its own, which answers by the claim's token.
	compactSettleMoved = 3
	// compactMoveCompleted: v3_settle.lua, moving: the claim was completed
	// already, as a marker.
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
func parseCompleted(rec string) (claimReply, error) {
	r := claimReply{Status: statusCompleted}
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
func withCheckpoints(r claimReply, rest []any) (claimReply, error) {
	if len(rest) == 0 {
		return r, nil
	}
	tail, ok := rest[0].(string)
	if !ok {
		return claimReply{}, unexpected(rest)
	}
	cps, err := parseCheckpoints(tail)
	if err != nil {
		return claimReply{}, err
	}
	r.Checkpoints = cps
	return r, nil
}

// parseCheckpoints reads the checkpoints that follow a pending record's
// header: LEN ":" NAME LEN ":" VALUE, for each, oldest first.
func parseCheckpoints(tail string) ([]recoveryPoint, error) {
	var cps []recoveryPoint
	for tail != "" {
		name, rest, ok1 := cutField(tail)
		value, rest, ok2 := cutField(rest)
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("%w: checkpoints unreadable", ErrCorrupt)
		}
		cps = append(cps, recoveryPoint{Name: name, Value: []byte(value)})
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

// The v3 layout of compact claims and markers: an index of 16-byte
// entries in blocks of about 16, a call record of fixed offsets and an
// index state that also hands out tokens; the layouts before it ("v1",
// "v2") are refused, never read (see prefix.lua). Its names start with
// v3; every number here has a twin of the same name and value in
// lua/format.lua (TestReplyCodesInLua holds them together), where the
// scripts read them as constants (no function of the layout is in
// format.lua: a script would make it anew at every call).
//
// Its keys are its own, apart from the layouts' before (v3IndexKey,
// v3CallBase): on one server the index key prefix + "i3" and the call
// records prefix + "c3:" + TOKEN (each shard of a Ring has its own under
// these names); on a Cluster prefix + "{" + TAG + "}i3" and prefix + "{" +
// TAG + "}c3:" + TOKEN, TAG a hash tag of the slot the records are in;
// TOKEN is the low 48 bits of the call's token, 6 bytes big-endian
// (v3CallKey).
//
// The digest. A record id's index digest (indexDigest: the 16 bytes of a
// Keeper's id, or of the SHA-256 of any other id, uniform either way) gives
// the entry its digest and its block hash from bytes of its own:
//
//	bytes 0-4   DIGEST5 (40 bits)
//	bytes 5-7   H, the block hash, 24 bits big-endian
//
// Both are kept in the entry: H so that a split can move an entry to the
// block its hash now chooses, DIGEST5 so that the entries of one block,
// which share the low bits of H that chose the block, still differ in 40
// bits of their own.
//
// The false-match rate. A claim looks for its id's DIGEST5 and H, 64 bits,
// in its block (at the entries' starts only), and the block holds exactly
// the entries whose H chose it: a new id is taken for another when one of
// the N entries of the index holds the same 64 bits, probability about
// N * 2^-64 a lookup, whatever the index's level. Uniform digests:
//
//	ids held   false match a lookup   one a year at
//	1M         5.4e-14                 590,000 new ids a second
//	20M        1.1e-12                 29,000
//	100M       5.4e-12                 5,900
//
// (ids held: entries in the index, the ids handled within the marker
// retention). A repeated id can be taken for an earlier entry with the same
// 64 bits: the same odds. A false match answers the new id as the matching
// entry's: handled before (acked without running) or in progress. The index
// splits a block whenever it holds more than v3IndexFill = 16 entries a
// block on average, up to 2^24 blocks (268M entries at the fill), so a
// lookup reads about 16 entries of 16 bytes. (At 8 a block, an index of
// 100,000 ids took 24 bytes an id, at 16 20.7: a block is a hash field of
// its own, some 32 bytes of Redis's with its name, and its value is
// allocated in jemalloc's size classes; a claim at 200,000 ids held cost
// 7% more Redis instructions at 16.) An index begins at level
// v3StartLevel = 10, 1,024 blocks: a block is a field that exists only
// while it holds an entry, so a small index pays nothing for the blocks it
// does not use, and an index splits (moves entries, which costs a claim
// some 2 entries' work an id) only once it holds over 16,384 ids.
//
// The index entry, 16 bytes, entries end to end in a block:
//
//	DIGEST5 H3 PLACE2 TOKEN6
//
// DIGEST5 and H as above; PLACE2 the entry's place in the call that holds
// it (1 to 65535), big-endian; TOKEN6 that call's token modulo 2^48,
// big-endian. A token is Redis's clock in microseconds or a little above
// it (below 2^53); a reader makes it whole again from Redis's clock now:
// the token within [now + 2^32 - 2^48, now + 2^32] (v3WholeToken).
//
// A block is a field of the index key named by its number in 3 bytes,
// big-endian (v3AppendBlockName): of the 2^L + S blocks of state (L, S),
// the block of hash H is H mod 2^L, or H mod 2^(L+1) when that is below S
// (v3Block). L is at most 24, and S is 0 at 24: at most 2^24 blocks.
//
// The index's state, its field "", 32 bytes:
//
//	"v3" L1 S3 N4 TOKEN7 DUE4 CALL11
//
// bytes 0-1 "v3"; byte 2 L, the level (0 to 24); bytes 3-5 S, the split
// point (below 2^L); bytes 6-9 N, the entries the index holds; bytes 10-16
// TOKEN, the last token the index gave a call; bytes 17-20 DUE, Redis's
// clock in seconds until when the index key is known to live (0: not
// known): a call that needs it to live longer pushes its expiry out; every
// number big-endian; bytes 21-31 CALL, the id of the call that TOKEN was
// given to (11 characters of base64url; zero bytes before any), by which a
// call that go-redis sent again finds its first run. A call's token is the larger
// of TOKEN + 1 and Redis's clock in microseconds, and becomes TOKEN: above
// every token the index gave, and, as the clock, above every token a
// record of its own had before (a record's token is the clock at its
// claim), after the index key expired too; no EXISTS loop.
//
// The call record, one Redis string per claim call, at v3CallBase + TOKEN6
// (v3CallKey: the call's token modulo 2^48, 6 bytes big-endian, as its
// entries hold it, so that a claim names an entry's call record without
// making the token whole or writing it in decimal):
//
//	"i3B" UNTIL7 DONE7 RESULT_UNTIL7 CALL_ID11 FPW1 AW1 STATES ATTEMPTS FPS
//
// bytes 0-2 "i3B"; bytes 3-9 UNTIL, the lease end of the call's claims;
// bytes 10-16 DONE, when the call last completed a claim (0 never); bytes
// 17-23 RESULT_UNTIL, when the retention its completions asked for ends (0
// never): each Redis's clock in microseconds, big-endian, below 2^53 (a
// script reads and writes them with string.byte and string.char, no
// decimal conversion). Bytes 24-34 CALL_ID, the call's id (11 characters of
// base64url: 64 random bits), by which a call sent again knows its own
// record. Byte 35 FPW, the width of each place's fingerprint (0 to 64, a
// byte); byte 36 AW, of each place's attempt (0 or 2, a byte). Then, for n
// places (n = (len - 37) / (1 + AW + FPW)): STATES, a byte a place (P held
// by the call, C completed: a marker, R released, X not claimed by the
// call, T taken over by a later call after the lease ran out: the call's
// settle of it is refused, M moved to a record of its own, F forgotten);
// ATTEMPTS, AW bytes a place: the claim's attempt count (1 to 32767)
// big-endian, plus 32768 when it took over a lease that ran out (AW 0:
// every place attempt 1, not recovered); FPS, FPW bytes a place: its
// fingerprint, '.' padded.
const (
	v3EntrySize     = 16
	v3DigestSize    = 5
	v3EntryHashAt   = 6 // positions count from 1, as Lua's string.sub
	v3EntryPlaceAt  = 9
	v3EntryTokenAt  = 11
	v3BlockNameSize = 3
	v3MaxLevel      = 24
	v3StartLevel    = 10
	v3IndexFill     = 16
	v3TokenModulus  = 1 << 48
	v3TokenAhead    = 1 << 32

	v3StateSize    = 32
	v3StateLevelAt = 3
	v3StateSplitAt = 4
	v3StateCountAt = 7
	v3StateTokenAt = 11
	v3StateDueAt   = 18
	v3StateCallAt  = 22

	v3CallHeadSize      = 37
	v3CallUntilAt       = 4
	v3CallDoneAt        = 11
	v3CallResultUntilAt = 18
	v3CallIDAt          = 25
	v3CallIDSize        = 11
	v3CallFPWAt         = 36
	v3CallAWAt          = 37
	v3TimeSize          = 7
	v3AttemptSize       = 2
	v3MaxAttempts       = 32767
	v3RecoveredBit      = 32768
	v3MaxFingerprint    = 64

	// The states of a place in a call record.
	v3Held       = 'P'
	v3Completed  = 'C'
	v3Released   = 'R'
	v3NotClaimed = 'X'
	v3TakenOver  = 'T'
	v3Moved      = 'M'
	v3Forgotten  = 'F'
)

// The v3 claim's argument and reply (v3Packer makes the one and reads the
// other; the v3 claim script comes later).
//
// The argument packs a batch in one string, 13 bytes a message, sorted by
// block (messages of one block in the caller's order):
//
//	BLOCK3 DIGEST5 H3 PLACE2
//
// bytes 0-2 the message's block in the index state the client last saw
// (a field name as is); bytes 3-7 its digest, 8-10 its block hash H (by
// which the script places it again when the index split since) and 11-12
// its place in the call (its position in the argument, from 1,
// big-endian), so that bytes 3-12 and the call's TOKEN6 make its entry.
//
// The reply is one string:
//
//	TOKEN7 L1 S3 ANSWERS NUMBERS
//
// bytes 0-6 the call's token, big-endian (0 when it claimed nothing);
// bytes 7-10 the index's level and split point after the call, as the
// state holds them (the client packs its next call by them); then an
// answer byte a place, in place order; then, for each place in order whose
// answer carries a number, the number in decimal and ',' (a done or
// expired answer: 8 bytes, the low 48 bits of the token that completed it
// and its attempt, big-endian); then, when an answer is v3AnswerRefused,
// Redis's error that refused the call's write.
// The answers:
const (
	v3PackedSize     = 13
	v3PackedDigestAt = 4
	v3PackedHashAt   = 9
	v3PackedPlaceAt  = 12
	v3MaxPlaces      = 65535
	v3ReplyHeadSize  = 11

	// v3AnswerClaimed: claimed by this call, attempt 1.
	v3AnswerClaimed = 'P'
	// v3AnswerRepeat: the id is at an earlier place of this call too, which
	// answers for it.
	v3AnswerRepeat = 'U'
	// v3AnswerDone, 8 bytes the token and attempt: completed, within the
	// retention of its result.
	v3AnswerDone = 'D'
	// v3AnswerExpired, 8 bytes as done: completed, past the retention of
	// its result (its marker remains).
	v3AnswerExpired = 'E'
	// v3AnswerBusy, number the lease left in ms: held by another call.
	v3AnswerBusy = 'B'
	// v3AnswerTakenOver, number the attempt: claimed by this call, taking
	// over a lease that ran out (recovered).
	v3AnswerTakenOver = 'T'
	// v3AnswerReclaimed, number the attempt: claimed by this call after a
	// release.
	v3AnswerReclaimed = 'A'
	// v3AnswerMismatch: held or completed for another fingerprint.
	v3AnswerMismatch = 'M'
	// v3AnswerNotOurs: the record key holds a value not ours.
	v3AnswerNotOurs = 'N'
	// v3AnswerRefused: not claimed, because Redis refused the call's
	// first write (OOM, READONLY; its error ends the reply): nothing of
	// the call was written.
	v3AnswerRefused = 'R'
	// v3AnswerRecord: the id has a record of its own that is released, or
	// pending past its lease or by this call's attempt, or completed with
	// a result other than a marker's: the client claims it there
	// (claim.lua), which takes it over with its checkpoints or answers its
	// result.
	v3AnswerRecord = 'K'
	// v3AnswerEarlier, 10 bytes (the low 48 bits of its token, its place
	// and its attempt, big-endian): held by an earlier run of this call,
	// which go-redis sent again after another call came between; the
	// caller holds that claim.
	v3AnswerEarlier = 'O'
	// v3AnswerCallMissing: the id's entry is younger than its call record
	// lives, and its call record is missing: elsewhere (its slot
	// migrates) or lost. Not claimed: unavailable.
	v3AnswerCallMissing = 'W'
)

// v3IndexKey is the name of the v3 index key under prefix: on one server
// (cluster false) the one, on a Cluster that of slot.
func v3IndexKey(prefix string, cluster bool, slot uint16) string {
	if !cluster {
		return prefix + "i3"
	}
	return prefix + "{" + slotTag(slot) + "}i3"
}

// v3CallBase is the start of the v3 call record keys under prefix, as
// v3IndexKey: a call record's key is it and the call's token in decimal.
func v3CallBase(prefix string, cluster bool, slot uint16) string {
	if !cluster {
		return prefix + "c3:"
	}
	return prefix + "{" + slotTag(slot) + "}c3:"
}

// v3CallKey is the key of the call record of token under base (see
// v3CallBase): base and the token's low 48 bits, 6 bytes big-endian.
func v3CallKey(base string, token int64) string {
	return base + string([]byte{byte(token >> 40), byte(token >> 32), byte(token >> 24), byte(token >> 16), byte(token >> 8), byte(token)})
}

// v3Key is what the v3 index knows a record id by: the digest its entry
// holds and the hash that chooses its block.
type v3Key struct {
	d5 [v3DigestSize]byte
	h  uint32
}

// v3KeyOf returns the v3 key of record id: bytes 0-4 of its index digest,
// and bytes 5-7 as the block hash.
func v3KeyOf(id string) v3Key {
	var d [16]byte
	indexDigest(&d, id)
	return v3Key{d5: [v3DigestSize]byte(d[:v3DigestSize]), h: uint32(d[5])<<16 | uint32(d[6])<<8 | uint32(d[7])}
}

// v3Block is the block of hash h in an index of level l and split point s.
func v3Block(h uint32, l uint8, s uint32) uint32 {
	half := uint32(1) << l
	b := h & (half - 1)
	if b < s {
		b = h & (2*half - 1)
	}
	return b
}

// v3AppendBlockName appends the field name of block b, 3 bytes.
func v3AppendBlockName(dst []byte, b uint32) []byte {
	return append(dst, byte(b>>16), byte(b>>8), byte(b))
}

// v3AppendEntry appends the entry of key k at place of the call of token:
// 16 bytes.
func v3AppendEntry(dst []byte, k v3Key, place uint16, token int64) []byte {
	dst = append(dst, k.d5[:]...)
	dst = append(dst, byte(k.h>>16), byte(k.h>>8), byte(k.h))
	dst = append(dst, byte(place>>8), byte(place))
	return append(dst, byte(token>>40), byte(token>>32), byte(token>>24), byte(token>>16), byte(token>>8), byte(token))
}

// v3Entry is an entry as read: its key, place and token modulo 2^48.
type v3Entry struct {
	key   v3Key
	place uint16
	t48   int64
}

// v3ReadEntry reads the entry e, 16 bytes; false when it is not one.
func v3ReadEntry(e string) (v3Entry, bool) {
	if len(e) != v3EntrySize {
		return v3Entry{}, false
	}
	var r v3Entry
	copy(r.key.d5[:], e)
	r.key.h = uint32(e[5])<<16 | uint32(e[6])<<8 | uint32(e[7])
	r.place = uint16(e[8])<<8 | uint16(e[9])
	for i := v3EntryTokenAt - 1; i < v3EntrySize; i++ {
		r.t48 = r.t48<<8 | int64(e[i])
	}
	return r, r.place != 0
}

// v3WholeToken is the token whose low 48 bits are t48, read when Redis's
// clock is now (microseconds): the one within [now + 2^32 - 2^48, now +
// 2^32].
func v3WholeToken(t48, now int64) int64 {
	ref := now + v3TokenAhead
	d := (ref - t48) % v3TokenModulus
	if d < 0 {
		d += v3TokenModulus
	}
	return ref - d
}

// v3State is the v3 index's state, its field "".
type v3State struct {
	level uint8  // L
	split uint32 // S
	count uint32 // N, entries held
	token int64  // the last token given
	due   uint32 // until when the index key is known to live, seconds
	// callID is the id of the call given token, or "" before any.
	callID string
}

// blocks is how many blocks an index of state m has.
func (m v3State) blocks() uint32 { return 1<<m.level + m.split }

// valid reports whether m can be written.
func (m v3State) valid() bool {
	return m.level <= v3MaxLevel && m.split < 1<<m.level && (m.level < v3MaxLevel || m.split == 0) &&
		m.token >= 0 && m.token <= maxToken && (m.callID == "" || len(m.callID) == v3CallIDSize && isBase64URL(m.callID))
}

// appendV3State appends the state field of m, 32 bytes.
func appendV3State(dst []byte, m v3State) []byte {
	dst = append(dst, 'v', '3', m.level, byte(m.split>>16), byte(m.split>>8), byte(m.split))
	dst = append(dst, byte(m.count>>24), byte(m.count>>16), byte(m.count>>8), byte(m.count))
	t := m.token
	dst = append(dst, byte(t>>48), byte(t>>40), byte(t>>32), byte(t>>24), byte(t>>16), byte(t>>8), byte(t))
	dst = append(dst, byte(m.due>>24), byte(m.due>>16), byte(m.due>>8), byte(m.due))
	if m.callID == "" {
		return append(dst, make([]byte, v3CallIDSize)...)
	}
	return append(dst, m.callID...)
}

// parseV3State reads the state field raw; false when it is not a v3 state
// (another layout's, or out of range).
func parseV3State(raw string) (v3State, bool) {
	if len(raw) != v3StateSize || raw[:2] != "v3" {
		return v3State{}, false
	}
	be := func(b string) (n uint64) {
		for i := 0; i < len(b); i++ {
			n = n<<8 | uint64(b[i])
		}
		return n
	}
	m := v3State{
		level: raw[2],
		split: uint32(be(raw[3:6])),
		count: uint32(be(raw[6:10])),
		token: int64(be(raw[10:17])),
		due:   uint32(be(raw[17:21])),
	}
	if id := raw[21:32]; id != "\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00" {
		if id == "" || !isBase64URL(id) {
			return v3State{}, false
		}
		m.callID = id
	}
	return m, m.valid()
}

// v3Call is a v3 call record (see the format above).
type v3Call struct {
	until, done, resultUntil int64 // Redis's clock, microseconds; 0 never
	callID                   string
	fpw, aw                  int
	states, attempts, fps    string
}

// places is how many places the call record holds.
func (c v3Call) places() int { return len(c.states) }

// attempt is the attempt count of place p (from 1) and whether its claim
// took over a lease that ran out.
func (c v3Call) attempt(p int) (n int, recovered bool) {
	if c.aw == 0 {
		return 1, false
	}
	at := (p - 1) * v3AttemptSize
	a := int(c.attempts[at])<<8 | int(c.attempts[at+1])
	return a &^ v3RecoveredBit, a&v3RecoveredBit != 0
}

// fingerprint is place p's fingerprint, its padding cut.
func (c v3Call) fingerprint(p int) string {
	fp := c.fps[(p-1)*c.fpw : p*c.fpw]
	return strings.TrimRight(fp, ".")
}

// appendV3Call appends the call record c; false (and dst) when a field
// does not fit the format.
func appendV3Call(dst []byte, c v3Call) ([]byte, bool) {
	n := len(c.states)
	switch {
	case len(c.callID) != v3CallIDSize || !isBase64URL(c.callID),
		c.fpw < 0 || c.fpw > v3MaxFingerprint || len(c.fps) != n*c.fpw,
		c.aw != 0 && c.aw != v3AttemptSize || len(c.attempts) != n*c.aw:
		return dst, false
	}
	start := len(dst)
	dst = append(dst, "i3B"...)
	for _, t := range [...]int64{c.until, c.done, c.resultUntil} {
		if t < 0 || t >= 1<<53 {
			return dst[:start], false
		}
		dst = append(dst, byte(t>>48), byte(t>>40), byte(t>>32), byte(t>>24), byte(t>>16), byte(t>>8), byte(t))
	}
	dst = append(dst, c.callID...)
	dst = append(dst, byte(c.fpw), byte(c.aw))
	dst = append(dst, c.states...)
	dst = append(dst, c.attempts...)
	return append(dst, c.fps...), true
}

// parseV3Call reads the call record v; false when v is not one.
func parseV3Call(v string) (v3Call, bool) {
	if len(v) < v3CallHeadSize || v[:3] != "i3B" {
		return v3Call{}, false
	}
	var c v3Call
	for i, t := range []*int64{&c.until, &c.done, &c.resultUntil} {
		for _, b := range []byte(v[3+i*v3TimeSize : 3+(i+1)*v3TimeSize]) {
			*t = *t<<8 | int64(b)
		}
		if *t >= 1<<53 {
			return v3Call{}, false
		}
	}
	c.callID = v[v3CallIDAt-1 : v3CallIDAt-1+v3CallIDSize]
	c.fpw, c.aw = int(v[v3CallFPWAt-1]), int(v[v3CallAWAt-1])
	rest := v[v3CallHeadSize:]
	per := 1 + c.aw + c.fpw
	if !isBase64URL(c.callID) || c.fpw > v3MaxFingerprint || c.aw != 0 && c.aw != v3AttemptSize || len(rest)%per != 0 {
		return v3Call{}, false
	}
	n := len(rest) / per
	c.states, c.attempts, c.fps = rest[:n], rest[n:n+n*c.aw], rest[n+n*c.aw:]
	return c, true
}
