-- release.lua: give up a claim so that the next claim runs the operation again.
--
-- KEYS[1]  the record key
-- ARGV[1]  fencing token of the claim (decimal)
-- ARGV[2]  how long to keep the released marker, in milliseconds
--
-- Returns
--   1            released (or already released by this same token: a retried call)
--   0            lease lost: the record is gone, completed, or held by another token
--   {5, reason}  the value at the key is not a record of ours; nothing is written
--
-- The released marker keeps the token and the attempt count, so the next claim
-- gets a higher token and the next attempt number. A record that holds
-- checkpoints keeps them, and its fingerprint, for as long as the pending record
-- would have been kept: the steps they record have happened, so the next claim
-- of the same request continues from them.
local key, token = KEYS[1], ARGV[1]

local v = redis.pcall('GET', key)
if not v then
  return transitionLost
end
if type(v) ~= 'string' then
  return {replyNotOurs, 'wrong type'}
end
local _, hdr, st, tok, cnt, _, _, _, fp = string.find(v, RECORD_LONG)
if not st then
  -- A completed record of the short form (see complete.lua) is no claim's.
  if string.find(v, RECORD_SHORT) then
    return transitionLost
  end
  return {replyNotOurs, 'unknown format'}
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
  return transitionDone
end
redis.call('SET', key, record_head('R', tok, cnt, '0', '0', '', ''), 'PX', ARGV[2])
return transitionDone
