-- compact_claim.lua: claim many records at once, looking at the records and at
-- the id index of compact claims, and keeping the new claims compactly or
-- each in a record of its own.
--
-- A compact claim is an entry in an id index and a place in one call record,
-- instead of a Redis key: what a consumer's message handled that way leaves
-- is that entry and one byte of the call record, a marker.
--
-- KEYS          the record keys, distinct (of one Cluster slot)
-- ARGV[1]       attempt id (base64url), unique per batch call
-- ARGV[2]       lease in milliseconds
-- ARGV[3]       time to keep a pending record, in milliseconds (>= lease)
-- ARGV[4]       time to keep the call record, in milliseconds: the lease and
--               the longer of the retention and the marker retention
-- ARGV[5]       retention in milliseconds: a marker younger than that
--               answers as a completed record with an empty result
-- ARGV[6]       marker retention in milliseconds: a marker older than that
--               is no answer
-- ARGV[7]       the start of the id index keys; an index key is ARGV[7] .. n,
--               n from 0 to ARGV[8] - 1
-- ARGV[8]       how many index keys there are under ARGV[7]
-- ARGV[9]       the start of the call record keys; a call record key is
--               ARGV[9] .. TOKEN
-- ARGV[10]      entries of one index key past which a claim may sweep it of
--               the entries whose call record is gone (0: never)
-- ARGV[11]      'c' to keep new claims compactly, 'r' in records of their own
-- ARGV[11+i]    the field of KEYS[i] in the id index: 8 bytes, a digest of its
--               id, whose first three bytes also choose its index key:
--               (b1 * 65536 + b2 * 256 + b3) % ARGV[8]
-- ARGV[11+n+i]  fingerprint of the request of KEYS[i] (base64url, at most 64
--               bytes, may be empty), present only when the call has
--               fingerprints: #ARGV is 11 + n or 11 + 2n
--
-- Returns one flat array: for each record in turn, one of
--   6                                           claimed compactly by this call:
--                                               the call's token, attempt 1,
--                                               not recovered, place i
--   10, token, place                            claimed compactly by an earlier
--                                               run of this call (its reply was
--                                               lost and it was sent again)
--   1, token, attempt, recovered, checkpoints   claimed a record (checkpoints may be '')
--   2, record                                   completed (a record)
--   8, token                                    completed (a marker): an empty
--                                               result, within the retention
--   9, token                                    completed (a marker) longer ago
--                                               than the retention: the result
--                                               is no longer kept
--   3, lease_left_ms                            in progress
--   4                                           another fingerprint
--   5, reason                                   not a record of ours
--   7, error                                    Redis refused a write (OOM,
--                                               READONLY, ...): not claimed
-- then the call's token (0 when no record was claimed compactly) and Redis's
-- clock (microseconds).
--
-- The id index: small hashes, field a record's 8-byte digest, value TOKEN
-- PLACE: the token of the call record that holds it, in decimal, and its
-- place in that call, three digits. The call record, a string:
--   "i1B" LEASE_UNTIL_US ":" DONE_US ":" ATTEMPT_ID ":" FPW ":" STATES FPS
-- STATES holds one byte per place of the call: P pending (held by the call),
-- C completed (a marker), R released, X not claimed by the call, M moved to
-- a record of its own (taken over, claimed after a release, checkpointed or
-- completed with a value), F forgotten. FPS holds FPW bytes per place, its
-- fingerprint '.' padded; FPW is the longest fingerprint of the call (0
-- when it has none). DONE_US is when the call last completed a claim (0 if
-- never): its markers' retention runs from then. A call's claims share its
-- lease. The token of a call is Redis's clock in microseconds, made unique
-- among the call records there are, so that it is above every token its
-- records had before. Whatever takes a place over marks it in the call
-- record, so the call record alone says whether the call still holds it.
--
-- A record key's value comes first: when it holds a record, the index is
-- not asked, and the rules are those of claim.lua. A compact claim whose
-- lease ran out, or that was released, is taken over by a record of its own
-- (attempt 2 and on). Safe to run twice for one call: a record claimed by
-- the first run is found with the same attempt id and answered the same
-- claim (10, or 1 for a record).
local n = #KEYS
local attempt, lease, keep, callkeep = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local retention, mretention = tonumber(ARGV[5]) * 1000, tonumber(ARGV[6]) * 1000
local ibase, icount, cbase, sweepat = ARGV[7], tonumber(ARGV[8]), ARGV[9], tonumber(ARGV[10])
local compact, withfps = ARGV[11] == 'c', #ARGV == 11 + 2 * n

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local until_s = string.format('%d', now + lease * 1000)

