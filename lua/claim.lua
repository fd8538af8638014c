-- claim.lua: claim a record for one attempt, or say why it cannot be claimed.
--
-- KEYS[1]  the record key
-- KEYS[2]  its index key, in the id index of compact claims (see
--          format.go, "The v3 layout", and lib.lua, which goes before this
--          with format.lua), absent when the store keeps none: an index key of
--          another layout is refused with the error "IDEMLAYOUT " and what
--          its field "" holds
-- KEYS[3]  the call record key of the record's entry in the index, when
--          the caller knows it (it asked before and was answered {10}), or
--          absent
-- ARGV[1]  fingerprint of the request (base64url, may be empty)
-- ARGV[2]  attempt id (base64url), unique per Begin call
-- ARGV[3]  lease in milliseconds
-- ARGV[4]  time to keep a pending record, in milliseconds (>= lease)
-- ARGV[5]  the first 8 bytes of the record's digest, its entry's start in
--          the index, when KEYS[2] is given
-- ARGV[6]  the start of the call record keys, when KEYS[2] is given
--
-- Returns one of
--   token                           (an integer > 0) claimed a new record: the caller
--                                   runs the operation, attempt 1, not recovered
--   {1, token, attempt, recovered}  claimed an existing record (lease run out,
--                                   released, or this attempt asking again)
--   {1, token, attempt, recovered, checkpoints}
--                                   the same, and an earlier attempt left checkpoints
--   record                          (a string) completed: the whole record, header
--                                   and payload; the caller reads the header
--   -lease_left_ms                  (an integer < 0) another attempt holds a live lease
--   {4}                             the record was made for another fingerprint
--   {5, reason}                     the value at the key is not a record of ours
--   {8, token, attempt}             completed, as a marker (a compact claim's,
--                                   or a record whose result is a marker's),
--                                   with an empty result, within the retention
--                                   its completion asked for; attempt is the
--                                   claim's count, as its call record or
--                                   record holds it
--   {9, token, attempt}             completed, as a marker, past that
--                                   retention: the result is no longer kept
--   {10, token}                     the record's entry in the index is held by
--                                   the call of token, whose call record key
--                                   is not KEYS[3]: nothing is done; ask again
--                                   with that key as KEYS[3]
--   {11}                            the record's entry is younger than ARGV[4]
--                                   and its call record is missing: not
--                                   stale (a call record lives at least that
--                                   long) but moving (a slot migration) or
--                                   lost: nothing is done, unavailable
-- The two answers of the hot paths, a new claim and a replay, are a bare
-- integer and a bare string: a table reply costs Redis more than the rest
-- of a replay's Lua.
--
-- The record's two forms are format.go's (and format.lua's, whose patterns
-- read them). A token is max(previous token + 1, Redis time in
-- microseconds), so it never repeats for a key, even after the record
-- expired. A pending or released record holds its checkpoints (see
-- checkpoint.lua), often none: a claim carries them over to the next holder
-- and answers them. A released record that holds checkpoints keeps its
-- fingerprint, and answers another one {4}. A replay of a completed
-- record's short form compares the fingerprint at its fixed place and
-- leaves the rest of the header to the caller.
--
-- Redis's clock is read only when the record is not completed: a replay costs
-- one command inside the script.
--
-- When the key holds no record, the id index of compact claims answers:
-- a compact claim whose lease is live is in progress; one whose lease ran
-- out, or that was released, is taken over by a record of its own (attempt
-- after the one its call record holds, a higher token), its place in the
-- call record marked T (taken over) and its entry left until swept; a
-- completed one is a marker. A stale entry (its call record gone, and
-- the entry older than ARGV[4]) is no answer.
--
-- Every key read or written is declared, the call record too: the script
-- learns which call record it needs from the index entry, so it answers
-- {10} when that is not the one declared, and the caller asks again with
-- it. On a Cluster whose slot migrates, Redis then runs the script only
-- on a node that holds every key it names, or answers TRYAGAIN; never on
-- a node that lacks the index or the call record.
--
-- Safe to run twice for one call (go-redis retries a command whose reply was
-- lost): the second run finds its own attempt id and answers the same claim.
local key, fp = KEYS[1], ARGV[1]

local v = redis.pcall('GET', key)
if type(v) == 'string' and string.sub(v, 1, #RECORD_SHORT_START) == RECORD_SHORT_START then
  -- A completed record of the short form: a replay, the hot path, which
  -- returns before the functions below are made.
  local _, e, sfp, tok36, cnt = string.find(v, RECORD_SHORT)
  if not e then
    return {replyNotOurs, 'unknown format'}
  end
  if sfp ~= fp then
    return {claimMismatch}
  end
  -- A result that is a marker's (a message handled by Consume in a record
  -- of its own) answers as a marker, with its attempt count: {8, token,
  -- attempt} within its retention, {9, token, attempt} after.
  local untl = string.match(v, RECORD_MARKER, e + 1)
  if not untl then
    return v
  end
  local t = redis.call('TIME')
  if t[1] * 1000000 + t[2] < tonumber(untl) then
    return {claimMarker, tonumber(tok36, 36), tonumber(cnt)}
  end
  return {claimMarkerExpired, tonumber(tok36, 36), tonumber(cnt)}
end

-- (the functions of format.lua and lib.lua)
if not v and not (KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1) then
  -- A new key and no index that could hold an entry for it: a first
  -- execution, which makes only the function it uses (index_entry would
  -- find no entry in an index key that does not exist).
  local t = redis.call('TIME')
  local now = t[1] * 1000000 + t[2]
  redis.call('SET', key,
    record_head('P', string.format('%d', now), '1', '0', string.format('%d', now + ARGV[3] * 1000), ARGV[2], fp),
    'PX', ARGV[4])
  return now
end

-- (the functions of format.lua and lib.lua)
if not v then
  local prev, cnt, rec = 0, 0, 0
  if KEYS[2] then
    local ix = {ARGV[5], ARGV[6]}
    local ctok, place, other = index_entry(KEYS[2], ix)
    if other then
      return redis.error_reply('IDEMLAYOUT ' .. other)
    end
    if ctok then
      if KEYS[3] ~= index_callkey(ix) then
        return {replyAskAgain, tonumber(ctok)}
      end
      local c, why = index_claim(ix, place)
      if why then
        return {replyNotOurs, why}
      end
      -- How long a call record lives at least: a pending record's keep.
      if not c and redis.call('EXISTS', KEYS[3]) == 0 and index_now() - tonumber(ctok) < tonumber(ARGV[4]) * 1000 then
        return {claimCallMissing}
      end
      local st = c and c.st or ''
      if (st == 'P' or st == 'C') and c.fp ~= fp then
        return {claimMismatch}
      end
      local now = index_now()
      if st == 'C' then
        if now < tonumber(c.runtil_us) then
          return {claimMarker, tonumber(ctok), c.cnt}
        end
        return {claimMarkerExpired, tonumber(ctok), c.cnt}
      elseif st == 'P' and tonumber(c.until_us) > now then
        return -math.ceil((tonumber(c.until_us) - now) / 1000)
      end
      if st == 'P' or st == 'R' then
        prev, cnt = tonumber(ctok), c.cnt or 1
        if st == 'P' then
          rec = 1
        end
        -- Taken over (T): the entry stays, behind the record, until
        -- swept.
        redis.call('SETRANGE', c.ck, c.at - 1, 'T')
      end
    end
  end
  local t = redis.call('TIME')
  local now = t[1] * 1000000 + t[2]
  if cnt == 0 then
    redis.call('SET', key,
      record_head('P', string.format('%d', now), '1', '0', string.format('%d', now + ARGV[3] * 1000), ARGV[2], fp),
      'PX', ARGV[4])
    return now
  end
  local token = now
  if prev >= token then
    token = prev + 1
  end
  cnt = math.min(cnt + 1, 999999999)
  redis.call('SET', key,
    record_head('P', string.format('%d', token), cnt, rec, string.format('%d', now + ARGV[3] * 1000), ARGV[2], fp),
    'PX', ARGV[4])
  return {claimExisting, token, cnt, rec}
end
if type(v) ~= 'string' then
  return {replyNotOurs, 'wrong type'}
end

local _, hdr, st, tok, cnt, rec, until_us, att, rfp = string.find(v, RECORD_LONG)
if not st then
  return {replyNotOurs, 'unknown format'}
end
-- Lua numbers are doubles: refuse what they cannot hold exactly.
if #tok > 16 or #cnt > 9 or #until_us > 16 or tonumber(tok) > 9007199254740991 then
  return {replyNotOurs, 'token or attempt count out of range'}
end
if rfp ~= fp and (st ~= 'R' or hdr < #v) then
  return {claimMismatch}
end
if st == 'C' then
  return v
end

-- The checkpoints: LEN ":" BYTES fields, a name and a value each (see
-- checkpoint.lua).
local checkpoints = string.sub(v, hdr + 1)
local pos, fields = 1, 0
while pos <= #checkpoints do
  local len = string.match(checkpoints, CHECKPOINT_FIELD, pos)
  if not len or #len > 9 then
    return {replyNotOurs, 'checkpoints unreadable'}
  end
  pos = pos + #len + 1 + tonumber(len)
  fields = fields + 1
end
if pos ~= #checkpoints + 1 or fields % 2 ~= 0 then
  return {replyNotOurs, 'checkpoints unreadable'}
end

local recovered = 0
if st == 'P' and att == ARGV[2] then
  -- This attempt's own claim, asked again.
  if checkpoints == '' then
    return {claimExisting, tonumber(tok), tonumber(cnt), tonumber(rec)}
  end
  return {claimExisting, tonumber(tok), tonumber(cnt), tonumber(rec), checkpoints}
end
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
if st == 'P' then
  local left = tonumber(until_us) - now
  if left > 0 then
    return -math.ceil(left / 1000)
  end
  recovered = 1
end
local prev = tonumber(tok)
if prev >= 9007199254740991 then
  return {replyNotOurs, 'token space exhausted'}
end
local token = now
if prev >= token then
  token = prev + 1
end
local n = math.min(tonumber(cnt) + 1, 999999999)
redis.call('SET', key,
  record_head('P', string.format('%d', token), n, recovered, string.format('%d', now + ARGV[3] * 1000), ARGV[2], fp) ..
  checkpoints,
  'PX', ARGV[4])
if checkpoints == '' then
  return {claimExisting, token, n, recovered}
end
return {claimExisting, token, n, recovered, checkpoints}
