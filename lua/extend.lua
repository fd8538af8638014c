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
local r = record_extend(KEYS[1], ARGV[1], ARGV[2], ARGV[3], index_now)
if type(r) == 'string' then
  return {replyNotOurs, r}
end
return r
