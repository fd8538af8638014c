-- complete.lua: store the result of a claimed record.
--
-- KEYS[1]  the record key
-- ARGV[1]  fencing token of the claim, in decimal
-- ARGV[2]  the same token in base 36 (lower case), as the completed record keeps it
-- ARGV[3]  retention in milliseconds
-- ARGV[4]  payload to keep
--
-- Returns
--   1            stored
--   2            already completed by this same token (a retried call, or a
--                second Complete of the claim): nothing is written, and the
--                record keeps what the first completion stored, for as long as
--                that one said
--   0            lease lost: the record is gone, released, or held by another token
--   {5, reason}  the value at the key is not a record of ours; nothing is written
--
-- The completed record is format.go's short form: it drops what only a
-- pending record needs (the lease end, the attempt id, the checkpoints) and
-- keeps its token in base 36 (claim.lua reads it, and the longer form). A
-- pending record whose lease ran out but that nobody has taken over still
-- belongs to its token: no other holder exists, so the result is accepted.
local key, token = KEYS[1], ARGV[1]

local v = redis.pcall('GET', key)
if not v then
  return transitionLost
end
if type(v) ~= 'string' then
  return {replyNotOurs, 'wrong type'}
end

-- The hot path: the pending record of this token.
local ptok, head, fp = string.match(v, RECORD_PENDING)
if ptok == token then
  redis.call('SET', key, record_completed(fp, ARGV[2], head, ARGV[4]), 'PX', ARGV[3])
  return transitionDone
end

-- A completed record of the short form: completed by this token (a retried
-- call) or by another.
local _, e, _, tok36 = string.find(v, RECORD_SHORT)
if e then
  if tok36 == ARGV[2] then
    return completeDoneBefore
  end
  return transitionLost
end

local _, _, st, tok = string.find(v, RECORD_LONG)
if not st then
  return {replyNotOurs, 'unknown format'}
end
if st == 'C' and tok == token then
  return completeDoneBefore
end
return transitionLost
