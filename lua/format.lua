-- format.lua: the formats the scripts read and write, and the codes they
-- answer by, each defined once; no other script spells a format out.
-- format.go holds the same in Go: TestReplyCodesInLua holds the codes of
-- the two together, and the golden tests of format_test.go pin the formats.
--
-- It goes before every script, and lib.lua after it: each script is sent
-- with the definitions of the two that it uses, in their order, and no
-- other (see luaSource in redis_script.go), so that a script pays for no
-- function it does not call. A definition is a top-level "local" and what
-- follows it up to the next top-level "local" or comment.

-- The reply codes: the number a script's answer starts with, named as
-- format.go names them, with the same values. Each script's header says
-- the shape of its answers.
-- Codes more than one script answers, with one meaning: the value is not a
-- record of ours; ask again with the call record key of the token answered.
local replyNotOurs = 5
local replyAskAgain = 10
-- complete.lua, release.lua, extend.lua and their batch forms (whose
-- answers are bare numbers, one a record, or the reason a value is not
-- ours), checkpoint.lua and v3_settle.lua.
local transitionLost = 0
local transitionDone = 1
local completeDoneBefore = 2
local checkpointFull = 6
local compactSettleDoneBefore = 2
local compactSettleMoved = 3
local compactMoveCompleted = 4
-- claim.lua.
local claimExisting = 1
local claimMismatch = 4
local claimMarker = 8
local claimMarkerExpired = 9
local claimCallMissing = 11
-- inspect.lua, forget.lua and abandon.lua, the operator scripts.
local recordNone = 0
local recordDone = 1
local recordUnchanged = 2
local recordRefused = 3
local recordCompact = 6

-- The record: one Redis string at the record key, of two forms. The long
-- form is
--   "i1" STATE TOKEN ":" ATTEMPT ":" REC ":" UNTIL ":" ATTEMPT_ID ":" FP ":" REST
-- STATE P (pending), C (completed) or R (released); TOKEN the fencing token
-- (decimal); ATTEMPT the claims the record has had; REC 1 when this claim
-- took over a lease that ran out; UNTIL the lease end (Redis's clock,
-- microseconds; 0 once released); ATTEMPT_ID the claiming attempt's id and
-- FP the request's fingerprint (base64url, either may be empty). REST is
-- the checkpoints of a pending or released record, LEN ":" BYTES fields, a
-- name and a value each (see checkpoint.lua), or a completed record's
-- payload. The short form is a completed record's, as complete.lua writes
-- it:
--   "i1C:" FP ":" TOKEN36 ":" ATTEMPT ":" REC ":" PAYLOAD
-- with the token in base 36, lower case. A payload whose envelope is a
-- marker's ends "\1m" and, in decimal, when its result's retention ends (a
-- message Consume handled in a record of its own).

-- The readers are patterns, used as their comments say; the writers are
-- functions that concatenate strings. Both for cost, on Redis 7.0's Lua
-- under callgrind: a function is made anew each time a script runs (some
-- 400 Redis instructions each), a number made a string costs a sprintf
-- (some 2,000, in string.format or in a concatenation alike), a constant
-- next to nothing.

-- RECORD_LONG matches a long header: string.find(v, RECORD_LONG) gives
-- its start, its end, then STATE, TOKEN, ATTEMPT, REC, UNTIL, ATTEMPT_ID
-- and FP (strings); nil when v does not start with one.
local RECORD_LONG = '^i1([PCR])(%d+):(%d+):([01]):(%d+):([%w_%-]*):([%w_%-]*):'

-- RECORD_SHORT matches a short header: string.find(v, RECORD_SHORT) gives
-- its start, its end, then FP, TOKEN36, ATTEMPT and REC.
local RECORD_SHORT = '^i1C:([%w_%-]*):([%da-z]+):(%d+):([01]):'

-- RECORD_SHORT_START is how a short header starts, and no long one.
local RECORD_SHORT_START = 'i1C:'

-- RECORD_PENDING matches the long header of a pending record:
-- string.match(v, RECORD_PENDING) gives TOKEN, ATTEMPT ":" REC ":" and FP.
local RECORD_PENDING = '^i1P(%d+):(%d+:[01]:)%d+:[%w_%-]*:([%w_%-]*):'

-- RECORD_TOKEN and RECORD_TOKEN36 match the token of a long and of a short
-- header, from their starts alone.
local RECORD_TOKEN = '^i1[PCR](%d+):'
local RECORD_TOKEN36 = '^i1C:[%w_%-]*:([%da-z]+):'

-- RECORD_MARKER matches the payload of a marker's result, right after the
-- short header that ends at e: string.match(v, RECORD_MARKER, e + 1) gives
-- when the result's retention ends (decimal).
local RECORD_MARKER = '^\1m(%d+)$'

-- CHECKPOINT_FIELD matches the length of a checkpoint field at a position:
-- string.match(v, CHECKPOINT_FIELD, pos) gives LEN, its bytes following
-- the ':'.
local CHECKPOINT_FIELD = '^(%d+):'

-- record_head is the long header of those fields, strings (a number would
-- be made one by a sprintf, and one over 10^14 wrongly: make it one with
-- string.format('%d', n), once).
local function record_head(st, tok, cnt, rec, untl, att, fp)
  return 'i1' .. st .. tok .. ':' .. cnt .. ':' .. rec .. ':' .. untl .. ':' .. att .. ':' .. fp .. ':'
end

