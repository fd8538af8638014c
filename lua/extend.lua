-- extend.lua: renew the lease of a claim that is still running.
--
-- KEYS[1]  the record key
-- ARGV[1]  fencing token of the claim (decimal)
-- ARGV[2]  new lease from now, in milliseconds
-- ARGV[3]  time to keep the pending record, in milliseconds (>= lease)
--
-- Returns
--   {1, lease_ms}  extended: the lease now ends lease_ms from Redis's clock
--   {0}            lease lost: the record is gone, released, completed, or held by another token
--   {5, reason}    the value at the key is not a record of ours; nothing is written
--
-- Safe to run twice: the second run only moves the lease end a little later.
-- The record's checkpoints (after the header) are kept as they are.
local key, token = KEYS[1], ARGV[1]

local v = redis.pcall('GET', key)
if type(v) == 'table' then
  return {5, 'wrong type'}
end
if not v then
  return {0}
end
local _, hdr, st, tok, cnt, rec, att, fp =
  string.find(v, '^i1([PCR])(%d+):(%d+):([01]):%d+:([%w_%-]*):([%w_%-]*):')
if not st then
  return {5, 'unknown format'}
end
if st ~= 'P' or tok ~= token then
  return {0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('SET', key,
  'i1P' .. tok .. ':' .. cnt .. ':' .. rec .. ':' ..
  string.format('%d', now + tonumber(ARGV[2]) * 1000) .. ':' .. att .. ':' .. fp .. ':' .. string.sub(v, hdr + 1),
  'PX', ARGV[3])
return {1, tonumber(ARGV[2])}
