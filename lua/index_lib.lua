-- index_lib.lua: how the operator scripts (inspect.lua, forget.lua,
-- abandon.lua) find a compact claim or a marker in the id index (see
-- compact_claim.lua). It is put before each of them, so that they are one
-- script each; it only defines functions.
--
-- The scripts take it from their arguments after their own: KEYS[2] is the
-- index key of the record's entry, IX[1] its block, IX[2] the first 7 bytes of
-- its entry (its digest), IX[3] the start of the call record keys. Without
-- KEYS[2] (Scan reads the record keys only) there is no index to look in.

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
  local pos = blk and string.find(blk, ix[2], 1, true)
  while pos and pos % 16 ~= 1 do
    pos = string.find(blk, ix[2], pos + 1, true)
  end
  if not pos then
    return nil
  end
  local p1, p2, a, b, c, d, e, f, g = string.byte(blk, pos + 7, pos + 15)
  local tok = ((((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f) * 256 + g)
  return blk, pos, string.format('%d', tok), p1 * 256 + p2
end

-- index_drop takes the entry at pos out of the block blk.
local function index_drop(ikey, ix, blk, pos)
  blk = string.sub(blk, 1, pos - 1) .. string.sub(blk, pos + 16)
  if blk == '' then
    redis.call('HDEL', ikey, ix[1])
  else
    redis.call('HSET', ikey, ix[1], blk)
  end
end

-- index_claim reads place p of the call record of token tok: a table with
-- the place's state byte as a letter (st), the call's lease end (until_us),
-- when it last completed a claim (done_us), its attempt id (att), the
-- place's fingerprint (fp), where the place's state byte is in the record
-- (at) and the record's key (ck); nil when there is no call record or p is
-- not one of its places; or nil and a reason when it is not one of ours.
local function index_claim(ix, tok, p)
  local ck = ix[3] .. tok
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
