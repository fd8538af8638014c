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
    return 0
  end
  if type(v) ~= 'string' then
    return 'wrong type'
  end
  if string.sub(v, 1, #token + 4) == 'i1P' .. token .. ':' then
    -- head is ATTEMPT ":" RECOVERED ":", kept as it is.
    local head, fp = string.match(v, '^(%d+:[01]:)%d+:[%w_%-]*:([%w_%-]*):', #token + 5)
    if head then
      redis.call('SET', key, 'i1C:' .. fp .. ':' .. token36 .. ':' .. head .. payload, 'PX', keep)
      return 1
    end
    return 'unknown format'
  end
  local tok36 = string.match(v, '^i1C:[%w_%-]*:([%da-z]+):%d+:[01]:')
  if tok36 then
    if tok36 == token36 then
      return 1
    end
    return 0
  end
  local st, tok = string.match(v, '^i1([PCR])(%d+):%d+:[01]:%d+:[%w_%-]*:[%w_%-]*:')
  if not st then
    return 'unknown format'
  end
  if st == 'C' and tok == token then
    return 1
  end
  return 0
end

local out = {}
for i = 1, #KEYS do
  out[i] = complete(KEYS[i], ARGV[4 * i - 3], ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i])
end
return out
