-- v3_settle.lua: complete, release or renew claims of one v3 call (see
-- v3_claim.lua) in one read and one write of its call record. format.lua
-- goes before it; it defines no function.
--
-- KEYS[1]  the call record key
-- KEYS[2]  the v3 index key: completing or renewing keeps it at least as
--          long as the call record
-- ARGV[1]  'C' to complete (a marker), 'R' to release, 'E' to renew the
--          call's lease
-- ARGV[2]  completing or renewing: keep the call record at least this long
--          from now, ms (completing: the longest its markers answer)
-- ARGV[3]  completing: when the results' retention ends, µs of Redis's
--          clock, or 0 for ARGV[2] from now; renewing: the lease from now,
--          ms
-- ARGV[4]  the places of the claims, two bytes each, big-endian
-- 'M' completes each claim with a value of its own, moving it to a record
-- of its own (the short completed form, as complete.lua writes it, with the
-- fingerprint and attempt its place holds), and marks its place M:
-- KEYS[2+j] the j-th claim's record key, ARGV[5] the call's token in base
-- 36, ARGV[4+2j] the record's keep in ms and ARGV[5+2j] its value. A place
-- already M whose completed record holds the call's token was moved by an
-- earlier run (done before); one whose record is pending with the call's
-- token was moved by a checkpoint (3: the completion goes to the record).
--
-- Completing, releasing or renewing returns {STATES}, the call's place
-- states before (a byte a place, format.go): the caller reads each claim's
-- answer at its place (P: done, and a renewal renews the call's lease;
-- the target state: done before, by this call sent again; M moved to a
-- record of its own; else lease lost: taken over after its lease ran out,
-- forgotten). Moving returns an array whose j-th element answers the j-th
-- claim: 1 done, 2 done before by this call, 3 moved (to its record), 4
-- completed already as a marker (the first result stays), 0 lease lost. {0}: the call record is gone (every claim lost); {0, why}:
-- the key holds no call record of ours (nothing written). The claims of a call share one lease:
-- renewing any renews every place the call still holds. Safe to run twice.
local ck, ikey, mode, places = KEYS[1], KEYS[2], ARGV[1], ARGV[4]
local v = redis.pcall('GET', ck)
if type(v) == 'table' then
  return {transitionLost, 'wrong type'}
elseif not v then
  return {transitionLost}
elseif string.sub(v, 1, 3) ~= V3_CALL_TAG or #v < v3CallHeadSize then
  return {transitionLost, 'unknown format'}
