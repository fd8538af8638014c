-- compact_claim.lua: claim many records at once, looking at the records and at
-- the id index of compact claims, and keeping the new claims compactly or
-- each in a record of its own.
--
-- A compact claim is an entry of 16 bytes in the id index and a place in one
-- call record, instead of a Redis key: what a consumer's message handled that
-- way leaves is that entry and one byte of the call record, a marker.
--
-- KEYS          the record keys, distinct, n of them, then the index key all
--               their entries are in (of one Cluster slot)
-- ARGV[1]       attempt id (base64url), unique per batch call
-- ARGV[2]       lease in milliseconds
-- ARGV[3]       time to keep a pending record, in milliseconds (>= lease)
-- ARGV[4]       time to keep the call record and the index key, in
--               milliseconds: the lease and the longer of the retention and
--               the marker retention
-- ARGV[5]       retention in milliseconds: a marker younger than that
--               answers as a completed record with an empty result
-- ARGV[6]       marker retention in milliseconds: a marker older than that
--               is no answer
-- ARGV[7]       the start of the call record keys; a call record key is
--               ARGV[7] .. TOKEN
-- ARGV[8]       entries of a block past which it is swept of the entries
--               whose call record is gone, when one more is added
-- ARGV[9]       'c' to keep new claims compactly, 'r' in records of their own
-- ARGV[10]      the layout of the index, which every index key holds in its
--               field "": a key of another layout is refused
-- ARGV[11]      the block of each record in the index key, a field name of 3
--               bytes: those of KEYS[i] at 3i-2 to 3i
-- ARGV[12]      the start of each record's entry, 9 bytes: 7 bytes of the
--               digest its id is, then its place in this call, 2 bytes
--               big-endian (i); that of KEYS[i] at 9i-8 to 9i
-- ARGV[12+i]    fingerprint of the request of KEYS[i] (base64url, at most 64
--               bytes, may be empty), present only when the call has
--               fingerprints: #ARGV is 12 or 12 + n
--
-- Returns one flat array: for each record in turn, one of
--   6                                           claimed compactly by this call:
--                                               the call's token, attempt 1,
--                                               not recovered, place i
--   10, token, place                            claimed compactly by an earlier
--                                               run of this call (its reply was
--                                               lost and it was sent again)
--   13                                          claimed a new record: token
--                                               Redis's clock (the reply's
--                                               last), attempt 1, not
--                                               recovered, no checkpoints
--   1, token, attempt, recovered, checkpoints   claimed a record (checkpoints may be '')
--   2, record                                   completed (a record)
--   8, token                                    completed (a marker): an empty
--                                               result, within the retention
--   9, token                                    completed (a marker) longer ago
--                                               than the retention: the result
--                                               is no longer kept
--   11, token, attempt                          completed, a record whose result
--   12, token, attempt                          is a marker's (see claim.lua's
--                                               marked): as 8 and 9
--   3, lease_left_ms                            in progress
--   4                                           another fingerprint
--   5, reason                                   not a record of ours
--   7, error                                    Redis refused a write (OOM,
--                                               READONLY, ...): not claimed
-- then the call's token (0 when no record was claimed compactly) and Redis's
-- clock (microseconds); or the error "IDEMLAYOUT " and the layout the index
-- key holds, when it is not ARGV[10], and nothing is done.
--
-- The id index: hashes whose fields are blocks of entries, each entry 16
-- bytes: DIGEST7 PLACE2 TOKEN7, the record's digest, its place in the call
-- that holds it and that call's token (microseconds), big-endian. One HMGET
-- reads the blocks of a call's records, one HSET writes those that changed:
-- no Redis command per record. The call record, a string:
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
-- record, and takes the entry out of the index, so the call record alone
-- says whether the call still holds it.
--
-- A record key's value comes first: when it holds a record, the index is
-- not asked, and the rules are those of claim.lua. (A compact claim does
-- not look at a record key that holds no string; a claim of a record
-- answers it "not a record of ours".) A compact claim whose
-- lease ran out, or that was released, is taken over by a record of its own
-- (attempt 2 and on). Safe to run twice for one call: a record claimed by
-- the first run is found with the same attempt id and answered the same
-- claim (10, or 1 for a record).
local n = (#KEYS - 1)
local ikey = KEYS[n + 1]
local attempt, lease, keep, callkeep = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local retention, mretention = tonumber(ARGV[5]) * 1000, tonumber(ARGV[6]) * 1000
local cbase, sweepcut = ARGV[7], 16 * tonumber(ARGV[8])
local compact, withfps = ARGV[9] == 'c', #ARGV == 12 + n
local layout, blocknames, heads = ARGV[10], ARGV[11], ARGV[12]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local until_s = string.format('%d', now + lease * 1000)
-- A new record of this call, but for its fingerprint: token now, attempt 1,
-- not recovered.
local fresh = 'i1P' .. string.format('%d', now) .. ':1:0:' .. until_s .. ':' .. attempt .. ':'

-- The call's token: Redis's clock, unless a call record holds it already.
local token = now
if compact then
  while redis.call('EXISTS', cbase .. string.format('%d', token)) == 1 do
    token = token + 1
  end
end
local token_s = string.format('%d', token)

-- bytes7 is x, below 2^56, in 7 bytes big-endian.
local function bytes7(x)
  local b = {}
  for j = 7, 1, -1 do
    b[j] = x % 256
    x = (x - b[j]) / 256
  end
  return string.char(b[1], b[2], b[3], b[4], b[5], b[6], b[7])
end
local tok7 = bytes7(token)

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
  local value = 'i1P' .. string.format('%d', tok) .. ':' .. c .. ':' .. recovered .. ':' ..
    until_s .. ':' .. attempt .. ':' .. fp .. ':' .. checkpoints
  local ok
  if prev == 0 then
    -- The key held no string: NX, so that a value of another type there
    -- is refused rather than overwritten.
    ok = redis.pcall('SET', KEYS[i], value, 'PX', keep, 'NX')
    if not ok then
      return 5, 'wrong type'
    end
  else
    ok = redis.pcall('SET', KEYS[i], value, 'PX', keep)
  end
  if type(ok) == 'table' and ok.err then
    return refused(ok)
  end
  return 1, tok, c, recovered, checkpoints
end

-- newfresh writes a new pending record for KEYS[i], which holds no string,
-- and answers 13; NX, so that a value of another type there is refused
-- rather than overwritten.
local function newfresh(i, fp)
  local ok = redis.pcall('SET', KEYS[i], fresh .. fp .. ':', 'PX', keep, 'NX')
  if not ok then
    return 5, 'wrong type'
  end
  if type(ok) == 'table' and ok.err then
    return refused(ok)
  end
  return 13
end

-- record answers for KEYS[i], whose value v is a record (see claim.lua).
local function record(i, v, fp)
  local a, b, c, d = string.byte(v, 1, 4)
  if d == 58 and c == 67 and b == 49 and a == 105 then
    if string.byte(v, #fp + 5) == 58 and string.sub(v, 5, #fp + 4) == fp then
      -- A result that is a marker's (see claim.lua's marked) answers as
      -- a marker.
      local at, _, untl = string.find(v, '\1m(%d+)$', math.max(1, #v - 24))
      if at then
        local _, e, tok36, cnt = string.find(v, '^i1C:[%w_%-]*:([%da-z]+):(%d+):[01]:')
        if e and e + 1 == at then
          if now < tonumber(untl) then
            return 11, tonumber(tok36, 36), tonumber(cnt)
          end
          return 12, tonumber(tok36, 36), tonumber(cnt)
        end
      end
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
-- record's value, or false when there is none; headers[tok] its header.
local calls, headers = {}, {}
local function call(tok)
  local v = calls[tok]
  if v == nil then
    v = redis.call('GET', cbase .. tok) or false
    calls[tok] = v
  end
  return v
end

-- header reads the call record of tok: its lease end, when it last
-- completed a claim, its attempt id, its fingerprint width, where STATES
-- starts and how many places it has; nil if it is not a call record.
local function header(tok, v)
  local h = headers[tok]
  if not h then
    local _, e, u, done, att, fpw = string.find(v, '^i1B(%d+):(%d+):([%w_%-]*):(%d+):')
    if not e then
      return nil
    end
    fpw = tonumber(fpw)
    h = {tonumber(u), tonumber(done), att, fpw, e + 1, (#v - e) / (1 + fpw)}
    headers[tok] = h
  end
  return h[1], h[2], h[3], h[4], h[5], h[6]
end

-- mark puts byte s at place p of the call record tok.
local function mark(tok, p, s)
  local cv = call(tok)
  local _, _, _, _, at = header(tok, cv)
  redis.call('SETRANGE', cbase .. tok, at + p - 2, s)
  calls[tok] = string.sub(cv, 1, at + p - 2) .. s .. string.sub(cv, at + p)
end

-- entrytoken reads the token and place of the entry at pos of block blk.
local function entrytoken(blk, pos)
  local p1, p2, a, b, c, d, e, f, g = string.byte(blk, pos + 7, pos + 15)
  return string.format('%d', ((((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f) * 256 + g)), p1 * 256 + p2
end

-- sweep returns blk without the entries whose call record is gone, as
-- their age says and the call record's absence confirms.
local function sweep(blk)
  local kept = {}
  for pos = 1, #blk, 16 do
    local tok = entrytoken(blk, pos)
    if now - tonumber(tok) <= tonumber(callkeep) * 1000 or call(tok) then
      kept[#kept + 1] = string.sub(blk, pos, pos + 15)
    end
  end
  return table.concat(kept)
end

-- entryof answers for KEYS[i] from its index entry, that of call ctok at
-- place: nil when the entry is stale (its call record gone, or no longer
-- holding the record); drop is set when the entry must leave the index.
local function entryof(i, fp, ctok, place)
  local cv = call(ctok)
  if not cv then
    return true, nil
  end
  local u, done, att, cfpw, at, places = header(ctok, cv)
  if not u then
    return false, 5, 'unknown format'
  end
  if place < 1 or place > places then
    return true, nil
  end
  local st = string.sub(cv, at + place - 1, at + place - 1)
  if st == 'P' or st == 'C' then
    local rfp = ''
    if cfpw > 0 then
      local from = at + places + (place - 1) * cfpw
      rfp = string.gsub(string.sub(cv, from, from + cfpw - 1), '%.+$', '')
    end
    if rfp ~= fp then
      return false, 4
    end
  end
  if st == 'P' then
    if att == attempt then
      return false, 10, tonumber(ctok), place
    end
    if u > now then
      return false, 3, math.ceil((u - now) / 1000)
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
      return true, code, x, y, z, w
    end
    return false, code, x, y, z, w
  end
  if st == 'C' then
    local age = now - done
    if age <= retention then
      return false, 8, tonumber(ctok)
    end
    if age <= mretention then
      return false, 9, tonumber(ctok)
    end
  end
  return true, nil
end

local fpw = 0
if withfps then
  for i = 1, n do
    fpw = math.max(fpw, #ARGV[12 + i])
  end
end
local pad = string.rep('.', fpw)

-- The records of a call come ordered by block, so that those of one block
-- are next to each other: blk is the block of the record at hand, as this
-- call changes it, and writes the blocks to write back, block then value.
-- (Claims kept in records find nothing in an index key that is not there:
-- no reading of its blocks, every block empty.)
local names, blocks = {''}, {}
local indexed = compact or redis.call('EXISTS', ikey) == 1
if indexed then
  for i = 1, n do
    names[i + 1] = string.sub(blocknames, 3 * i - 2, 3 * i)
  end
  blocks = redis.call('HMGET', ikey, unpack(names))
end
-- blocks[1] is the field "", the layout: blocks[i + 1] that of KEYS[i].
if blocks[1] and blocks[1] ~= layout then
  return redis.error_reply('IDEMLAYOUT ' .. blocks[1])
end
local recs = redis.call('MGET', unpack(KEYS, 1, n))
local writes, nw = {}, 0
local out, m, states, fps, claimed = {}, 0, {}, {}, false
local lastf, blk, dirty
for i = 1, n do
  local f = names[i + 1]
  if f ~= lastf then
    if dirty then
      writes[nw + 1], writes[nw + 2], nw = lastf, blk, nw + 2
    end
    lastf, blk, dirty = f, blocks[i + 1] or '', false
  end
  local fp = ''
  if withfps then
    fp = ARGV[12 + i]
  end
  local code, a, b, c, d
  if recs[i] then
    code, a, b, c, d = record(i, recs[i], fp)
  elseif not indexed then
    code, a = newfresh(i, fp)
  else
    local head = string.sub(heads, 9 * i - 8, 9 * i)
    if blk ~= '' then
      local d7 = string.sub(head, 1, 7)
      local pos = string.find(blk, d7, 1, true)
      while pos and pos % 16 ~= 1 do
        pos = string.find(blk, d7, pos + 1, true)
      end
      if pos then
        local ctok, place = entrytoken(blk, pos)
        local drop
        drop, code, a, b, c, d = entryof(i, fp, ctok, place)
        if drop then
          blk, dirty = string.sub(blk, 1, pos - 1) .. string.sub(blk, pos + 16), true
        end
      end
    end
    if not code then
      -- No entry, or a stale one: the record is free.
      if compact then
        if #blk >= sweepcut then
          blk = sweep(blk)
        end
        blk, dirty, code = blk .. head .. tok7, true, 6
      else
        code, a = newfresh(i, fp)
      end
    end
  end
  m = m + 1
  out[m] = code
  if code == 6 then
    states[i], claimed = 'P', true
  else
    states[i] = 'X'
    if code == 1 then
      out[m + 1], out[m + 2], out[m + 3], out[m + 4] = a, b, c, d
      m = m + 4
    elseif code == 10 or code == 11 or code == 12 then
      out[m + 1], out[m + 2] = a, b
      m = m + 2
    elseif code ~= 4 and code ~= 13 then
      m = m + 1
      out[m] = a
    end
  end
  if fpw > 0 then
    fps[i] = string.sub(fp .. pad, 1, fpw)
  end
end
if dirty then
  writes[nw + 1], writes[nw + 2], nw = lastf, blk, nw + 2
end

if nw > 0 then
  if not blocks[1] then
    writes[nw + 1], writes[nw + 2], nw = '', layout, nw + 2
  end
  local ok = redis.pcall('HSET', ikey, unpack(writes, 1, nw))
  if type(ok) == 'table' and ok.err then
    -- Redis refused the call's first write (OOM, READONLY): nothing was
    -- written, and no record was claimed compactly.
    local _, why = refused(ok)
    local again, k, j = {}, 0, 1
    while j <= m do
      local code, size = out[j], 2
      if code == 1 then
        size = 5
      elseif code == 10 or code == 11 or code == 12 then
        size = 3
      elseif code == 4 or code == 6 or code == 13 then
        size = 1
      end
      if code == 6 then
        again[k + 1], again[k + 2], k = 7, why, k + 2
      else
        for x = j, j + size - 1 do
          k = k + 1
          again[k] = out[x]
        end
      end
      j = j + size
    end
    out, m, claimed = again, k, false
  else
    -- Never shortened: a completion or a renewal may have kept it longer.
    if redis.call('PTTL', ikey) < tonumber(callkeep) then
      redis.call('PEXPIRE', ikey, callkeep)
    end
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
