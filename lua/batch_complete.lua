-- batch_complete.lua: complete.lua for many records at once, one answer per record.
--
-- KEYS          the record keys
-- ARGV[3i-2]    fencing token of the claim of KEYS[i] (decimal)
-- ARGV[3i-1]    retention of KEYS[i] in milliseconds
-- ARGV[3i]      payload to keep for KEYS[i]
--
-- Returns an array whose i-th element answers KEYS[i] as complete.lua would,
-- without the braces: 1 stored (or already stored by this token), 0 lease
-- lost, or the reason the value at the key is not a record of ours.
--
-- The rules are those of complete.lua: the completed record drops the
-- checkpoints. Safe to run twice.
local function complete(key, token, keep, payload)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' then
    return 'wrong type'
  end
  if not v then
    return 0
  end
  -- head is TOKEN ":" ATTEMPT ":" RECOVERED ":", kept as it is.
  local st, head, fp = string.match(v, '^i1([PCR])(%d+:%d+:[01]:)%d+:[%w_%-]*:([%w_%-]*):')
  if not st then
    return 'unknown format'
  end
  if string.sub(head, 1, #token + 1) ~= token .. ':' then
    return 0
  end
  if st == 'C' then
    return 1
  end
  if st ~= 'P' then
    return 0
  end
  redis.call('SET', key, 'i1C' .. head .. '0::' .. fp .. ':' .. payload, 'PX', keep)
  return 1
end

local out = {}
for i = 1, #KEYS do
  out[i] = complete(KEYS[i], ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i])
end
return out
