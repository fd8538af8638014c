-- forget.lua: remove a record, unless another attempt holds a live lease on
-- it and the caller did not force it.
--
-- KEYS[1]  the record key
-- ARGV[1]  "force" to remove a pending record whose lease is still live;
--          anything else refuses it
--
-- Returns one of
--   {0, now_s, now_us}                             no record at the key: nothing done
--   {1, header, pttl_ms, rest_len, rest_head, now_s, now_us}
--                                                  removed: the record as it was
--   {3, header, pttl_ms, rest_len, rest_head, now_s, now_us}
--                                                  refused: the record is pending and
--                                                  its lease is live; nothing done
--   {5, reason}                                    the value is not a record of ours;
--                                                  nothing done, even when forced
--
-- The record is described as inspect.lua describes it. Safe to run twice for
-- one call (go-redis retries a command whose reply was lost): the second run
-- finds no record and answers {0}, or finds the same live lease and refuses
-- again.
local key, force = KEYS[1], ARGV[1] == 'force'

local v = redis.pcall('GET', key)
if type(v) == 'table' then
  return {5, 'wrong type'}
end
local t = redis.call('TIME')
if not v then
  return {0, t[1], t[2]}
end
local head = string.match(v, '^i1[PCR]%d+:%d+:[01]:%d+:[%w_%-]*:[%w_%-]*:') or
  string.match(v, '^i1C:[%w_%-]*:[%da-z]+:%d+:[01]:')
if not head then
  return {5, 'unknown format'}
end
-- Only a pending record, always of the long form, has a lease to refuse for.
local st, until_us = string.match(head, '^i1([PCR])%d+:%d+:[01]:(%d+):')
local code = 1
if st == 'P' and not force then
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if tonumber(until_us) > now then
    code = 3
  end
end
local reply = {code, head, redis.call('PTTL', key), #v - #head, string.sub(v, #head + 1, #head + 2), t[1], t[2]}
if code == 1 then
  redis.call('DEL', key)
end
return reply
