package idem

// The reply codes of the scripts in lua/: the number a script's answer
// starts with (the first element of a table reply, or each record's part of
// a batch script's flat reply). One number means different things in
// different scripts, so each family has names of its own; a name shared by
// several scripts means the same in each. lua/lib.lua defines the same names
// with the same values (TestReplyCodesInLua holds them together), for the
// scripts it goes before; each script's header comment says the whole shape
// of its answers.

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
