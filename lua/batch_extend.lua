-- batch_extend.lua: extend.lua for many records at once, one answer per record.
--
-- KEYS       the record keys
-- ARGV[1]    new lease from now, in milliseconds
-- ARGV[2]    time to keep a pending record, in milliseconds (>= lease)
-- ARGV[2+i]  fencing token of the claim of KEYS[i] (decimal)
--
-- Returns an array whose i-th element answers KEYS[i]: 1 extended, 0 lease
-- lost, or the reason the value at the key is not a record of ours.
--
-- The rules are those of extend.lua; the checkpoints are kept. Redis's clock is
-- read once. Safe to run twice.
local lease, keep = tonumber(ARGV[1]), ARGV[2]
local now

local function extend(key, token)
  local v = redis.pcall('GET', key)
  if not v then
    return transitionLost
  end
  if type(v) ~= 'string' then
    return 'wrong type'
  end
  local _, hdr, st, tok, cnt, rec, _, att, fp = string.find(v, RECORD_LONG)
  if not st then
    -- A completed record of the short form (see complete.lua) is no claim's.
    if string.find(v, RECORD_SHORT) then
      return transitionLost
    end
    return 'unknown format'
  end
  if st ~= 'P' or tok ~= token then
    return transitionLost
  end
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  redis.call('SET', key,
    record_head('P', tok, cnt, rec, string.format('%d', now + lease * 1000), att, fp) .. string.sub(v, hdr + 1),
    'PX', keep)
  return transitionDone
end

local out = {}
for i = 1, #KEYS do
  out[i] = extend(KEYS[i], ARGV[2 + i])
end
return out
