-- complete.lua: store the result of a claimed record.
--
-- KEYS[1]  the record key
-- ARGV[1]  fencing token of the claim (decimal)
-- ARGV[2]  payload to keep
-- ARGV[3]  retention in milliseconds
--
-- Returns
--   {1}          stored (or already stored by this same token: a retried call)
--   {0}          lease lost: the record is gone, released, or held by another token
--   {5, reason}  the value at the key is not a record of ours; nothing is written
--
-- A pending record whose lease ran out but that nobody has taken over still
-- belongs to its token: no other holder exists, so the result is accepted.
local key, token = KEYS[1], ARGV[1]

local v = redis.pcall('GET', key)
if type(v) == 'table' then
  return {5, 'wrong type'}
end
if not v then
  return {0}
end
local st, tok, cnt, rec, fp =
  string.match(v, '^i1([PCR])(%d+):(%d+):([01]):%d+:[%w_%-]*:([%w_%-]*):')
if not st then
  return {5, 'unknown format'}
end
if tok ~= token then
  return {0}
end
if st == 'C' then
  return {1}
end
if st ~= 'P' then
  return {0}
end
redis.call('SET', key,
  'i1C' .. tok .. ':' .. cnt .. ':' .. rec .. ':0::' .. fp .. ':' .. ARGV[2],
  'PX', ARGV[3])
return {1}
