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
    return 0
  end
  if type(v) ~= 'string' then
    return 'wrong type'
  end
  local _, hdr, st, tok, cnt, fp =
    string.find(v, '^i1([PCR])(%d+):(%d+):[01]:%d+:[%w_%-]*:([%w_%-]*):')
  if not st then
    -- A completed record of the short form (see complete.lua) is no claim's.
    if string.find(v, '^i1C:[%w_%-]*:[%da-z]+:%d+:[01]:') then
      return 0
    end
    return 'unknown format'
  end
  if tok ~= token then
    return 0
  end
  if st == 'R' then
    return 1
  end
  if st ~= 'P' then
    return 0
  end
  if hdr < #v then
    redis.call('SET', key, 'i1R' .. tok .. ':' .. cnt .. ':0:0::' .. fp .. ':' .. string.sub(v, hdr + 1), 'KEEPTTL')
  else
    redis.call('SET', key, 'i1R' .. tok .. ':' .. cnt .. ':0:0:::', 'PX', ARGV[1])
  end
  return 1
end

local out = {}
for i = 1, #KEYS do
  out[i] = release(KEYS[i], ARGV[1 + i])
end
return out