-- The call's token: Redis's clock, unless a call record holds it already.
local token = now
if compact then
  while redis.call('EXISTS', cbase .. string.format('%d', token)) == 1 do
    token = token + 1
  end
end
local token_s = string.format('%d', token)

-- refused answers a write that Redis refused: a value that is not ours is
-- corrupt; anything else (OOM, READONLY, ...) is Redis's to answer.
local function refused(e)
  local msg = e.err or tostring(e)
  if string.sub(msg, 1, 9) == 'WRONGTYPE' then
    return 5, 'wrong type'
  end
  return 7, msg
end

-- readable reports whether s reads as checkpoints (see checkpoint.lua).
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

-- newrecord writes a pending record of its own for KEYS[i], after a claim
-- of token prev, cnt claims before this one.
local function newrecord(i, prev, cnt, recovered, fp, checkpoints)
  local tok = now
  if prev >= tok then
    tok = prev + 1
  end
  local c = math.min(cnt + 1, 999999999)
  local ok = redis.pcall('SET', KEYS[i],
    'i1P' .. string.format('%d', tok) .. ':' .. c .. ':' .. recovered .. ':' ..
    until_s .. ':' .. attempt .. ':' .. fp .. ':' .. checkpoints, 'PX', keep)
  if type(ok) == 'table' and ok.err then
    return refused(ok)
  end
  return 1, tok, c, recovered, checkpoints
end

-- record answers for KEYS[i], whose value v is a record (see claim.lua).
local function record(i, v, fp)
  local a, b, c, d = string.byte(v, 1, 4)
  if d == 58 and c == 67 and b == 49 and a == 105 then
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
  if tonumber(tok) >= 9007199254740991 then
    return 5, 'token space exhausted'
  end
  return newrecord(i, tonumber(tok), tonumber(cnt), recovered, fp, checkpoints)
end

-- The call records of the entries found, read once each: calls[tok] is the
-- record's value, or false when there is none.
local calls = {}
local function call(tok)
  local v = calls[tok]
  if v == nil then
    v = redis.call('GET', cbase .. tok) or false
    calls[tok] = v
  end
  return v
end

