-- compact_settle.lua: complete or release compact claims of one call (see
-- compact_claim.lua), in one write of its call record. format.lua and
-- lib.lua go before it.
--
-- KEYS[1]    the call record key
-- KEYS[2]    the index key of the claims' entries: completing keeps it at
--            least as long as the call record
-- ARGV[1]    a record key of the call's claims, not read: what a client
--            that places keys by hashing them (a Ring) sends the call by
-- ARGV[2]    'C' to complete (nothing to keep but the fact: a marker), 'R'
--            to release
-- ARGV[3]    completing: the call record is kept for at least this long from
--            now, in milliseconds (the longer of the retention and the
--            marker retention)
-- ARGV[4]    the places in the call of the claims, two bytes each, big-endian
-- ARGV[5]    completing: when the retention of the results ends, in
--            microseconds of Redis's clock, or 0 for ARGV[3] from now: the
--            markers answer as empty results until then (the call record
--            keeps the latest its completions asked for)
--
-- Returns an array whose j-th element answers the j-th claim: 1 done, 2 done
-- before by this call (completed or released already: a retried call), 3
-- moved to a record of its own (by a checkpoint, a completion with a value,
-- or Abandon: the record answers, by the claim's token), 0 lease lost (the
-- place is no longer held by the call: taken over, forgotten), or the reason
-- the call record is not one of ours (nothing is written then).
--
-- The call record alone answers for its claims: whatever takes a place over
-- (a claim after its lease ran out or after a release, Forget, Abandon)
-- marks the place in the call record as it does. One read and one write for
-- the whole call. Safe to run twice.
--
-- The two keys it reads and writes are its keys, and no record key (a
-- compact claim has none): on a Cluster whose slot migrates, it runs where
-- both are, or is answered TRYAGAIN.
local ck, ikey, target, places_s = KEYS[1], KEYS[2], ARGV[2], ARGV[4]
local k = #places_s / 2

local out = {}
local function all(x)
  for j = 1, k do
    out[j] = x
  end
  return out
end
local v = redis.pcall('GET', ck)
if type(v) == 'table' then
  return all('wrong type')
end
if not v then
  return all(transitionLost)
end
local u, done, runtil, att, fpw, e, places = call_header(v)
if not u then
  return all('unknown format')
end
local at = e + 1

local st = {string.byte(v, at, at + places - 1)}
local want, changed = string.byte(target), false
for j = 1, k do
  local hi, lo = string.byte(places_s, 2 * j - 1, 2 * j)
  local p = hi * 256 + lo
  local s = st[p]
  if s == 80 then -- 'P'
    st[p], out[j], changed = want, transitionDone, true
  elseif s == want then
    out[j] = compactSettleDoneBefore
  elseif s == 77 then -- 'M'
    out[j] = compactSettleMoved
  else
    out[j] = transitionLost
  end
end

if changed then
  if target == 'C' then
    local now = index_now()
    local asked = tonumber(ARGV[5])
    if asked <= 0 then
      asked = now + tonumber(ARGV[3]) * 1000
    end
    done, runtil = string.format('%d', now), string.format('%d', math.max(asked, tonumber(runtil)))
  end
  local keep = redis.call('PTTL', ck)
  if target == 'C' and keep < tonumber(ARGV[3]) then
    keep = tonumber(ARGV[3])
  end
  -- A release in the call record's last millisecond keeps it for that
  -- millisecond: PX takes no 0.
  keep = math.max(keep, 1)
  redis.call('SET', ck, call_head(u, done, runtil, att, fpw) .. string.char(unpack(st)) .. string.sub(v, at + places),
    'PX', keep)
  -- The markers last as long as their call record: so must their entries.
  if target == 'C' and redis.call('PTTL', ikey) < tonumber(keep) then
    redis.call('PEXPIRE', ikey, keep)
  end
end
return out
