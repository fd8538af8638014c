-- lib.lua: functions the scripts that read records and the id index share
-- (claim.lua and the operator scripts): finding a compact claim or a marker
-- in the index (see format.go, "The v3 layout"), reading a call record's
-- place, and describing a record; and the transitions off the hot path
-- that a script and its batch form share (a release, a renewal: a function
-- made and called costs a script about 0.3 µs, which complete.lua, the last
-- step of every Do, does not pay: it keeps its code inline). It goes
-- after format.lua, whose formats it reads, before each of them, so that
-- they are one script each (each with the definitions it uses: see
-- format.lua); it only defines functions and constants.
--
-- The operator scripts take the index from their arguments after their own:
-- KEYS[2] is the index key of the record's entry, IX[1] the first 8 bytes of
-- the record's index digest (an entry's digest and block hash), IX[2] the
-- start of the call record keys. Without KEYS[2] (Scan reads the record
-- keys only) there is no index to look in.
--
-- An index key of another layout (its field "" not a v3 state: an index
-- of a layout before v3) is refused by every script with the error
-- "IDEMLAYOUT " and what the field holds, before anything is written.

-- index_now is Redis's clock in microseconds.
local function index_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- call_get returns the value of the call record key ck; nil when there is
-- none; nil and 'wrong type' when the key holds another type.
local function call_get(ck)
  local v = redis.pcall('GET', ck)
  if type(v) == 'table' then
    return nil, 'wrong type'
  end
  return v or nil
end

-- call_place reads place p of the call record at key ck (see format.lua's
-- V3_CALL): a table with the place's state letter (st), the call's lease
-- end (until_us, decimal, and untl, a number), when it last completed a
-- claim (done_us) and when its results' retention ends (runtil_us, and
-- runtil, a number), its call id (att), the place's fingerprint (fp),
-- attempt count (cnt) and recovered flag (rec, '0' or '1'), where the
-- place's state byte is in the record (at) and the record's key (ck); nil
-- when there is no call record or p is not one of its places; or nil and
-- a reason when it is not one of ours.
local function call_place(ck, p)
  local v, why = call_get(ck)
  if not v then
    return nil, why
  end
  local _, e, u, d, r, att, fpw, aw = string.find(v, V3_CALL)
  if not e then
    return nil, 'unknown format'
  end
  fpw, aw = string.byte(fpw), string.byte(aw)
  local places = (#v - e) / (1 + aw + fpw)
  if places % 1 ~= 0 then
    return nil, 'unknown format'
  end
  if p < 1 or p > places then
    return nil
  end
  local t, td, tr, untl, done, runtil = {string.byte(u, 1, v3TimeSize)}, {string.byte(d, 1, v3TimeSize)}, {string.byte(r, 1, v3TimeSize)}, 0, 0, 0
  for i = 1, v3TimeSize do
    untl, done, runtil = untl * 256 + t[i], done * 256 + td[i], runtil * 256 + tr[i]
  end
  local cnt, rec = 1, '0'
  if aw == v3AttemptSize then
    local a1, a2 = string.byte(v, e + places + (p - 1) * aw + 1, e + places + p * aw)
    cnt = a1 * 256 + a2
    if cnt >= v3RecoveredBit then
      cnt, rec = cnt - v3RecoveredBit, '1'
    end
  end
  local fo = e + places * (1 + aw) + (p - 1) * fpw
  return {st = string.sub(v, e + p, e + p), until_us = string.format('%d', untl), untl = untl, runtil = runtil,
    done_us = string.format('%d', done), runtil_us = string.format('%d', runtil), att = att,
    fp = string.match(string.sub(v, fo + 1, fo + fpw), '^(.-)%.*$'), cnt = cnt, rec = rec, at = e + p, ck = ck}
end

-- v3_index_entry finds the entry of the record whose digest starts with d8
-- (the digest's 5 bytes, then the hash's 3) in the v3 index key ikey,
-- whose field "" holds state (see v3_claim.lua): the entry's place in its
-- call, the call's token (a number, from the entry's low 48 bits and
-- Redis's clock now) and its low 48 bits as they name its call record
-- (tok6); nil when there is none.
local function v3_index_entry(ikey, state, d8, now)
  local l, s1, s2, s3 = string.byte(state, v3StateLevelAt, v3StateLevelAt + 3)
  local h1, h2, h3 = string.byte(d8, v3DigestSize + 1, v3DigestSize + 3)
  local b, half = (h1 * 256 + h2) * 256 + h3, 2 ^ l
  local lo = b % half
  if lo < (s1 * 256 + s2) * 256 + s3 then
    lo = b % (2 * half)
  end
  local blk = redis.call('HGET', ikey, string.char(math.floor(lo / 65536), math.floor(lo / 256) % 256, lo % 256))
  local pos = blk and string.find(blk, d8, 1, true)
  while pos and pos % v3EntrySize ~= 1 do
    pos = string.find(blk, d8, pos + 1, true)
  end
  if not pos then
    return nil
  end
  local p1, p2 = string.byte(blk, pos + v3EntryPlaceAt - 1, pos + v3EntryPlaceAt)
  local tok6 = string.sub(blk, pos + v3EntryTokenAt - 1, pos + v3EntryTokenAt + 4)
  local t48 = 0
  for _, x in ipairs({string.byte(tok6, 1, 6)}) do
    t48 = t48 * 256 + x
  end
  local ref = now + v3TokenAhead
  return p1 * 256 + p2, ref - (ref - t48) % v3TokenModulus, tok6
end

-- index_entry finds the entry of the record whose digest starts with ix[1]
-- in the index key ikey: the token of the call that holds it (decimal) and
-- its place in that call, and sets ix.t6 to the token's low 48 bits, which
-- name the call's record (index_callkey); nil when there is no index to
-- look in or no entry; or, as a third value, the field "" of an index key
-- laid out otherwise. An entry stays where it is (a reader marks its place
-- in the call record instead) until a claim sweeps it.
local function index_entry(ikey, ix)
  if not ikey then
    return nil
  end
  local state = redis.call('HGET', ikey, '')
  if not state then
    return nil
  end
  if not string.find(state, V3_STATE) then
    return nil, nil, state
  end
  local place, token, tok6 = v3_index_entry(ikey, state, ix[1], index_now())
  if not place then
    return nil
  end
  ix.t6 = tok6
  return string.format('%d', token), place
end

-- index_callkey is the key of the call record of the entry that
-- index_entry found in index ix.
local function index_callkey(ix)
  return ix[2] .. ix.t6
end

-- index_claim is call_place for place p of the call of the entry that
-- index_entry found in index ix.
local function index_claim(ix, p)
  return call_place(ix[2] .. ix.t6, p)
end

-- index_reply describes the compact claim or marker c of token tok as
-- inspect.lua describes a record, with a header in the long form of its
-- state (a compact claim is attempt 1, not recovered; a marker's result is
-- an empty one, the envelope "\1b"), the call record's PTTL, Redis's clock
-- t, no checkpoints (0) and when the call completed it; nil for a place
-- the call no longer holds.
local function index_reply(code, c, tok, t)
  local head, rest = nil, ''
  local cnt, rec = c.cnt or '1', c.rec or '0'
  if c.st == 'P' then
    head = record_head('P', tok, cnt, rec, c.until_us, c.att, c.fp)
  elseif c.st == 'R' then
    head = record_head('R', tok, cnt, rec, '0', c.att, c.fp)
  elseif c.st == 'C' then
    head, rest = record_head('C', tok, cnt, rec, '0', c.att, c.fp), '\1b'
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
    local len = string.match(v, CHECKPOINT_FIELD, pos)
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

-- record_read reads the record at key for a transition of a claim: its
-- value and what RECORD_LONG reads of it (the header's end, state, token,
-- attempt count, recovered flag, attempt id and fingerprint); or, when
-- there is no claim's record at key, transitionLost (none, or a completed
-- record of the short form, which no claim holds) or why the value is not
-- a record of ours (a string).
local function record_read(key)
  local v = redis.pcall('GET', key)
  if not v then
    return transitionLost
  end
  if type(v) ~= 'string' then
    return 'wrong type'
  end
  local _, hdr, st, tok, cnt, rec, _, att, fp = string.find(v, RECORD_LONG)
  if not st then
    if string.find(v, RECORD_SHORT) then
      return transitionLost
    end
    return 'unknown format'
  end
  return v, hdr, st, tok, cnt, rec, att, fp
