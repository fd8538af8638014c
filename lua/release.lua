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
local r = record_release(KEYS[1], ARGV[1], ARGV[2])
if type(r) == 'string' then
  return {replyNotOurs, r}
end
return r
