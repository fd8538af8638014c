-- lib.lua: functions the scripts that read records and the id index share
-- (inspect.lua, forget.lua, abandon.lua, checkpoint.lua, compact_move.lua):
-- finding a compact claim or a marker in the index (see compact_claim.lua),
-- reading its place in its call record, and describing a record. It is put
-- before each of them, so that they are one script each; it only defines
-- functions.
--
-- The operator scripts take the index from their arguments after their own:
-- KEYS[2] is the index key of the record's entry, IX[1] its block, IX[2] the
-- first 7 bytes of its entry (its digest), IX[3] the start of the call record
-- keys, IX[4] the index's layout. Without KEYS[2] (Scan reads the record keys
-- only) there is no index to look in.

-- index_find returns the position in the block blk of the entry whose first
-- 7 bytes are d7 (entries are 16 bytes, so it starts at 1 modulo 16), or
-- nil.
local function index_find(blk, d7)
  local pos = string.find(blk, d7, 1, true)
  while pos and pos % 16 ~= 1 do
    pos = string.find(blk, d7, pos + 1, true)
  end
  return pos
end

-- index_entry finds the entry of the record in the index: the block's value,
-- the entry's position in it, the token of the call that holds it (decimal)
-- and its place in the call; nil when there is no index to look in or no
-- entry; or, as a fifth value, the layout of an index key laid out otherwise.
local function index_entry(ikey, ix)
  if not ikey then
    return nil
  end
  local got = redis.call('HMGET', ikey, ix[1], '')
  if got[2] and got[2] ~= ix[4] then
    return nil, nil, nil, nil, got[2]
  end
  local blk = got[1]
  local pos = blk and index_find(blk, ix[2])
  if not pos then
    return nil
  end
  local p1, p2, a, b, c, d, e, f, g = string.byte(blk, pos + 7, pos + 15)
  local tok = ((((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f) * 256 + g)
  return blk, pos, string.format('%d', tok), p1 * 256 + p2
end

-- index_drop takes the entry at pos out of blk, the value of the field
-- block of the index key ikey.
local function index_drop(ikey, block, blk, pos)
  blk = string.sub(blk, 1, pos - 1) .. string.sub(blk, pos + 16)
  if blk == '' then
    redis.call('HDEL', ikey, block)
  else
    redis.call('HSET', ikey, block, blk)
  end
end

-- index_remove takes the entry whose first 7 bytes are d7 out of the field
-- block of the index key ikey, if it is there.
local function index_remove(ikey, block, d7)
  local blk = redis.call('HGET', ikey, block)
  local pos = blk and index_find(blk, d7)
  if pos then
    index_drop(ikey, block, blk, pos)
  end
end

-- call_place reads place p of the call record at key ck: a table with the
-- place's state byte as a letter (st), the call's lease end (until_us),
-- when it last completed a claim (done_us), its attempt id (att), the
-- place's fingerprint (fp), where the place's state byte is in the record
-- (at) and the record's key (ck); nil when there is no call record or p is
-- not one of its places; or nil and a reason when it is not one of ours.
local function call_place(ck, p)
  local v = redis.pcall('GET', ck)
  if type(v) == 'table' then
    return nil, 'wrong type'
  end
  if not v then
    return nil
  end
  local _, e, u, done, att, fpw = string.find(v, '^i1B(%d+):(%d+):([%w_%-]*):(%d+):')
  if not e then
    return nil, 'unknown format'
  end
  local w = tonumber(fpw)
  local places = (#v - e) / (1 + w)
  if p < 1 or p > places then
    return nil
  end
  local fp = ''
  if w > 0 then
    local from = e + 1 + places + (p - 1) * w
    fp = string.gsub(string.sub(v, from, from + w - 1), '%.+$', '')
  end
  return {st = string.sub(v, e + p, e + p), until_us = u, done_us = done, att = att, fp = fp, at = e + p, ck = ck}
end

-- index_claim is call_place for place p of the call of token tok.
local function index_claim(ix, tok, p)
  return call_place(ix[3] .. tok, p)
end

-- index_reply describes the compact claim or marker c of token tok as
-- inspect.lua describes a record, with a header in the long form of its
-- state (a compact claim is attempt 1, not recovered; a marker's result is
-- an empty one, the envelope "\1b"), the call record's PTTL, Redis's clock
-- t, no checkpoints (0) and when the call completed it; nil for a place
-- the call no longer holds.
local function index_reply(code, c, tok, t)
  local head, rest = nil, ''
  if c.st == 'P' then
    head = 'i1P' .. tok .. ':1:0:' .. c.until_us .. ':' .. c.att .. ':' .. c.fp .. ':'
  elseif c.st == 'R' then
    head = 'i1R' .. tok .. ':1:0:0:' .. c.att .. ':' .. c.fp .. ':'
  elseif c.st == 'C' then
    head, rest = 'i1C' .. tok .. ':1:0:0:' .. c.att .. ':' .. c.fp .. ':', '\1b'
  else
    return nil
  end
  return {code, head, redis.call('PTTL', c.ck), #rest, rest, t[1], t[2], 0, tonumber(c.done_us)}
end

-- checkpoint_list lists the checkpoints that follow a record's header in v
-- from position from: LEN ":" NAME LEN ":" VALUE fields (see
-- checkpoint.lua), as {name, value size, name, value size, ...}; nil when
-- there are none; false when what follows cannot be read as checkpoints
-- (written by a later version, say).
local function checkpoint_list(v, from)
  if from > #v then
    return nil
  end
  local cps, pos, n = {}, from, 0
  while pos <= #v do
    local len = string.match(v, '^(%d+):', pos)
    if not len or #len > 9 then
      return false
    end
    local start = pos + #len + 1
    pos = start + tonumber(len)
    if pos > #v + 1 then
      return false
    end
    n = n + 1
    if n % 2 == 1 then
      cps[#cps + 1] = string.sub(v, start, pos - 1)
    else
      cps[#cps + 1] = tonumber(len)
    end
  end
  if n % 2 ~= 0 then
    return false
  end
  return cps
end

-- record_reply describes the record v at key, whose header is head, as the
-- operator scripts answer it: {code, header, pttl_ms, rest_len, rest_head,
-- now_s, now_us}, Redis's clock t (the checkpoints, if any, go after).
local function record_reply(code, key, v, head, t)
  return {code, head, redis.call('PTTL', key), #v - #head, string.sub(v, #head + 1, #head + 2), t[1], t[2]}
end
