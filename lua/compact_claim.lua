-- compact_claim.lua: claim many records at once, looking at the records and at
-- the id index of compact claims, and keeping the new claims compactly or
-- each in a record of its own. format.lua and lib.lua go before it.
--
-- A compact claim is an entry of 16 bytes in the id index (see format.lua) and
-- a place in one call record, instead of a Redis key: what a consumer's
-- message handled that way leaves is that entry and one byte of the call
-- record, a marker.
--
-- KEYS          the record keys, distinct, n of them, then the index key all
--               their entries are in (of one Cluster slot)
-- ARGV[1]       attempt id (base64url), unique per batch call
-- ARGV[2]       lease in milliseconds
-- ARGV[3]       time to keep a pending record, in milliseconds (>= lease)
-- ARGV[4]       time to keep the call record and the index key, in
--               milliseconds: the lease and the longer of the retention and
--               the marker retention; entries of calls older than that are
--               swept once their call record is gone
-- ARGV[5]       the start of the call record keys; a call record key is
--               ARGV[5] .. TOKEN
-- ARGV[6]       'c' to keep new claims compactly, 'r' in records of their own
-- ARGV[7]       the start of each record's entry, 10 bytes: the first 8 bytes
--               of its digest, then its place in this call, 2 bytes
--               big-endian (i); that of KEYS[i] at 10i-9 to 10i
-- ARGV[7+i]     fingerprint of the request of KEYS[i] (base64url, at most 64
--               bytes, may be empty), present only when the call has
--               fingerprints: #ARGV is 7 or 7 + n
--
-- Returns one flat array: for each record in turn, one of
--   6                                           claimed compactly by this call:
--                                               the call's token, attempt 1,
--                                               not recovered, place i
--   10, token, place                            claimed compactly by an earlier
--                                               run of this call (its reply was
--                                               lost and it was sent again)
--   13                                          claimed a new record: token
--                                               Redis's clock (the reply's
--                                               last), attempt 1, not
--                                               recovered, no checkpoints
--   1, token, attempt, recovered, checkpoints   claimed a record (checkpoints may be '')
--   2, record                                   completed (a record)
--   8, token                                    completed (a marker): an empty
--                                               result, within the retention
--                                               its completion asked for
--   9, token                                    completed (a marker), past that
--                                               retention: the result is no
--                                               longer kept
--   11, token, attempt                          completed, a record whose result
--   12, token, attempt                          is a marker's (see claim.lua's
--                                               marked): as 8 and 9
--   3, lease_left_ms                            in progress
--   4                                           another fingerprint
--   5, reason                                   not a record of ours
--   7, error                                    Redis refused a write (OOM,
--                                               READONLY, ...), or the record's
--                                               entry is younger than ARGV[3]
--                                               and its call record is missing
--                                               (see entryof): not claimed
-- then the call's token (0 when no record was claimed compactly) and Redis's
-- clock (microseconds); or the error "IDEMLAYOUT " and what the index key's
-- field "" holds, when it is of another layout, and nothing is done.
--
-- The call record, a string (see format.lua):
--   "i2B" LEASE_UNTIL_US ":" DONE_US ":" RESULT_UNTIL_US ":" ATTEMPT_ID ":" FPW ":" STATES FPS
-- STATES holds one byte per place of the call: P pending (held by the call),
-- C completed (a marker), R released, X not claimed by the call, M moved to
-- a record of its own (taken over, claimed after a release, checkpointed or
-- completed with a value), F forgotten. FPS holds FPW bytes per place, its
-- fingerprint '.' padded; FPW is the longest fingerprint of the call (0
-- when it has none). DONE_US is when the call last completed a claim (0 if
-- never); RESULT_UNTIL_US when the retention its completions asked for ends
-- (0 if never): a marker answers as an empty result until then, and as one
-- whose result is no longer kept for as long as the call record is kept
-- (the marker retention). A call's claims share its lease. The token of a
-- call is Redis's clock in microseconds, made unique among the call records
-- there are, so that it is above every token its records had before.
-- Whatever takes a place over marks it in the call record, and takes the
-- entry out of the index, so the call record alone says whether the call
-- still holds it.
--
-- The index is read once for the call: its state, then every block the
-- call's records fall in, in one HMGET; it is written once: every block that
-- changed and the state, in one HSET. A block written is first swept of its
-- oldest entries whose call record is gone; entries past INDEX_FILL a block
-- split blocks, a few a call; an index far below that merges one.
--
-- A record key's value comes first: when it holds a record, the index is
-- not asked, and the rules are those of claim.lua. (A compact claim does
-- not look at a record key that holds no string; a claim of a record
-- answers it "not a record of ours".) A compact claim whose
-- lease ran out, or that was released, is taken over by a record of its own
-- (attempt 2 and on). Safe to run twice for one call: a record claimed by
-- the first run is found with the same attempt id and answered the same
-- claim (10, or 1 for a record).
--
-- The keys it declares are the records' and the index key; the call records
-- it reads (those of the entries it finds) and writes (its own, whose token
-- it chooses) it can name only as it runs. It reads or writes one only for
-- a record whose key holds nothing. On a Cluster whose slot migrates, Redis
-- runs a script of several keys only on a node that holds every one of them,
-- else answers TRYAGAIN: so while the slot of a call migrates, a call that
-- would read or write a call record never runs, and one that runs (every
-- record there) reads none.
local n = (#KEYS - 1)
local ikey = KEYS[n + 1]
local attempt, lease, keep, callkeep = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local cbase, compact, heads = ARGV[5], ARGV[6] == 'c', ARGV[7]
local withfps = #ARGV == 7 + n

local now = index_now()
local until_s = string.format('%d', now + lease * 1000)
-- A new record of this call, but for its fingerprint: token now, attempt 1,
-- not recovered.
local now_s = string.format('%d', now)

-- The call's token: Redis's clock, unless a call record holds it already;
-- looked for when the call first claims a record compactly, so that a call
-- that claims none reads no call record key but those of the entries it
-- finds.
local token, token_s, tok6 = now, nil, nil
local function calltok6()
  if not tok6 then
    while redis.call('EXISTS', cbase .. string.format('%d', token)) == 1 do
      token = token + 1
    end
    token_s, tok6 = string.format('%d', token), index_tok6(token)
  end
  return tok6
end

-- readable reports whether s reads as checkpoints (see checkpoint.lua).
local function readable(s)
  local pos, fields = 1, 0
  while pos <= #s do
    local len = string.match(s, CHECKPOINT_FIELD, pos)
    if not len or #len > 9 then
      return false
    end
    pos = pos + #len + 1 + tonumber(len)
    fields = fields + 1
  end
  return pos == #s + 1 and fields % 2 == 0
end

-- refused answers a write that Redis refused: a value that is not ours is
-- corrupt; anything else (OOM, READONLY, ...) is Redis's to answer.
local function refused(e)
  local msg = e.err or tostring(e)
  if string.sub(msg, 1, 9) == 'WRONGTYPE' then
    return replyNotOurs, 'wrong type'
  end
  return compactClaimRefused, msg
end

-- newrecord writes a pending record of its own for KEYS[i], after a claim
-- of token prev, cnt claims before this one.
local function newrecord(i, prev, cnt, recovered, fp, checkpoints)
  local tok = now
  if prev >= tok then
    tok = prev + 1
  end
  local c = math.min(cnt + 1, 999999999)
  local value = record_head('P', string.format('%d', tok), c, recovered, until_s, attempt, fp) .. checkpoints
  local ok
  if prev == 0 then
    -- The key held no string: NX, so that a value of another type there
    -- is refused rather than overwritten.
    ok = redis.pcall('SET', KEYS[i], value, 'PX', keep, 'NX')
    if not ok then
      return replyNotOurs, 'wrong type'
    end
  else
    ok = redis.pcall('SET', KEYS[i], value, 'PX', keep)
  end
  if type(ok) == 'table' and ok.err then
    return refused(ok)
  end
  return compactClaimRecord, tok, c, recovered, checkpoints
end

-- newfresh writes a new pending record for KEYS[i], which holds no string,
-- and answers compactClaimNewRecord; NX, so that a value of another type there is refused
-- rather than overwritten.
local function newfresh(i, fp)
  local ok = redis.pcall('SET', KEYS[i], record_head('P', now_s, '1', '0', until_s, attempt, fp), 'PX', keep, 'NX')
  if not ok then
    return replyNotOurs, 'wrong type'
  end
  if type(ok) == 'table' and ok.err then
    return refused(ok)
  end
  return compactClaimNewRecord
end

-- record answers for KEYS[i], whose value v is a record (see claim.lua).
local function record(i, v, fp)
  if string.sub(v, 1, #RECORD_SHORT_START) == RECORD_SHORT_START then
    local _, e, sfp, tok36, cnt = string.find(v, RECORD_SHORT)
    if not e then
      return replyNotOurs, 'unknown format'
    end
    if sfp ~= fp then
      return compactClaimMismatch
    end
    -- A result that is a marker's (see claim.lua) answers as a marker.
    local untl = string.match(v, RECORD_MARKER, e + 1)
    if untl then
      if now < tonumber(untl) then
        return compactClaimMarked, tonumber(tok36, 36), tonumber(cnt)
      end
      return compactClaimMarkedExpired, tonumber(tok36, 36), tonumber(cnt)
    end
    return compactClaimCompleted, v
  end
  local _, hdr, st, tok, cnt, rec, until_us, att, rfp = string.find(v, RECORD_LONG)
  if not st then
    return replyNotOurs, 'unknown format'
  end
  if #tok > 16 or #cnt > 9 or #until_us > 16 or tonumber(tok) > 9007199254740991 then
    return replyNotOurs, 'token or attempt count out of range'
  end
  if rfp ~= fp and (st ~= 'R' or hdr < #v) then
    return compactClaimMismatch
  end
  if st == 'C' then
    return compactClaimCompleted, v
  end
  local checkpoints, recovered = string.sub(v, hdr + 1), 0
  if not readable(checkpoints) then
    return replyNotOurs, 'checkpoints unreadable'
  end
  if st == 'P' then
    if att == attempt then
      return compactClaimRecord, tonumber(tok), tonumber(cnt), tonumber(rec), checkpoints
    end
    local left = tonumber(until_us) - now
    if left > 0 then
      return compactClaimInProgress, math.ceil(left / 1000)
    end
    recovered = 1
  end
  if tonumber(tok) >= 9007199254740991 then
    return replyNotOurs, 'token space exhausted'
  end
  return newrecord(i, tonumber(tok), tonumber(cnt), recovered, fp, checkpoints)
end

-- The call records of the entries found, read once each: calls[tok] is the
-- record's value, or false when there is none; headers[tok] its header.
local calls, headers = {}, {}
local function call(tok)
  local v = calls[tok]
  if v == nil then
    v = redis.call('GET', cbase .. tok) or false
    calls[tok] = v
  end
  return v
end

-- header reads the call record of tok (see format.lua's call_header).
local function header(tok, v)
  local h = headers[tok]
  if not h then
    h = {call_header(v)}
    headers[tok] = h
  end
  return h[1], h[2], h[3], h[4], h[5], h[6], h[7]
end

-- mark puts byte s at place p of the call record tok.
local function mark(tok, p, s)
  local cv = call(tok)
  local _, _, _, _, _, e = header(tok, cv)
  redis.call('SETRANGE', cbase .. tok, e + p - 1, s)
  calls[tok] = string.sub(cv, 1, e + p - 1) .. s .. string.sub(cv, e + p + 1)
end

-- gone reports whether the call record of tok (decimal) is gone; asked once
-- a call.
local gones = {}
local function gone(tok)
  local g = gones[tok]
  if g == nil then
    g = calls[tok] == false or calls[tok] == nil and redis.call('EXISTS', cbase .. tok) == 0
    gones[tok] = g
  end
  return g
end

-- entryof answers for KEYS[i] from its index entry, that of call ctok at
-- place: nil when the entry is stale (its call record gone, or no longer
-- holding the record); drop is set when the entry must leave the index. An
-- entry younger than ARGV[3] whose call record is gone is not stale (a call
-- record lives longer than that): its call record is elsewhere (a slot
-- migrating) or lost, and the record is answered compactClaimRefused,
-- unavailable.
local function entryof(i, fp, ctok, place)
  local cv = call(ctok)
  if not cv then
    if now - tonumber(ctok) < tonumber(keep) * 1000 then
      return false, compactClaimRefused, 'TRYAGAIN the call record of the index entry is missing'
    end
    return true, nil
  end
  local u, _, runtil, att, cfpw, e, places = header(ctok, cv)
  if not u then
    return false, replyNotOurs, 'unknown format'
  end
  if place < 1 or place > places then
    return true, nil
  end
  local st = string.sub(cv, e + place, e + place)
  if (st == 'P' or st == 'C') and call_fp(cv, e, places, cfpw, place) ~= fp then
    return false, compactClaimMismatch
  end
  if st == 'P' then
    if att == attempt then
      return false, compactClaimedBefore, tonumber(ctok), place
    end
    if tonumber(u) > now then
      return false, compactClaimInProgress, math.ceil((tonumber(u) - now) / 1000)
    end
  end
  if st == 'P' or st == 'R' then
    local recovered = 0
    if st == 'P' then
      recovered = 1
    end
    local code, x, y, z, w = newrecord(i, tonumber(ctok), 1, recovered, fp, '')
    if code == compactClaimRecord then
      mark(ctok, place, 'M')
      return true, code, x, y, z, w
    end
    return false, code, x, y, z, w
  end
  if st == 'C' then
    if now < tonumber(runtil) then
      return false, compactClaimMarker, tonumber(ctok)
    end
    return false, compactClaimMarkerExpired, tonumber(ctok)
  end
  return true, nil
end

local fpw = 0
if withfps then
  for i = 1, n do
    fpw = math.max(fpw, #ARGV[7 + i])
  end
end
local pad = string.rep('.', fpw)

-- The index: its state m, and bv[name], the value of each block the call
-- reads, as the call changes it ('' for none); dirty[name] is set for the
-- blocks to write back. (Claims kept in records find nothing in an index key
-- that is not there: no reading of its blocks, every block empty.)
local m, bv, dirty, names = nil, {}, {}, {}
local indexed = compact or redis.call('EXISTS', ikey) == 1
if indexed then
  local other
  m, other = index_state(redis.call('HGET', ikey, ''))
  if not m then
    return redis.error_reply('IDEMLAYOUT ' .. other)
  end
  local want, nw = {}, 0
  for i = 1, n do
    local name = index_name(index_place(m, heads, 10 * i - 9))
    names[i] = name
    if not bv[name] then
      bv[name] = ''
      nw = nw + 1
      want[nw] = name
    end
  end
  local got = redis.call('HMGET', ikey, unpack(want, 1, nw))
  for j = 1, nw do
    if got[j] then
      bv[want[j]] = got[j]
    end
  end
end
local added, dropped = 0, 0
local recs = redis.call('MGET', unpack(KEYS, 1, n))
local out, o, states, fps, claimed = {}, 0, {}, {}, false
for i = 1, n do
  local fp = ''
  if withfps then
    fp = ARGV[7 + i]
  end
  local code, a, b, c, d
  if recs[i] then
    code, a, b, c, d = record(i, recs[i], fp)
  elseif not indexed then
    code, a = newfresh(i, fp)
  else
    local name = names[i]
    local blk = bv[name]
    if blk ~= '' then
      local d8 = string.sub(heads, 10 * i - 9, 10 * i - 2)
      local pos = index_find(blk, d8)
      if pos then
        local ctok, place = index_token(blk, pos, now)
        local drop
        drop, code, a, b, c, d = entryof(i, fp, string.format('%d', ctok), place)
        if drop then
          bv[name], dirty[name], dropped = string.sub(blk, 1, pos - 1) .. string.sub(blk, pos + 16), true, dropped + 1
        end
      end
    end
    if not code then
      -- No entry, or a stale one: the record is free.
      if compact then
        bv[name], dirty[name], code = bv[name] .. string.sub(heads, 10 * i - 9, 10 * i) .. calltok6(), true, compactClaimed
        added = added + 1
      else
        code, a = newfresh(i, fp)
      end
    end
  end
  o = o + 1
  out[o] = code
  if code == compactClaimed then
    states[i], claimed = 'P', true
  else
    states[i] = 'X'
    if code == compactClaimRecord then
      out[o + 1], out[o + 2], out[o + 3], out[o + 4] = a, b, c, d
      o = o + 4
    elseif code == compactClaimedBefore or code == compactClaimMarked or code == compactClaimMarkedExpired then
      out[o + 1], out[o + 2] = a, b
      o = o + 2
    elseif code ~= compactClaimMismatch and code ~= compactClaimNewRecord then
      o = o + 1
      out[o] = a
    end
  end
  if fpw > 0 then
    fps[i] = string.sub(fp .. pad, 1, fpw)
  end
end

if indexed and (added > 0 or dropped > 0) then
  local maxage = tonumber(callkeep) * 1000

  -- block returns the value of block b, read if the call has not.
  local function block(b)
    local name = index_name(b)
    local v = bv[name]
    if v == nil then
      v = redis.call('HGET', ikey, name) or ''
      bv[name] = v
    end
    return name, v
  end

  -- sweep returns blk without its entries at the start whose call is older
  -- than the call record's keep and whose call record is gone (entries come
  -- in the order of their calls, but for those of merged blocks), and how
  -- many it took out.
  local function sweep(blk)
    local pos = 1
    local kept, cut = {}, 0
    while pos <= #blk do
      local tok = index_token(blk, pos, now)
      if now - tok <= maxage then
        break
      end
      if gone(string.format('%d', tok)) then
        cut = cut + 1
      else
        kept[#kept + 1] = string.sub(blk, pos, pos + 15)
      end
      pos = pos + 16
    end
    if cut == 0 then
      return blk, 0
    end
    return table.concat(kept) .. string.sub(blk, pos), cut
  end

  for name in pairs(dirty) do
    local v, cut = sweep(bv[name])
    bv[name], dropped = v, dropped + cut
  end
  m.n = math.max(0, m.n + added - dropped)

  -- Split: block s goes into s and s + 2^l by the next bit of its entries'
  -- digests, a few blocks a call, while the index holds more than
  -- INDEX_FILL entries a block.
  local splits = 2 + math.floor(added / INDEX_FILL)
  while splits > 0 and m.n > INDEX_FILL * index_blocks(m) do
    local half = 2 ^ m.l
    local from, v = block(m.s)
    local v2, cut = sweep(v)
    m.n = m.n - cut
    -- The entries go in runs of those that stay or go alike: a string a
    -- run, not one an entry.
    local stay, go = {}, {}
    local from_pos, staying = 1, nil
    for pos = 1, #v2 + 16, 16 do
      local here = nil
      if pos <= #v2 then
        local a, b, c, d = string.byte(v2, pos + 4, pos + 7)
        here = (((a * 256 + b) * 256 + c) * 256 + d) % (2 * half) == m.s
      end
      if here ~= staying then
        if staying ~= nil then
          local run = string.sub(v2, from_pos, pos - 1)
          if staying then
            stay[#stay + 1] = run
          else
            go[#go + 1] = run
          end
        end
        from_pos, staying = pos, here
      end
    end
    local to = index_name(m.s + half)
    bv[from], bv[to], dirty[from], dirty[to] = table.concat(stay), table.concat(go), true, true
    m.s = m.s + 1
    if m.s == half then
      m.l, m.s = m.l + 1, 0
    end
    splits = splits - 1
  end
  -- Merge: the last block goes back into its sibling, one a call, while
  -- the index holds fewer than a quarter of INDEX_FILL entries a block.
  if index_blocks(m) > 1 and 4 * m.n < INDEX_FILL * index_blocks(m) then
    if m.s == 0 then
      m.l, m.s = m.l - 1, 2 ^ (m.l - 1)
    end
    m.s = m.s - 1
    local into, v = block(m.s)
    local last, w = block(m.s + 2 ^ m.l)
    bv[into], bv[last], dirty[into], dirty[last] = v .. w, '', true, true
  end

  local writes, nw, dels, nd = {'', index_format(m)}, 2, {}, 0
  for name in pairs(dirty) do
    if bv[name] == '' then
      nd = nd + 1
      dels[nd] = name
    else
      writes[nw + 1], writes[nw + 2], nw = name, bv[name], nw + 2
    end
  end
  local ok = redis.pcall('HSET', ikey, unpack(writes, 1, nw))
  if type(ok) == 'table' and ok.err then
    -- Redis refused the call's first write (OOM, READONLY): nothing was
    -- written, and no record was claimed compactly.
    local _, why = refused(ok)
    local again, k, j = {}, 0, 1
    while j <= o do
      local code, size = out[j], 2
      if code == compactClaimRecord then
        size = 5
      elseif code == compactClaimedBefore or code == compactClaimMarked or code == compactClaimMarkedExpired then
        size = 3
      elseif code == compactClaimMismatch or code == compactClaimed or code == compactClaimNewRecord then
        size = 1
      end
      if code == compactClaimed then
        again[k + 1], again[k + 2], k = compactClaimRefused, why, k + 2
      else
        for x = j, j + size - 1 do
          k = k + 1
          again[k] = out[x]
        end
      end
      j = j + size
    end
    out, o, claimed = again, k, false
  else
    if nd > 0 then
      redis.call('HDEL', ikey, unpack(dels, 1, nd))
    end
    -- Never shortened: a completion or a renewal may have kept it longer.
    if redis.call('PTTL', ikey) < tonumber(callkeep) then
      redis.call('PEXPIRE', ikey, callkeep)
    end
  end
end

if claimed then
  redis.call('SET', cbase .. token_s,
    call_head(until_s, '0', '0', attempt, fpw) .. table.concat(states) .. table.concat(fps),
    'PX', callkeep)
else
  token = 0
end
out[o + 1] = token
out[o + 2] = now
return out