-- record_completed is a completed record of the short form: fp, tok36,
-- head (ATTEMPT ":" REC ":", as RECORD_PENDING gives it) and payload.
local function record_completed(fp, tok36, head, payload)
  return 'i1C:' .. fp .. ':' .. tok36 .. ':' .. head .. payload
end

-- checkpoint_pair is the checkpoint of name and value: two fields.
local function checkpoint_pair(name, value)
  return #name .. ':' .. name .. #value .. ':' .. value
end

-- The prefix's record (prefix .. 'layout', see prefix.lua) says how the
-- prefix is written: "v3 shards=N", the layout of its index and the scope
-- shards (WithScopeShards, 0 for none) of the Keepers that write under it.

-- prefix_record is the record of a prefix written in layout ("v3")
-- by Keepers of shards scope shards (a decimal string).
local function prefix_record(layout, shards)
  return layout .. ' shards=' .. shards
end

-- The index and call records of compact claims and markers, the v3
-- layout (see format.go, which says it byte by byte and holds the same
-- numbers by the same names): constants and patterns only, for top-level
-- code: v3_claim.lua and v3_settle.lua define no function.
-- Positions count from 1, as string.sub and string.byte do.
--
-- An entry, 16 bytes: DIGEST5 H3 PLACE2 TOKEN6, the digest bytes 0-4 and
-- the block hash H (bytes 5-7) of the record's index digest, the place in
-- its call and the call's token modulo 2^48, big-endian. Whole again from Redis's clock now: ref = now +
-- v3TokenAhead, token = ref - (ref - t48) % v3TokenModulus. A block is
-- named by its number in 3 bytes, big-endian; of the 2^L + S blocks of
-- state (L, S), the block of H is H % 2^L, or H % 2^(L+1) when that is
-- below S.
local v3EntrySize = 16
local v3DigestSize = 5
local v3EntryHashAt = 6
local v3EntryPlaceAt = 9
local v3EntryTokenAt = 11
local v3BlockNameSize = 3
local v3MaxLevel = 24
local v3StartLevel = 10
local v3IndexFill = 16
local v3TokenModulus = 281474976710656
local v3TokenAhead = 4294967296

-- The index's state, its field "", 32 bytes: "v3" L1 S3 N4 TOKEN7 DUE4 CALL11,
-- big-endian numbers (level, split point, entries, the last token given,
-- until when the key is known to live, seconds), then the id of the call
-- given TOKEN (zero bytes before any). string.find(raw,
-- V3_STATE) is nil for a field of another layout.
local V3_STATE = '^v3..............................$'
local V3_STATE_TAG = 'v3'
local v3StateSize = 32
local v3StateLevelAt = 3
local v3StateSplitAt = 4
local v3StateCountAt = 7
local v3StateTokenAt = 11
local v3StateDueAt = 18
local v3StateCallAt = 22

-- The call record, at its base and the token's low 6 bytes: "i3B" UNTIL7
-- DONE7 RESULT_UNTIL7 CALL_ID11 FPW1 AW1, then a state byte a place, AW
-- bytes a place (attempt, plus v3RecoveredBit when recovered) and FPW bytes
-- a place (fingerprint, '.' padded); the times are µs of Redis's clock,
-- big-endian. string.find(v, V3_CALL) gives its start, the header's end
-- (37), UNTIL, DONE, RESULT_UNTIL (7 bytes each), CALL_ID, and FPW and AW
-- as one-byte strings; nil when v is not a v3 call record.
local V3_CALL = '^i3B(.......)(.......)(.......)([%w_%-][%w_%-][%w_%-][%w_%-][%w_%-][%w_%-][%w_%-][%w_%-][%w_%-][%w_%-][%w_%-])(.)(.)'
local V3_CALL_TAG = 'i3B'
local v3CallHeadSize = 37
local v3CallUntilAt = 4
local v3CallDoneAt = 11
local v3CallResultUntilAt = 18
local v3CallIDAt = 25
local v3CallIDSize = 11
local v3CallFPWAt = 36
local v3CallAWAt = 37
local v3TimeSize = 7
local v3AttemptSize = 2
local v3MaxAttempts = 32767
local v3RecoveredBit = 32768
local v3MaxFingerprint = 64
-- A place's state, a byte (string.byte's number): held, completed,
-- released, not claimed by the call, taken over by a later call, moved to a
-- record of its own, forgotten.
local v3Held = 80
local v3Completed = 67
local v3Released = 82
local v3NotClaimed = 88
local v3TakenOver = 84
local v3Moved = 77
local v3Forgotten = 70

-- The v3 claim's argument: BLOCK3 DIGEST5 H3 PLACE2 a message, sorted by
-- block; its reply: TOKEN7 L1 S3 ANSWERS NUMBERS (see format.go). An answer
-- is a byte a place (these numbers, string.char's), and the number of those
-- that carry one follows the answers in place order, decimal, ',' after it.
local v3PackedSize = 13
local v3PackedDigestAt = 4
local v3PackedHashAt = 9
local v3PackedPlaceAt = 12
local v3MaxPlaces = 65535
local v3ReplyHeadSize = 11
local v3AnswerClaimed = 80
local v3AnswerRepeat = 85
local v3AnswerDone = 68
local v3AnswerExpired = 69
local v3AnswerBusy = 66
local v3AnswerTakenOver = 84
local v3AnswerReclaimed = 65
local v3AnswerMismatch = 77
local v3AnswerNotOurs = 78
local v3AnswerRefused = 82
local v3AnswerRecord = 75
local v3AnswerEarlier = 79
local v3AnswerCallMissing = 87