-- header reads a call record: its lease end, when it last completed a
-- claim, its attempt id, its fingerprint width, where STATES starts and
-- how many places it has; nil if v is not a call record.
local function header(v)
  local _, e, u, done, att, fpw = string.find(v, '^i1B(%d+):(%d+):([%w_%-]*):(%d+):')
  if not e then
    return nil
  end
  fpw = tonumber(fpw)
  return tonumber(u), tonumber(done), att, fpw, e + 1, (#v - e) / (1 + fpw)
end

-- mark puts byte s at place p of the call record tok.
local function mark(tok, p, s)
  local cv = call(tok)
  local _, _, _, _, at = header(cv)
  redis.call('SETRANGE', cbase .. tok, at + p - 2, s)
  calls[tok] = string.sub(cv, 1, at + p - 2) .. s .. string.sub(cv, at + p)
end

-- sweep removes from the index key ikey the entries whose call record is
-- gone, as their age says and the call records' absence confirms.
local function sweep(ikey)
  local all, gone = redis.call('HGETALL', ikey), {}
  for j = 2, #all, 2 do
    local ctok = string.sub(all[j], 1, -4)
    if now - tonumber(ctok) > tonumber(callkeep) * 1000 and not call(ctok) then
      gone[#gone + 1] = all[j - 1]
    end
  end
  if #gone > 0 then
    redis.call('HDEL', ikey, unpack(gone))
  end
end

-- entryof answers for KEYS[i] from its index entry: nil when the entry is
-- stale (its call record gone, or no longer holding the record).
local function entryof(i, fp, ikey, field, entry)
  local ctok, place = string.sub(entry, 1, -4), tonumber(string.sub(entry, -3))
  local cv = call(ctok)
  if not cv then
    return nil
  end
  local u, done, att, cfpw, at, places = header(cv)
  if not u then
    return 5, 'unknown format'
  end
  if not place or place < 1 or place > places then
    return nil
  end
  local st = string.sub(cv, at + place - 1, at + place - 1)
  if st == 'P' or st == 'C' then
    local rfp = ''
    if cfpw > 0 then
      local from = at + places + (place - 1) * cfpw
      rfp = string.gsub(string.sub(cv, from, from + cfpw - 1), '%.+$', '')
    end
    if rfp ~= fp then
      return 4
    end
  end
  if st == 'P' then
    if att == attempt then
      return 10, tonumber(ctok), place
    end
    if u > now then
      return 3, math.ceil((u - now) / 1000)
    end
  end
  if st == 'P' or st == 'R' then
    local recovered = 0
    if st == 'P' then
      recovered = 1
    end
    local code, x, y, z, w = newrecord(i, tonumber(ctok), 1, recovered, fp, '')
    if code == 1 then
      mark(ctok, place, 'M')
      redis.call('HDEL', ikey, field)
    end
    return code, x, y, z, w
  end
  if st == 'C' then
    local age = now - done
    if age <= retention then
      return 8, tonumber(ctok)
    end
    if age <= mretention then
      return 9, tonumber(ctok)
    end
  end
  return nil
end

-- index answers for KEYS[i], which holds no record, from the id index, and
-- claims it if nothing there holds it.
local function index(i, fp)
  local field = ARGV[11 + i]
  local a, b, c = string.byte(field, 1, 3)
  local ikey = ibase .. ((a * 65536 + b * 256 + c) % icount)
  local entry
  if compact then
    local set = redis.pcall('HSETNX', ikey, field, token_s .. string.sub(1000 + i, 2))
    if set == 1 then
      if sweepat > 0 and string.byte(field, 4) < 4 and redis.call('HLEN', ikey) > sweepat then
        sweep(ikey) -- one new entry in 64 checks the size of its index key
      end
      return 6
    end
    if type(set) == 'table' then
      local code, why = refused(set)
      if code == 5 then
        return code, why
      end
      -- A write was refused; a marker, or another's claim, is still an answer.
      entry = redis.pcall('HGET', ikey, field)
      if type(entry) ~= 'string' then
        return code, why
      end
      local x, y, z, w, q = entryof(i, fp, ikey, field, entry)
      if not x then
        return code, why
      end
      return x, y, z, w, q
    end
  end
  entry = redis.pcall('HGET', ikey, field)
  if type(entry) == 'table' then
    return 5, 'wrong type'
  end
  if entry then
    local x, y, z, w, q = entryof(i, fp, ikey, field, entry)
    if x then
      return x, y, z, w, q
    end
  end
  -- No entry, or a stale one: the record is free.
  if compact then
    local ok = redis.pcall('HSET', ikey, field, token_s .. string.sub(1000 + i, 2))
    if type(ok) == 'table' then
      return refused(ok)
    end
    return 6
  end
  if entry then
    redis.pcall('HDEL', ikey, field)
  end
  return newrecord(i, 0, 0, 0, fp, '')
end

local fpw = 0
if withfps then
  for i = 1, n do
    fpw = math.max(fpw, #ARGV[11 + n + i])
  end
end
local pad = string.rep('.', fpw)

local out, m, states, fps, claimed = {}, 0, {}, {}, false
local recs = redis.call('MGET', unpack(KEYS))
-- MGET answers nil for a key that holds no string, as for one that holds
-- nothing: one EXISTS of them all tells whether there is any such key.
local found = 0
for i = 1, n do
  if recs[i] then
    found = found + 1
  end
end
local other = {}
if redis.call('EXISTS', unpack(KEYS)) > found then
  for i = 1, n do
    if not recs[i] and redis.call('TYPE', KEYS[i]).ok ~= 'none' then
      other[i] = true
    end
  end
end
for i = 1, n do
  local fp = ''
  if withfps then
    fp = ARGV[11 + n + i]
  end
  local code, a, b, c, d
  if other[i] then
    code, a = 5, 'wrong type'
  elseif recs[i] then
    code, a, b, c, d = record(i, recs[i], fp)
  else
    code, a, b, c, d = index(i, fp)
  end
  m = m + 1
  out[m] = code
  if code == 1 then
    out[m + 1], out[m + 2], out[m + 3], out[m + 4] = a, b, c, d
    m = m + 4
  elseif code == 10 then
    out[m + 1], out[m + 2] = a, b
    m = m + 2
  elseif code ~= 4 and code ~= 6 then
    m = m + 1
    out[m] = a
  end
  if code == 6 then
    states[i], claimed = 'P', true
  else
    states[i] = 'X'
  end
  if fpw > 0 then
    fps[i] = string.sub(fp .. pad, 1, fpw)
  end
end

if claimed then
  redis.call('SET', cbase .. token_s,
    'i1B' .. until_s .. ':0:' .. attempt .. ':' .. fpw .. ':' .. table.concat(states) .. table.concat(fps),
    'PX', callkeep)
else
  token = 0
end
out[m + 1] = token
out[m + 2] = now
return out
