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
local now
local function clock()
  if not now then
    now = index_now()
  end
  return now
end

local out = {}
for i = 1, #KEYS do
  out[i] = record_extend(KEYS[i], ARGV[2 + i], ARGV[1], ARGV[2], clock)
end
return out