end
local byte, sub, char = string.byte, string.sub, string.char
local np = (#v - v3CallHeadSize) / (1 + byte(v, v3CallAWAt) + byte(v, v3CallFPWAt))
if np % 1 ~= 0 then
  return {transitionLost, 'unknown format'}
end
local k = #places / 2
local st = {byte(v, v3CallHeadSize + 1, v3CallHeadSize + np)}
local changed = false
if mode == 'M' then
  local out = {}
  local aw, fpw = byte(v, v3CallAWAt), byte(v, v3CallFPWAt)
  local tok36 = ARGV[5]
  for j = 1, k do
    local hi, lo = byte(places, 2 * j - 1, 2 * j)
    local p = hi * 256 + lo
    local s = st[p]
    if s == v3Held then
      local att, rec = 1, '0'
      if aw == v3AttemptSize then
        local a1, a2 = byte(v, v3CallHeadSize + np + (p - 1) * aw + 1, v3CallHeadSize + np + p * aw)
        att = a1 * 256 + a2
        if att >= v3RecoveredBit then
          att, rec = att - v3RecoveredBit, '1'
        end
      end
      local fo = v3CallHeadSize + np * (1 + aw) + (p - 1) * fpw
      local fp = string.match(sub(v, fo + 1, fo + fpw), '^(.-)%.*$')
      redis.call('SET', KEYS[2 + j], RECORD_SHORT_START .. fp .. ':' .. tok36 .. ':' .. att .. ':' .. rec .. ':' .. ARGV[5 + 2 * j],
        'PX', ARGV[4 + 2 * j])
      st[p], out[j], changed = v3Moved, transitionDone, true
    elseif s == v3Completed then
      -- Completed as a marker already (a completion sent again): the
      -- first result stays.
      out[j] = compactMoveCompleted
    elseif s == v3Moved then
      -- Completed by an earlier run of this call (the short form holds
      -- its token in base 36), or moved by a checkpoint (pending, its
      -- token in decimal): the completion goes to that record.
      local rv = redis.call('GET', KEYS[2 + j]) or ''
      if string.match(rv, RECORD_TOKEN36) == tok36 then
        out[j] = compactSettleDoneBefore
      elseif string.match(rv, RECORD_TOKEN) == string.format('%d', tonumber(tok36, 36)) then
        out[j] = compactSettleMoved
      else
        out[j] = transitionLost
      end
    else
      out[j] = transitionLost
    end
  end
  if changed then
    redis.call('SET', ck, sub(v, 1, v3CallHeadSize) .. char(unpack(st)) .. sub(v, v3CallHeadSize + np + 1), 'KEEPTTL')
  end
  return out
end
local before = sub(v, v3CallHeadSize + 1, v3CallHeadSize + np)
local want = byte(mode)
local pb = {byte(places, 1, 2 * k)}
for j = 1, 2 * k, 2 do
  local p = pb[j] * 256 + pb[j + 1]
  if st[p] == v3Held then
    changed = true
    if mode ~= 'E' then
      st[p] = want
    end
  end
end
if not changed then
  return {before}
end
local body = char(unpack(st)) .. sub(v, v3CallHeadSize + np + 1)
if mode == 'R' then
  -- A release keeps the header and the time to live as they are: no clock.
  redis.call('SET', ck, sub(v, 1, v3CallHeadSize) .. body, 'KEEPTTL')
  return {before}
end
local tm = redis.call('TIME')
local now = tm[1] * 1000000 + tm[2]
local keep = tonumber(ARGV[2])
local head
-- The header's times, 7 bytes big-endian each, read and written through
-- locals (a table costs more in Lua than the arithmetic).
local t1, t2, t3, t4, t5, t6, t7 = byte(v, v3CallUntilAt, v3CallUntilAt + v3TimeSize - 1)
local untl = (((((t1 * 256 + t2) * 256 + t3) * 256 + t4) * 256 + t5) * 256 + t6) * 256 + t7
if mode == 'C' then
  local asked = tonumber(ARGV[3])
  if asked <= 0 then
    asked = now + keep * 1000
  end
  t1, t2, t3, t4, t5, t6, t7 = byte(v, v3CallResultUntilAt, v3CallResultUntilAt + v3TimeSize - 1)
  local r = math.max(asked, (((((t1 * 256 + t2) * 256 + t3) * 256 + t4) * 256 + t5) * 256 + t6) * 256 + t7)
  local d = now
  local d7, r7 = d % 256, r % 256
  d, r = (d - d7) / 256, (r - r7) / 256
  local d6, r6 = d % 256, r % 256
  d, r = (d - d6) / 256, (r - r6) / 256
  local d5, r5 = d % 256, r % 256
  d, r = (d - d5) / 256, (r - r5) / 256
  local d4, r4 = d % 256, r % 256
  d, r = (d - d4) / 256, (r - r4) / 256
  local d3, r3 = d % 256, r % 256
  d, r = (d - d3) / 256, (r - r3) / 256
  local d2, r2 = d % 256, r % 256
  d, r = (d - d2) / 256, (r - r2) / 256
  head = sub(v, 1, v3CallDoneAt - 1) .. char(d, d2, d3, d4, d5, d6, d7, r, r2, r3, r4, r5, r6, r7) ..
    sub(v, v3CallIDAt, v3CallHeadSize)
  keep = math.max(keep, math.ceil((untl - now) / 1000) + keep)
elseif mode == 'E' then
  untl = now + tonumber(ARGV[3]) * 1000
  local u = untl
  local u7 = u % 256
  u = (u - u7) / 256
  local u6 = u % 256
  u = (u - u6) / 256
  local u5 = u % 256
  u = (u - u5) / 256
  local u4 = u % 256
  u = (u - u4) / 256
  local u3 = u % 256
  u = (u - u3) / 256
  local u2 = u % 256
  head = V3_CALL_TAG .. char((u - u2) / 256, u2, u3, u4, u5, u6, u7) .. sub(v, v3CallDoneAt, v3CallHeadSize)
  keep = math.max(keep, redis.call('PTTL', ck))
else
  return redis.error_reply('IDEMMODE ' .. mode)
end
redis.call('SET', ck, head .. body, 'PX', keep)
if redis.call('PTTL', ikey) < keep then
  redis.call('PEXPIRE', ikey, keep)
end
return {before}
