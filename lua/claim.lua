-- claim.lua: claim a record for one attempt, or say why it cannot be claimed.
--
-- KEYS[1]  the record key
-- ARGV[1]  fingerprint of the request (base64url, may be empty)
-- ARGV[2]  attempt id (base64url), unique per Begin call
-- ARGV[3]  lease in milliseconds
-- ARGV[4]  time to keep a pending record, in milliseconds (>= lease)
--
-- Returns one of
--   {1, token, attempt, recovered}  claimed: the caller runs the operation
--   {1, token, attempt, recovered, checkpoints}
--                                   claimed, and an earlier attempt left checkpoints
--   {2, record}                     completed: the whole record, header and payload
--   {3, lease_left_ms}              another attempt holds a live lease
--   {4}                             the record was made for another fingerprint
--   {5, reason}                     the value at the key is not a record of ours
--
-- Record format (one string, so that a completed record is one allocation):
--   "i1" STATE TOKEN ":" ATTEMPT ":" RECOVERED ":" LEASE_UNTIL_US ":" ATTEMPT_ID ":" FP ":" PAYLOAD
-- STATE is P (pending), C (completed) or R (released). TOKEN is a fencing token:
-- max(previous token + 1, Redis time in microseconds), so it never repeats for a
-- key, even after the record expired. The PAYLOAD of a pending or released
-- record holds its checkpoints (see checkpoint.lua), often none: a claim carries
-- them over to the next holder and answers them. A released record that holds
-- checkpoints keeps its fingerprint, and answers another one {4}.
--
-- Safe to run twice for one call (go-redis retries a command whose reply was
-- lost): the second run finds its own attempt id and answers the same claim.
local key, fp, attempt = KEYS[1], ARGV[1], ARGV[2]
local lease, keep = tonumber(ARGV[3]), ARGV[4]

local v = redis.pcall('GET', key)
if type(v) == 'table' then
  return {5, 'wrong type'}
end

-- Redis's clock is read only once the record is known not to be completed:
-- a replay costs one command inside the script, not two.
local now
local function clock()
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return now
end

-- readable reports whether s reads as checkpoints: LEN ":" BYTES fields, a
-- name and a value each (see checkpoint.lua).
local function readable(s)
  local pos, fields = 1, 0
  while pos <= #s do
    local len = string.match(s, '^(%d+):', pos)
    if not len or #len > 9 then
      return false
    end
    pos = pos + #len + 1 + tonumber(len)
    fields = fields + 1
  end
  return pos == #s + 1 and fields % 2 == 0
end

local token, n, recovered
local checkpoints = ''
local function claimed(tok, cnt, rec)
  if checkpoints == '' then
    return {1, tok, cnt, rec}
  end
  return {1, tok, cnt, rec, checkpoints}
end
if not v then
  token, n, recovered = clock(), 1, 0
else
  local _, hdr, st, tok, cnt, rec, until_us, att, rfp =
    string.find(v, '^i1([PCR])(%d+):(%d+):([01]):(%d+):([%w_%-]*):([%w_%-]*):')
  if not st then
    return {5, 'unknown format'}
  end
  -- Lua numbers are doubles: refuse what they cannot hold exactly.
  if #tok > 16 or #cnt > 9 or #until_us > 16 or tonumber(tok) > 9007199254740991 then
    return {5, 'token or attempt count out of range'}
  end
  if rfp ~= fp and (st ~= 'R' or hdr < #v) then
    return {4}
  end
  if st == 'C' then
    return {2, v}
  end
  checkpoints = string.sub(v, hdr + 1)
  if not readable(checkpoints) then
    return {5, 'checkpoints unreadable'}
  end
  if st == 'P' then
    if att == attempt then
      return claimed(tonumber(tok), tonumber(cnt), tonumber(rec))
    end
    local left = tonumber(until_us) - clock()
    if left > 0 then
      return {3, math.ceil(left / 1000)}
    end
    recovered = 1
  else
    recovered = 0
    clock()
  end
  token = now
  local prev = tonumber(tok)
  if prev >= 9007199254740991 then
    return {5, 'token space exhausted'}
  end
  if prev >= token then
    token = prev + 1
  end
  n = math.min(tonumber(cnt) + 1, 999999999)
end

redis.call('SET', key,
  'i1P' .. string.format('%d', token) .. ':' .. n .. ':' .. recovered .. ':' ..
  string.format('%d', now + lease * 1000) .. ':' .. attempt .. ':' .. fp .. ':' .. checkpoints,
  'PX', keep)
return claimed(token, n, recovered)
