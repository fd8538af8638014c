-- inspect.lua: read a record without changing it.
--
-- KEYS[1]  the record key
-- KEYS[2]  the index key of its entry, and ARGV[1] and ARGV[2] its digest's
--          first 8 bytes and the start of the call record keys (see
--          lib.lua); without them the index is not read
-- KEYS[3]  the call record key of the record's entry, when the caller
--          knows it (it asked before and was answered {10}), or absent
--
-- Returns one of
--   {0, now_s, now_us}                            no record at the key, and no
--                                                 compact claim or marker
--   {1, header, pttl_ms, rest_len, rest_head, now_s, now_us}
--   {1, header, pttl_ms, rest_len, rest_head, now_s, now_us, checkpoints}
--                                                 a record: its header, up to and
--                                                 including the ':' that ends it
--                                                 (the one after the fingerprint;
--                                                 after the recovered flag in a
--                                                 completed record's short form,
--                                                 see complete.lua); the key's
--                                                 PTTL; the length of what follows
--                                                 the header and its first two
--                                                 bytes (the envelope's format and
--                                                 kind byte of a completed record);
--                                                 for a pending or released record
--                                                 that holds checkpoints, their
--                                                 names and value sizes, oldest
--                                                 first: {name, size, name, size, ...}
--                                                 (left out when what follows the
--                                                 header is not checkpoints)
--   {6, header, pttl_ms, rest_len, rest_head, now_s, now_us, 0, done_us}
--                                                 no record at the key, but a
--                                                 compact claim or a marker in the
--                                                 index (see lib.lua's
--                                                 index_reply)
--   {5, reason}                                   the value is not a record of ours
--   {10, token}                                   no record at the key; its entry
--                                                 in the index is held by the call
--                                                 of token, whose call record key
--                                                 is not KEYS[3]: ask again with
--                                                 it as KEYS[3]
--
-- now_s and now_us are Redis's TIME, so that the caller measures the lease and
-- the token's age by Redis's clock. The header is matched loosely here and
-- parsed strictly by the caller. Only the header, two bytes and the
-- checkpoints' names travel back, however large the stored result or the
-- checkpoints' values. Read-only: safe to run any number of times. Every
-- key it reads is one of its keys (hence {10}): on a Cluster whose slot
-- migrates, it runs where they all are, or is answered TRYAGAIN.
local key, ikey, ix = KEYS[1], KEYS[2], {ARGV[1], ARGV[2]}

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
  if tok then
    if KEYS[3] ~= index_callkey(ix) then
      return {replyAskAgain, tonumber(tok)}
    end
    local c, why = index_claim(ix, place)
    if why then
      return {replyNotOurs, why}
    end
    local reply = c and index_reply(recordCompact, c, tok, t)
    if reply then
      return reply
    end
  end
  return {recordNone, t[1], t[2]}
end
local _, hdr = string.find(v, RECORD_LONG)
if not hdr then
  _, hdr = string.find(v, RECORD_SHORT)
end
if not hdr then
  return {replyNotOurs, 'unknown format'}
end
local head = string.sub(v, 1, hdr)
local reply = record_reply(recordDone, key, v, head, t)
-- The checkpoints of a pending or released record. What cannot be read as
-- checkpoints (written by a later version, say) is left out, and left to the
-- caller's other scripts.
local st = string.sub(head, 3, 3)
if st == 'P' or st == 'R' then
  reply[8] = checkpoint_list(v, #head + 1) or nil
end
return reply
