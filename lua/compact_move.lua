-- compact_move.lua: renew the compact claims of one call (see
-- compact_claim.lua), or move some to records of their own. format.lua and
-- lib.lua go before it.
--
-- KEYS[1]      the call record key
-- KEYS[2]      the index key of the claims' entries (see compact_claim.lua)
-- KEYS[2+j]    moving only: the record key of the j-th claim
-- ARGV[1]      a record key of the call's claims, not read: what a client
--              that places keys by hashing them (a Ring) sends the call by
-- ARGV[2]      the call token (decimal)
-- ARGV[3]      'E' to renew the call's lease, 'M' to move the claims named to
--              records of their own, with the lease they have
-- ARGV[4]      renewing: the new lease from now, in milliseconds
-- ARGV[5]      renewing: the time to keep the call record from now, at
--              least, in milliseconds; moving: the time to keep a pending
--              record
-- ARGV[4+2j]   the place in the call of the j-th claim
-- ARGV[5+2j]   the first 8 bytes of its digest, which its entry starts with
--
-- Returns an array whose j-th element answers the j-th claim: 1 renewed or
-- moved, 3 (renewing) moved to a record of its own already, which answers
-- by the claim's token, 4 (moving) completed already, as a marker, 0 lease
-- lost, or the reason a value is not one of
-- ours. Renewing keeps the index key at least as long as the call record.
--
-- The claims of one call share one lease: renewing any of them renews every
-- claim the call still holds, in one write. Moving writes each claim named a
-- pending record of its own (its token, attempt 1, the call's lease end and
-- attempt id, the fingerprint the call record keeps, no checkpoints), marks
-- its place M in the call record and takes its entry out of the index: it
-- is a record like any other from then on (Checkpoint, Complete with a
-- value). A claim whose record holds its token already was moved by an
-- earlier run of the same call, and is answered as moved. Safe to run twice.
--
-- Every key it reads or writes is one of its keys; renewing names no record
-- key (it reads none, and a compact claim has none): on a Cluster whose
-- slot migrates, a renewal runs where the call record and the index key
-- are, or is answered TRYAGAIN.
local ck, ikey, token, mode = KEYS[1], KEYS[2], ARGV[2], ARGV[3]
local k = (#ARGV - 5) / 2

local out = {}
local function all(x)
  for j = 1, k do
    out[j] = x
  end
  return out
end

-- moved reports whether KEYS[2 + j] holds the record of this token, in any
-- state: a claim moved, then completed or released by its holder (a call
-- sent again after its first run did both).
local function moved(j)
  local v = redis.pcall('GET', KEYS[2 + j])
  if type(v) ~= 'string' then
    return false
  end
  local tok = string.match(v, RECORD_TOKEN)
  if tok then
    return tok == token
  end
  local tok36 = string.match(v, RECORD_TOKEN36)
  return tok36 ~= nil and tonumber(tok36, 36) == tonumber(token)
end

local v = redis.pcall('GET', ck)
if type(v) == 'table' then
  return all('wrong type')
end
if not v then
  for j = 1, k do
    out[j] = mode == 'M' and moved(j) and transitionDone or transitionLost
  end
  return out
end
local u, done, runtil, att, w, e, places = call_header(v)
if not u then
  return all('unknown format')
end
local at = e + 1
local st = {string.byte(v, at, at + places - 1)}

if mode == 'E' then
  local any = false
  for j = 1, k do
    local s = st[tonumber(ARGV[4 + 2 * j])]
    out[j] = s == 80 and transitionDone or s == 77 and compactMoveMoved or transitionLost -- 'P', 'M'
    any = any or out[j] == transitionDone
  end
  if any then
    local now = index_now()
    local keep = redis.call('PTTL', ck)
    if keep < tonumber(ARGV[5]) then
      keep = ARGV[5]
    end
    redis.call('SET', ck, call_head(string.format('%d', now + tonumber(ARGV[4]) * 1000), done, runtil, att, w) ..
      string.sub(v, at), 'PX', keep)
    if redis.call('PTTL', ikey) < tonumber(keep) then
      redis.call('PEXPIRE', ikey, keep)
    end
  end
  return out
end

local changed = false
for j = 1, k do
  local p = tonumber(ARGV[4 + 2 * j])
  if st[p] == 80 then
    local fp = call_fp(v, e, places, w, p)
    redis.call('SET', KEYS[2 + j], record_head('P', token, '1', '0', u, att, fp), 'PX', ARGV[5])
    -- Its entry leaves the index.
    index_remove(ikey, ARGV[5 + 2 * j])
    st[p], changed = 77, true -- 'M'
    out[j] = transitionDone
  elseif st[p] == 77 and moved(j) then
    out[j] = transitionDone
  elseif st[p] == 67 then -- 'C'
    out[j] = compactMoveCompleted
  else
    out[j] = transitionLost
  end
end
if changed then
  redis.call('SET', ck, string.sub(v, 1, e) .. string.char(unpack(st)) .. string.sub(v, at + places), 'KEEPTTL')
end
return out
