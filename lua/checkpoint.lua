-- checkpoint.lua: record a recovery point in a pending record, under its claim's fence.
--
-- KEYS[1]  the record key
-- KEYS[2]  for a compact claim (see format.go, "The v3 layout"), its index
--          key (declared, not read: its entry stays, answered by the record
--          while it lives), and
-- KEYS[3]  its call record key; absent for a claim kept in a record
-- ARGV[1]  fencing token of the claim (decimal)
-- ARGV[2]  the checkpoint's name (bytes, not empty)
-- ARGV[3]  the checkpoint's value (bytes, may be empty)
-- ARGV[4]  how many checkpoints a record may hold
-- ARGV[5]  for a compact claim, its place in its call, else ''; then
--          ARGV[6] how long to keep the pending record it moves to, in
--          milliseconds
--
-- Returns
--   {1}          recorded (or already recorded by this same call: a retried call)
--   {0}          lease lost: the record is gone, released, completed, or held by another token
--   {5, reason}  the value at the key is not a record of ours; nothing is written
--   {6}          the record holds as many checkpoints as it may; nothing is written
--
-- The checkpoints follow the header of a pending record, in the order they were
-- recorded, each as LEN ":" NAME LEN ":" VALUE (LEN in decimal). A checkpoint
-- recorded again under its name replaces the earlier one and becomes the last.
-- Safe to run twice: the second run writes the same record again. The record's
-- time to live is kept.
--
-- A compact claim's first checkpoint moves it to a record of its own, as
-- a settle's move does, in the same call: its token, its attempt, the
-- call's lease end, call id and the fingerprint the call record keeps;
-- its place is marked M. The record is kept for ARGV[6] from then on. Every key it reads or writes is one of its keys:
-- on a Cluster whose slot migrates, it runs where they all are, or is
-- answered TRYAGAIN.
local key, token, name, value = KEYS[1], ARGV[1], ARGV[2], ARGV[3]

local v = redis.pcall('GET', key)
local ttl = 'KEEPTTL'
if not v and ARGV[5] and ARGV[5] ~= '' then
  local p, ck = tonumber(ARGV[5]), KEYS[3]
  local c, why = call_place(ck, p)
  if why then
    return {replyNotOurs, why}
  end
  if not c or c.st ~= 'P' then
    return {transitionLost}
  end
  v = record_head('P', token, c.cnt or '1', c.rec or '0', c.until_us, c.att, c.fp)
  redis.call('SETRANGE', ck, c.at - 1, 'M')
  ttl = nil
end
if type(v) == 'table' then
  return {replyNotOurs, 'wrong type'}
end
if not v then
  return {transitionLost}
end
local _, hdr, st, tok = string.find(v, RECORD_LONG)
if not st then
  -- A completed record of the short form (see complete.lua) is no claim's.
  if string.find(v, RECORD_SHORT) then
    return {transitionLost}
  end
  return {replyNotOurs, 'unknown format'}
end
if st ~= 'P' or tok ~= token then
  return {transitionLost}
end

local function field(pos)
  local len = string.match(v, CHECKPOINT_FIELD, pos)
  if not len or #len > 9 then
    return nil
  end
  local from = pos + #len + 1
  local to = from + tonumber(len) - 1
  if to > #v then
    return nil
  end
  return string.sub(v, from, to), to + 1
end

local kept, count, pos = {}, 1, hdr + 1
while pos <= #v do
  local n, at = field(pos)
  local val, after
  if n then
    val, after = field(at)
  end
  if not val then
    return {replyNotOurs, 'checkpoints unreadable'}
  end
  if n ~= name then
    kept[#kept + 1] = string.sub(v, pos, after - 1)
    count = count + 1
  end
  pos = after
end
if count > tonumber(ARGV[4]) then
  return {checkpointFull}
end
kept[#kept + 1] = checkpoint_pair(name, value)
if ttl then
  redis.call('SET', key, string.sub(v, 1, hdr) .. table.concat(kept), ttl)
else
  redis.call('SET', key, string.sub(v, 1, hdr) .. table.concat(kept), 'PX', ARGV[6])
end
return {transitionDone}
