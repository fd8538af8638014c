-- abandon.lua: end the lease of a pending claim, named by its fencing token,
-- and keep its record, so that the next claim takes it over at once, told it
-- is recovered, with the attempt count and the checkpoints.
--
-- KEYS[1]  the record key
-- ARGV[1]  the fencing token of the claim whose lease ends (decimal)
-- KEYS[2]  the index key of the record's entry, and ARGV[2] and ARGV[3] its
--          digest's first 8 bytes and the start of the call record keys
--          (see lib.lua): when the key holds no record, a
--          compact claim of the token there is moved to a pending record of
--          its own whose lease has ended (the call's other claims keep their
--          shared lease), its place marked M and its entry taken out of the
--          index
-- KEYS[3]  a call record key: that of the token (the start of the call
--          record keys and ARGV[1]), or the one an earlier run named ({10})
--
-- Returns one of
--   {0, now_s, now_us}         no record at the key, and no compact claim or
--                              marker: nothing done
--   {1, header, pttl_ms, rest_len, rest_head, now_s, now_us[, checkpoints]}
--                              the pending record of the token, its lease ended now
--                              (or before: it had run out), as it is now
--   {2, header, pttl_ms, rest_len, rest_head, now_s, now_us[, checkpoints]}
--                              nothing done: the record is completed, released, or
--                              of another token (a newer claim); as it is
--   {5, reason}                the value is not a record of ours; nothing done
--   {10, token}                no record at the key, and its entry in the index is
--                              held by the call of token, whose call record key is
--                              not KEYS[3]: nothing done; ask again with it as
--                              KEYS[3]
-- A compact claim or marker left as it is (code 2) is answered in the form of
-- lib.lua's index_reply (9 elements); one moved is a record (code 1).
--
-- The record is described as inspect.lua describes it. Only the lease end
-- changes: to Redis's clock now, so that a claim finds the lease run out
-- (claim.lua takes it over, recovered); the token, attempt count, attempt id,
-- fingerprint, checkpoints and the record's time to live are kept. Safe to
-- run twice for one call: the second run finds the lease already ended and
-- answers {1} without writing, or finds the newer claim made since and
-- answers {2} without touching it. Every key it reads or writes is one of
-- its keys (hence {10}): on a Cluster whose slot migrates, it runs where
-- they all are, or is answered TRYAGAIN.
local key, token = KEYS[1], ARGV[1]
local ikey, ix = KEYS[2], {ARGV[2], ARGV[3]}

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
  if not tok then
    return {recordNone, t[1], t[2]}
  end
  if KEYS[3] ~= index_callkey(ix) then
    return {replyAskAgain, tonumber(tok)}
  end
  local c, why = index_claim(ix, place)
  if why then
    return {replyNotOurs, why}
  end
  if not c or not index_reply(recordUnchanged, c, tok, t) then
    return {recordNone, t[1], t[2]}
  end
  if c.st ~= 'P' or tok ~= token then
    return index_reply(recordUnchanged, c, tok, t)
  end
  -- The claim moves to a record of its own, its lease ended now, kept as
  -- long as its call record (a day if that has no expiry, which idem never
  -- leaves).
  local now = string.format('%d', tonumber(t[1]) * 1000000 + tonumber(t[2]))
  if tonumber(c.until_us) < tonumber(now) then
    now = c.until_us
  end
  local head = record_head('P', tok, c.cnt or '1', c.rec or '0', now, c.att, c.fp)
  local keep = redis.call('PTTL', c.ck)
  if keep <= 0 then
    keep = 86400000
  end
  redis.call('SET', key, head, 'PX', keep)
  redis.call('SETRANGE', c.ck, c.at - 1, 'M')
  return {recordDone, head, redis.call('PTTL', key), 0, '', t[1], t[2]}
end
local _, hdr, st, tok, cnt, rec, until_us, att, fp = string.find(v, RECORD_LONG)
if not hdr then
  _, hdr = string.find(v, RECORD_SHORT)
  if not hdr then
    return {replyNotOurs, 'unknown format'}
  end
  st = 'C'
end
local head = string.sub(v, 1, hdr)

-- The checkpoints of a pending or released record, read before anything is
-- written.
local cps
if st == 'P' or st == 'R' then
  cps = checkpoint_list(v, #head + 1)
  if cps == false then
    return {replyNotOurs, 'checkpoints unreadable'}
  end
end

local code = recordUnchanged
if st == 'P' and tok == token then
  if #until_us > 16 then
    return {replyNotOurs, 'lease end out of range'}
  end
  code = recordDone
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if tonumber(until_us) > now then
    local ended = record_head('P', tok, cnt, rec, string.format('%d', now), att, fp)
    v = ended .. string.sub(v, #head + 1)
    head = ended
    redis.call('SET', key, v, 'KEEPTTL')
  end
end
local reply = record_reply(code, key, v, head, t)
reply[8] = cps
return reply
