-- forget.lua: remove the record of one claim, named by its fencing token,
-- unless removing it would lose what the caller did not agree to lose.
--
-- KEYS[1]  the record key
-- ARGV[1]  the fencing token of the record to remove (decimal)
-- ARGV[2]  the same token in base 36 (lower case), as a completed record's
--          short form keeps it
-- ARGV[3]  "force" to remove also a pending record whose lease is live, or a
--          record that holds checkpoints; anything else refuses them
-- KEYS[2]  the index key of the record's entry, and ARGV[4] and ARGV[5] its
--          digest's first 8 bytes and the start of the call record keys
--          (see lib.lua): when the key holds no record, a
--          compact claim or marker of the token there is forgotten instead,
--          its place in its call record marked F (its entry, which then
--          answers nothing, stays until a claim sweeps it)
-- KEYS[3]  the call record key of the token (the start of the call record
--          keys and ARGV[1]): the one call record it may read and write
--
-- Returns one of
--   {0, now_s, now_us}         nothing to forget: no record at the key, or a
--                              record of another token (a newer claim, or the
--                              key completed by another attempt), which is left
--                              as it is
--   {1, header, pttl_ms, rest_len, rest_head, now_s, now_us[, checkpoints]}
--                              removed: the record as it was
--   {3, header, pttl_ms, rest_len, rest_head, now_s, now_us[, checkpoints]}
--                              refused, nothing done: the record is pending and its
--                              lease is live (an operation may be running), or it
--                              holds checkpoints (steps that happened, which the
--                              next attempt would do again)
--   {5, reason}                the value is not a record of ours; nothing done,
--                              even when forced
-- A compact claim or marker is answered with the same codes, in the form of
-- lib.lua's index_reply (9 elements).
--
-- The record is described as inspect.lua describes it. Safe to run twice for
-- one call (go-redis retries a command whose reply was lost): the second run
-- finds no record, or a record that a claim made since, and answers {0}
-- without touching it; or it finds the same record and refuses again.
-- Every key it reads or writes is one of its keys: on a Cluster whose slot
-- migrates, it runs where they all are, or is answered TRYAGAIN.
local key, token, token36, force = KEYS[1], ARGV[1], ARGV[2], ARGV[3] == 'force'
local ikey, ix = KEYS[2], {ARGV[4], ARGV[5]}

local v = redis.pcall('GET', key)
if type(v) == 'table' then
  return {replyNotOurs, 'wrong type'}
end
local t = redis.call('TIME')
if not v then
  local tok, place, other = index_entry(ikey, ix)
  if other then
    return redis.error_reply('IDEMLAYOUT ' .. other)
  end
  if tok ~= token or KEYS[3] ~= index_callkey(ix) then
    return {recordNone, t[1], t[2]}
  end
  local c, why = index_claim(ix, place)
  if why then
    return {replyNotOurs, why}
  end
  local reply = c and index_reply(recordDone, c, tok, t)
  if not reply then
    return {recordNone, t[1], t[2]}
  end
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if not force and c.st == 'P' and tonumber(c.until_us) > now then
    reply[1] = recordRefused
    return reply
  end
  redis.call('SETRANGE', c.ck, c.at - 1, 'F')
  return reply
end
local _, hdr, st, tok, _, _, until_us = string.find(v, RECORD_LONG)
local mine
if hdr then
  mine = tok == token
else
  local tok36
  _, hdr, _, tok36 = string.find(v, RECORD_SHORT)
  if not hdr then
    return {replyNotOurs, 'unknown format'}
  end
  st, mine = 'C', tok36 == token36
end
local head = string.sub(v, 1, hdr)
if not mine then
  return {recordNone, t[1], t[2]}
end

local reply = record_reply(recordDone, key, v, head, t)
-- The checkpoints of a pending or released record.
if st == 'P' or st == 'R' then
  local cps = checkpoint_list(v, #head + 1)
  if cps == false then
    return {replyNotOurs, 'checkpoints unreadable'}
  end
  reply[8] = cps
end

if not force then
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if reply[8] or (st == 'P' and tonumber(until_us) > now) then
    reply[1] = recordRefused
    return reply
  end
end
redis.call('DEL', key)
return reply
