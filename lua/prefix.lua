-- prefix.lua: read the record that says how a prefix is written (see
-- format.lua's prefix_record), and write it where there is none yet.
--
-- KEYS[1]  the prefix's record key (prefix .. 'layout')
-- KEYS[2]  on one server, the index key of the layouts before v3 (prefix
--          .. 'i:0'); absent on a Cluster, whose index keys are in other
--          slots
-- ARGV[1]  the scope shards of a Keeper that is to write under the prefix
--          (decimal); '' for one that only reads
-- ARGV[2]  the layout the Keeper reads and writes
--
-- Returns the record as it was found, or as this call wrote it; nil when
-- there is none and ARGV[1] is ''; or, when there is none and KEYS[2]
-- holds an index (written by a version of idem before v3, which this one
-- does not read), the error "IDEMLAYOUT " and what its field "" holds,
-- before anything is written. Two Keepers that race to write the record
-- agree: the first writes it, the second reads it. Safe to run again: a
-- call that wrote the record finds it the next time.
local rec = redis.call('GET', KEYS[1])
if rec then
  return rec
end
if KEYS[2] then
  local st = redis.call('HGET', KEYS[2], '')
  if st then
    return redis.error_reply('IDEMLAYOUT ' .. st)
  end
end
if ARGV[1] == '' then
  return rec
end
rec = prefix_record(ARGV[2], ARGV[1])
redis.call('SET', KEYS[1], rec)
return rec