end

-- record_release gives up the claim of token (decimal) on the record at
-- key, as release.lua says, a released record without checkpoints kept keep
-- milliseconds: transitionDone (released, or released before by token),
-- transitionLost, or why the value at the key is not a record of ours (a
-- string). release.lua and batch_release.lua share it.
local function record_release(key, token, keep)
  local v, hdr, st, tok, cnt, _, _, fp = record_read(key)
  if not hdr then
    return v
  end
  if tok ~= token then
    return transitionLost
  end
  if st == 'R' then
    return transitionDone
  end
  if st ~= 'P' then
    return transitionLost
  end
  if hdr < #v then
    redis.call('SET', key, record_head('R', tok, cnt, '0', '0', '', fp) .. string.sub(v, hdr + 1), 'KEEPTTL')
  else
    redis.call('SET', key, record_head('R', tok, cnt, '0', '0', '', ''), 'PX', keep)
  end
  return transitionDone
end

-- record_extend renews the lease of the claim of token (decimal) on the
-- record at key, as extend.lua says, to lease milliseconds after now() (a
-- function that answers Redis's clock in microseconds, called only for a
-- claim of token), the record kept keep milliseconds: transitionDone,
-- transitionLost, or why the value at the key is not a record of ours (a
-- string). extend.lua and batch_extend.lua share it.
local function record_extend(key, token, lease, keep, now)
  local v, hdr, st, tok, cnt, rec, att, fp = record_read(key)
  if not hdr then
    return v
  end
  if st ~= 'P' or tok ~= token then
    return transitionLost
  end
  redis.call('SET', key,
    record_head('P', tok, cnt, rec, string.format('%d', now() + lease * 1000), att, fp) .. string.sub(v, hdr + 1),
    'PX', keep)
  return transitionDone
end
