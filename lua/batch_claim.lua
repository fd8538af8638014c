-- batch_claim.lua: claim.lua for many records at once, one answer per record.
--
-- KEYS      the record keys, distinct
-- ARGV[1]   attempt id (base64url), unique per batch call; each record checks it
--           on its own, as claim.lua does
-- ARGV[2]   lease in milliseconds
-- ARGV[3]   time to keep a pending record, in milliseconds (>= lease)
-- ARGV[3+i] fingerprint of the request of KEYS[i] (base64url, may be empty)
--
-- Returns one flat array: for each record in turn, what claim.lua answers
-- for it, without the braces, then Redis's clock (microseconds):
--   1, token, attempt, recovered, checkpoints   claimed (checkpoints may be '')
--   6                                           claimed a new record: token the
--                                               clock, attempt 1, not recovered
--   2, record                                   completed
--   3, lease_left_ms                            in progress
--   4                                           another fingerprint
--   5, reason                                   not a record of ours
--   7, error                                    Redis refused a write (OOM,
--                                               READONLY, ...): not claimed
-- (One array rather than one per record, and a new record told by one
-- number: the replies, not the claims, were most of Redis's work.)
--
-- The rules, the record format and the checkpoints are those of claim.lua;
-- batch_test.go holds the two to the same answers. Redis's clock is read once
-- per call. A new record is written by one SET NX GET, which answers the
-- value of a record that is there instead. Safe to run twice for one call:
-- each record finds its own attempt id and answers the same claim.
local attempt, lease, keep = ARGV[1], tonumber(ARGV[2]), ARGV[3]

-- Redis's clock; now_s and until_s are the token of a new record and the lease
-- end of every record the call claims, in decimal.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_s, until_s = string.format('%d', now), string.format('%d', now + lease * 1000)

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

-- refused answers a write that Redis refused: a value that is not a string
-- is not ours (corrupt); anything else (OOM, READONLY, ...) is Redis's to
-- answer: 7 and its error.
local function refused(e)
  local msg = e.err or tostring(e)
  if string.sub(msg, 1, 9) == 'WRONGTYPE' then
    return 5, 'wrong type'
  end
  return 7, msg
end

local claim_existing -- below

-- claim answers for one record, as several return values (see above).
local function claim(key, fp)
  local v = redis.pcall('SET', key, 'i1P' .. now_s .. ':1:0:' .. until_s .. ':' .. attempt .. ':' .. fp .. ':',
    'NX', 'GET', 'PX', keep)
  if type(v) == 'table' then
    local code, why = refused(v)
    if code == 5 then
      return code, why
    end
    -- Redis refused the write: a record there still answers, as long as
    -- the answer writes nothing.
    v = redis.pcall('GET', key)
    if type(v) ~= 'string' then
      return code, why
    end
    return claim_existing(key, v, fp)
  end
  if not v then
    return 6
  end
  return claim_existing(key, v, fp)
end
-- claim_existing answers for a record key whose value v is there.
claim_existing = function(key, v, fp)
  local a, b, c, d = string.byte(v, 1, 4)
  if d == 58 and c == 67 and b == 49 and a == 105 then
    -- "i1C:" FP ":": a completed record of the short form (see claim.lua).
    if string.byte(v, #fp + 5) == 58 and string.sub(v, 5, #fp + 4) == fp then
      return 2, v
    end
    if string.find(v, '^i1C:[%w_%-]*:[%da-z]+:%d+:[01]:') then
      return 4
    end
    return 5, 'unknown format'
  end
  local _, hdr, st, tok, cnt, rec, until_us, att, rfp =
    string.find(v, '^i1([PCR])(%d+):(%d+):([01]):(%d+):([%w_%-]*):([%w_%-]*):')
  if not st then
    return 5, 'unknown format'
  end
  if #tok > 16 or #cnt > 9 or #until_us > 16 or tonumber(tok) > 9007199254740991 then
    return 5, 'token or attempt count out of range'
  end
  if rfp ~= fp and (st ~= 'R' or hdr < #v) then
    return 4
  end
  if st == 'C' then
    return 2, v
  end
  local checkpoints, recovered = string.sub(v, hdr + 1), 0
  if not readable(checkpoints) then
    return 5, 'checkpoints unreadable'
  end
  if st == 'P' then
    if att == attempt then
      return 1, tonumber(tok), tonumber(cnt), tonumber(rec), checkpoints
    end
    local left = tonumber(until_us) - now
    if left > 0 then
      return 3, math.ceil(left / 1000)
    end
    recovered = 1
  end
  local prev = tonumber(tok)
  if prev >= 9007199254740991 then
    return 5, 'token space exhausted'
  end
  local token = now
  if prev >= token then
    token = prev + 1
  end
  local n = math.min(tonumber(cnt) + 1, 999999999)
  local ok = redis.pcall('SET', key,
    'i1P' .. string.format('%d', token) .. ':' .. n .. ':' .. recovered .. ':' ..
    until_s .. ':' .. attempt .. ':' .. fp .. ':' .. checkpoints,
    'PX', keep)
  if type(ok) == 'table' and ok.err then
    return refused(ok)
  end
  return 1, token, n, recovered, checkpoints
end

local out, m = {}, 0
for i = 1, #KEYS do
  local code, a, b, c, d = claim(KEYS[i], ARGV[3 + i])
  m = m + 1
  out[m] = code
  if code == 1 then
    out[m + 1], out[m + 2], out[m + 3], out[m + 4] = a, b, c, d
    m = m + 4
  elseif code ~= 4 and code ~= 6 then
    m = m + 1
    out[m] = a
  end
end
out[m + 1] = now
return out
