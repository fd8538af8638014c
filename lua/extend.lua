-- extend.lua: renew the lease of a claim that is still running.
--
-- KEYS[1]  the record key
-- ARGV[1]  fencing token of the claim (decimal)
-- ARGV[2]  new lease from now, in milliseconds
-- ARGV[3]  time to keep the pending record, in milliseconds (>= lease)
--
-- Returns
--   1              extended: the lease now ends ARGV[2] from Redis's clock
--   0              lease lost: the record is gone, released, completed, or held by another token
--   {5, reason}    the value at the key is not a record of ours; nothing is written
--
-- Safe to run twice: the second run only moves the lease end a little later.
-- The record's checkpoints (after the header) are kept as they are.
local key, token = KEYS[1], ARGV[1]

local v = redis.pcall('GET', key)
if not v then
  return transitionLost
end
if type(v) ~= 'string' then
  return {replyNotOurs, 'wrong type'}
end
local _, hdr, st, tok, cnt, rec, _, att, fp = string.find(v, RECORD_LONG)
if not st then
  -- A completed record of the short form (see complete.lua) is no claim's.
  if string.find(v, RECORD_SHORT) then
    return transitionLost
  end
  return {replyNotOurs, 'unknown format'}
end
if st ~= 'P' or tok ~= token then
  return transitionLost
end
local t = redis.call('TIME')
redis.call('SET', key,
  record_head('P', tok, cnt, rec, string.format('%d', t[1] * 1000000 + t[2] + ARGV[2] * 1000), att, fp) ..
  string.sub(v, hdr + 1),
  'PX', ARGV[3])
return transitionDone
