-- batch_release.lua: release.lua for many records at once, one answer per record.
--
-- KEYS       the record keys
-- ARGV[1]    how long to keep a released marker, in milliseconds
-- ARGV[1+i]  fencing token of the claim of KEYS[i] (decimal)
--
-- Returns an array whose i-th element answers KEYS[i] as release.lua would,
-- without the braces: 1 released (or already released by this token), 0 lease
-- lost, or the reason the value at the key is not a record of ours.
--
-- The rules are those of release.lua: a record that holds checkpoints keeps
-- them, and its fingerprint, with the pending record's time to live. Safe to
-- run twice.
local function release(key, token)
  local v = redis.pcall('GET', key)
  if not v then
    return transitionLost
  end
  if type(v) ~= 'string' then
    return 'wrong type'
  end
  local _, hdr, st, tok, cnt, _, _, _, fp = string.find(v, RECORD_LONG)
  if not st then
    -- A completed record of the short form (see complete.lua) is no claim's.
    if string.find(v, RECORD_SHORT) then
      return transitionLost
    end
    return 'unknown format'
  end
  if tok ~= token then
    return transitionLost
  end
  if st == 'R' then
    return transitionDone
  end
  if st ~= 'P' then
    return transitionLost
  end
  if hdr < #v then
    redis.call('SET', key, record_head('R', tok, cnt, '0', '0', '', fp) .. string.sub(v, hdr + 1), 'KEEPTTL')
  else
    redis.call('SET', key, record_head('R', tok, cnt, '0', '0', '', ''), 'PX', ARGV[1])
  end
  return transitionDone
end

local out = {}
for i = 1, #KEYS do
  out[i] = release(KEYS[i], ARGV[1 + i])
end
return out
