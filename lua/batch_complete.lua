-- batch_complete.lua: complete.lua for many records at once, one answer per record.
--
-- KEYS          the record keys
-- ARGV[4i-3]    fencing token of the claim of KEYS[i], in decimal
-- ARGV[4i-2]    the same token in base 36 (lower case)
-- ARGV[4i-1]    retention of KEYS[i] in milliseconds
-- ARGV[4i]      payload to keep for KEYS[i]
--
-- Returns an array whose i-th element answers KEYS[i] as complete.lua would,
-- without the braces: 1 stored (or already stored by this token), 0 lease
-- lost, or the reason the value at the key is not a record of ours.
--
-- The rules and the completed record are those of complete.lua: the
-- completed record drops the checkpoints. Safe to run twice.
local function complete(key, token, token36, keep, payload)
  local v = redis.pcall('GET', key)
  if not v then
    return transitionLost
  end
  if type(v) ~= 'string' then
    return 'wrong type'
  end
  -- head is ATTEMPT ":" RECOVERED ":", kept as it is.
  local ptok, head, fp = string.match(v, RECORD_PENDING)
  if ptok == token then
    redis.call('SET', key, record_completed(fp, token36, head, payload), 'PX', keep)
    return transitionDone
  end
  local _, e, _, tok36 = string.find(v, RECORD_SHORT)
  if e then
    if tok36 == token36 then
      return transitionDone
    end
    return transitionLost
  end
  local _, _, st, tok = string.find(v, RECORD_LONG)
  if not st then
    return 'unknown format'
  end
  if st == 'C' and tok == token then
    return transitionDone
  end
  return transitionLost
end

local out = {}
for i = 1, #KEYS do
  out[i] = complete(KEYS[i], ARGV[4 * i - 3], ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i])
end
return out
