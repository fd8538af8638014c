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
local out = {}
for i = 1, #KEYS do
  out[i] = record_release(KEYS[i], ARGV[1 + i], ARGV[1])
end
return out
