-- v3_claim.lua: claim a batch in the v3 index (see format.go, "The v3
-- layout"). format.lua goes before it; it defines no function, and makes
-- one closure, format.lua's record_head: everything below runs once a
-- call, or once a message.
--
-- KEYS[1]    the v3 index key
-- KEYS[1+j]  the record key of the message at place j: a record of its own
--            (made by Do, Begin or a Final error) answers for its id, and
--            the index is not looked at for it
-- ARGV[1]    lease, ms
-- ARGV[2]    how long the call record is kept from now, ms: at least the
--            lease and the longest its markers answer
-- ARGV[3]    the start of the call record keys
-- ARGV[4]    the messages, packed and sorted by block (see format.go)
-- ARGV[5]    the call's id, 11 characters of base64url
-- ARGV[6]    FPW, the width of each place's fingerprint (0 to 64)
-- ARGV[7]    the fingerprints, FPW bytes a place in place order, '.'
--            padded; '' when FPW is 0
-- ARGV[8]    the index's level and split point the client packed by, L1 S3
-- ARGV[9]    ms past its token after which an entry's call record is gone
--            for sure (the call record's keep and the longest a call holds
--            its claims): such an entry is swept. An entry whose call record
--            is missing answers W (unavailable) while younger than ARGV[10]
--            (the call record is elsewhere, its slot migrating, or was
--            lost), as absent after
-- ARGV[10]   how long a pending record is kept, ms: at least the lease
--            and the retention of a result; the least a call record lives
-- ARGV[11]   absent, or the attempt id of a call whose claims are records
--            of their own (what a batch claim that asked for no compact
--            claims gets): what it claims is written there, NX, at this
--            call's token, and no entry is made (kept ARGV[10])
--
-- Returns the reply string of format.go: TOKEN7 L1 S3, an answer a place,
-- then the numbers of the answers that carry one (a done or expired
-- answer: the low 48 bits of the token that completed it and its attempt,
-- 8 bytes).
--
-- A message whose id has an entry is answered from the call record that
-- holds it: completed (done, or expired past its result's retention), held
-- by a live lease (busy), or taken over (its lease ran out: the old place
-- is marked T, so that its holder's settle is refused) or claimed again
-- (released) with this call's token and the attempt after the old one's.
-- A record of its own that is released, or pending past its lease or by
-- this call's attempt, answers K: the client claims it on its record
-- (claim.lua), which takes it over with its checkpoints; one completed
-- with a result other than a marker's answers K too (the client reads
-- the result there). An entry whose call record is missing while it may
-- still live answers W (unavailable), never "not seen".
--
-- A call go-redis sent again (its reply was lost) answers as its first run
-- did when no other call took a token since (the state keeps the id of the
-- call its last token went to): the claims of that run by its token, the
-- rest answered anew but none claimed, nothing written. Once another call
-- came between, the first run's claims answer busy and stay held until
-- their lease ends.
--
-- The call's token is the larger of the last token the index gave plus one
-- and Redis's clock in µs: above every token an id had, its records' too.
-- Entries of a block are in the order of their tokens, so a block is swept
-- of its stale entries from its start. An index begins at v3StartLevel
-- (its blocks exist only once they hold an entry) and splits a block when
-- it holds more than v3IndexFill entries a block on average, moving the
-- entries of the block split whose hash says so. The index key lives at least the call
-- record's keep past every call (DUE in the state says until when it lives).
local ikey, lease_ms, keep_ms, cbase, packed = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]
local callid, fpw, fps = ARGV[5], tonumber(ARGV[6]), ARGV[7]
-- reckeep, how long a pending record is kept, ms; recatt, the attempt id
-- of a call that claims records of their own (ARGV[11]), or nil.
local reckeep, recatt = ARGV[10], ARGV[11]
local stale = tonumber(ARGV[9]) * 1000
local n = #packed / v3PackedSize
local sub, find, byte, char, fmt, concat = string.sub, string.find, string.byte, string.char, string.format, table.concat

local aP, aU, aD, aE, aB = char(v3AnswerClaimed), char(v3AnswerRepeat), char(v3AnswerDone), char(v3AnswerExpired), char(v3AnswerBusy)
local aT, aA, aM, aN = char(v3AnswerTakenOver), char(v3AnswerReclaimed), char(v3AnswerMismatch), char(v3AnswerNotOurs)
local aR, aK, aO, aW = char(v3AnswerRefused), char(v3AnswerRecord), char(v3AnswerEarlier), char(v3AnswerCallMissing)
-- refused, Redis's error when it refused this call's first write (OOM on
-- a full server, READONLY on a replica): nothing is written, and what this
-- call would have claimed answers aR.
local refused = nil

local tm = redis.call('TIME')
local now = tm[1] * 1000000 + tm[2]
local ref = now + v3TokenAhead

-- The state and the blocks the client named, in one read.
local names = {''}
for j = 1, n do
  local o = (j - 1) * v3PackedSize + 1
  names[j + 1] = sub(packed, o, o + v3BlockNameSize - 1)
end
local blocks = redis.call('HMGET', ikey, unpack(names))
local raw = blocks[1]
local level, split, count, last, due = v3StartLevel, 0, 0, 0, 0
if raw then
  if not find(raw, V3_STATE) then
    return redis.error_reply('IDEMLAYOUT ' .. raw)
  end
  local l, s1, s2, s3, c1, c2, c3, c4 = byte(raw, v3StateLevelAt, v3StateCountAt + 3)
  level, split, count = l, (s1 * 256 + s2) * 256 + s3, ((c1 * 256 + c2) * 256 + c3) * 256 + c4
  local t1, t2, t3, t4, t5, t6, t7 = byte(raw, v3StateTokenAt, v3StateTokenAt + 6)
  last = (((((t1 * 256 + t2) * 256 + t3) * 256 + t4) * 256 + t5) * 256 + t6) * 256 + t7
  local d1, d2, d3, d4 = byte(raw, v3StateDueAt, v3StateDueAt + 3)
  due = ((d1 * 256 + d2) * 256 + d3) * 256 + d4
end
local cl, ls0 = ARGV[8], raw and sub(raw, v3StateLevelAt, v3StateCountAt - 1) or char(v3StartLevel, 0, 0, 0)
if ls0 ~= cl then
  -- The index split (or began again) since the state the client packed
  -- by: each message goes to the block its hash names in the index's
  -- state, and the blocks of those whose block is another are read.
  local c0, c1, c2, c3 = byte(cl, 1, 4)
  local chalf, csplit, half = -1, 0, 2 ^ level
  if #cl == 4 and c0 <= v3MaxLevel then
    chalf, csplit = 2 ^ c0, (c1 * 256 + c2) * 256 + c3
  end
  local moved, mnames, nm = {}, {}, 0
  for j = 1, n do
    local q = (j - 1) * v3PackedSize + v3PackedHashAt
    local h1, h2, h3 = byte(packed, q, q + 2)
    local b = (h1 * 256 + h2) * 256 + h3
    local lo, was = b % half, -1
    if lo < split then
      lo = b % (2 * half)
    end
    if chalf > 0 then
      was = b % chalf
      if was < csplit then
        was = b % (2 * chalf)
      end
    end
    if lo ~= was then
      local f = char(math.floor(lo / 65536), math.floor(lo / 256) % 256, lo % 256)
      nm = nm + 1
      names[j + 1], moved[nm], mnames[nm] = f, j + 1, f
    end
  end
  if nm > 0 then
    local got = redis.call('HMGET', ikey, unpack(mnames))
    for q = 1, nm do
      blocks[moved[q]] = got[q]
    end
  end
end

-- A call that go-redis sent again after its first run (the state says
-- its token went to this call's id) answers as that run did: its claims,
-- by that run's token, and nothing claimed anew, nothing written.
local resend = raw and sub(raw, v3StateCallAt, v3StateCallAt + v3CallIDSize - 1) == callid
local token, cv0 = math.max(last + 1, now), nil
if resend then
  token = last
end
local x = token
local k7 = x % 256
x = (x - k7) / 256
local k6 = x % 256
x = (x - k6) / 256
local k5 = x % 256
x = (x - k5) / 256
local k4 = x % 256
x = (x - k4) / 256
local k3 = x % 256
x = (x - k3) / 256
local k2 = x % 256
local tok7 = char((x - k2) / 256, k2, k3, k4, k5, k6, k7)
-- tok6 names the call's record, as its entries hold the token.
local tok6 = sub(tok7, 2)
if resend then
  cv0 = redis.call('GET', cbase .. tok6) or nil
end

local recs = {}
if n > 0 then
  recs = redis.call('MGET', unpack(KEYS, 2, n + 1))
end

-- bl holds the blocks this call changed, by name, and wnames their names.
local bl, wnames, nw = {}, {}, 0
local calls = {}
if cv0 then
  calls[tok6] = cv0
end
local ans, nums, nn = {}, {}, 0
local atts, claimed, recorded = nil, false, false
local lastf, blk, changed = nil, nil, false
-- One turn past the last message ('' is no block's name) keeps the last
-- block changed, as every earlier one is kept when the next begins.
for j = 1, n + 1 do
  local f = names[j + 1] or ''
  if f ~= lastf then
    if changed then
      if not bl[lastf] then
        nw = nw + 1
        wnames[nw] = lastf
      end
      bl[lastf] = blk
    end
    if j > n then
      break
    end
    lastf, blk, changed = f, bl[f] or blocks[j + 1] or '', false
    -- Sweep the stale entries at the block's start.
    local cut = 0
    while cut < #blk do
      local e1, e2, e3, e4, e5, e6 = byte(blk, cut + v3EntryTokenAt, cut + v3EntryTokenAt + 5)
      local t48 = ((((e1 * 256 + e2) * 256 + e3) * 256 + e4) * 256 + e5) * 256 + e6
      if now - (ref - (ref - t48) % v3TokenModulus) <= stale then
        break
      end
      cut = cut + v3EntrySize
    end
    if cut > 0 then
      blk, changed, count = sub(blk, cut + 1), true, count - cut / v3EntrySize
    end
  end
  local o = (j - 1) * v3PackedSize + 1
  local a, num, attempt, own, raw = aP, nil, nil, false, nil
  local rv = recs[j]
  if rv then
    -- A record of its own answers for the id.
    local mine = ''
    if fpw > 0 then
      mine = string.match(sub(fps, (j - 1) * fpw + 1, j * fpw), '^(.-)%.*$')
    end
    local _, e, sfp, stok, scnt = find(rv, RECORD_SHORT)
    local lst, luntl, latt, lfp
    if not e then
      _, _, lst, _, _, _, luntl, latt, lfp = find(rv, RECORD_LONG)
    end
    if e then
      if sfp ~= mine then
        a = aM
      else
        local untl = string.match(rv, RECORD_MARKER, e + 1)
        if not untl then
          -- A result of its own (a value, a Final error): the client
          -- reads it there.
          a = aK
        else
          if tonumber(untl) < now then
            a = aE
          else
            a = aD
          end
          -- The record's token (its low 48 bits) and attempt.
          local t, c = tonumber(stok, 36) % v3TokenModulus, math.min(tonumber(scnt), v3MaxAttempts)
          local b = {}
          for q = 6, 1, -1 do
            b[q] = t % 256
            t = (t - b[q]) / 256
          end
          raw = char(b[1], b[2], b[3], b[4], b[5], b[6], math.floor(c / 256), c % 256)
        end
      end
    elseif not lfp then
      a = aN
    elseif lst == 'C' then
      if lfp ~= mine then
        a = aM
      else
        a = aK
      end
    elseif lst == 'P' and lfp ~= mine then
      a = aM
    elseif lst == 'P' and latt ~= callid and latt ~= recatt and #luntl <= 16 and tonumber(luntl) > now then
      a, num = aB, math.ceil((tonumber(luntl) - now) / 1000)
    else
      -- Released, or pending past its lease or by this call's attempt:
      -- the record's own claim (claim.lua) takes it over, its
      -- checkpoints with it.
      a = aK
    end
  else
    local key8 = sub(packed, o + v3PackedDigestAt - 1, o + v3PackedPlaceAt - 2)
    local pos = find(blk, key8, 1, true)
    while pos and pos % v3EntrySize ~= 1 do
      pos = find(blk, key8, pos + 1, true)
    end
    if pos then
      -- ks, the entry's token as it names the call record.
      local ks = sub(blk, pos + v3EntryTokenAt - 1, pos + v3EntryTokenAt + 4)
      local free = false
      if ks == tok6 then
        local p1, p2 = byte(blk, pos + v3EntryPlaceAt - 1, pos + v3EntryPlaceAt)
        if not resend or p1 * 256 + p2 ~= j then
          a = aU
        elseif cv0 and byte(cv0, v3CallHeadSize + j) == v3Held then
          -- This call's own claim, by its first run.
          own, a = true, aP
          local caw = byte(cv0, v3CallAWAt)
          if caw == v3AttemptSize then
            local np0 = (#cv0 - v3CallHeadSize) / (1 + caw + byte(cv0, v3CallFPWAt))
            local a1, a2 = byte(cv0, v3CallHeadSize + np0 + (j - 1) * caw + 1, v3CallHeadSize + np0 + j * caw)
            local at = a1 * 256 + a2
            if at >= v3RecoveredBit then
              a, num = aT, at - v3RecoveredBit
            elseif at > 1 then
              a, num = aA, at
            end
          end
        else
          a, num = aB, lease_ms
        end
      else
        local cv = calls[ks]
        if cv == nil then
          cv = redis.call('GET', cbase .. ks) or false
          calls[ks] = cv
        end
        if not cv then
          local e1, e2, e3, e4, e5, e6 = byte(ks, 1, 6)
          local et = ref - (ref - (((((e1 * 256 + e2) * 256 + e3) * 256 + e4) * 256 + e5) * 256 + e6)) % v3TokenModulus
          if now - et <= tonumber(reckeep) * 1000 then
            -- Younger than its call record lives: the call record is
            -- elsewhere (its slot migrates) or lost, and the entry is
            -- not stale.
            a = aW
          else
            free = true
          end
        elseif sub(cv, 1, 3) ~= V3_CALL_TAG or #cv < v3CallHeadSize then
          a = aN
        else
          local p1, p2 = byte(blk, pos + v3EntryPlaceAt - 1, pos + v3EntryPlaceAt)
          local p = p1 * 256 + p2
          local cfpw, caw = byte(cv, v3CallFPWAt), byte(cv, v3CallAWAt)
          local np = (#cv - v3CallHeadSize) / (1 + caw + cfpw)
          local s = byte(cv, v3CallHeadSize + p)
          if p > np or np % 1 ~= 0 then
            a = aN
          elseif s == v3Held and sub(cv, v3CallIDAt, v3CallIDAt + v3CallIDSize - 1) == callid then
            -- Held by an earlier run of this call (go-redis sent it again
            -- after another call came between): that claim answers, by its
            -- token, place and attempt.
            -- (go-redis sends the same places again; another place of
            -- the same id is a repeat).
            if p ~= j then
              a = aU
            else
              local a1, a2 = 0, 1
              if caw == v3AttemptSize then
                a1, a2 = byte(cv, v3CallHeadSize + np + (p - 1) * caw + 1, v3CallHeadSize + np + p * caw)
              end
              a, raw = aO, ks .. char(p1, p2, a1, a2)
            end
          elseif s == v3Held or s == v3Completed or s == v3Released then
            local mine, theirs = '', ''
            if fpw > 0 then
              mine = string.match(sub(fps, (j - 1) * fpw + 1, j * fpw), '^(.-)%.*$')
            end
            if cfpw > 0 then
              local fo = v3CallHeadSize + np * (1 + caw) + (p - 1) * cfpw
              theirs = string.match(sub(cv, fo + 1, fo + cfpw), '^(.-)%.*$')
            end
            local prev = 1
            if caw == v3AttemptSize then
              local a1, a2 = byte(cv, v3CallHeadSize + np + (p - 1) * caw + 1, v3CallHeadSize + np + p * caw)
              prev = (a1 * 256 + a2) % v3RecoveredBit
            end
            if s ~= v3Released and mine ~= theirs then
              a = aM
            elseif s == v3Completed then
              local r1, r2, r3, r4, r5, r6, r7 = byte(cv, v3CallResultUntilAt, v3CallResultUntilAt + v3TimeSize - 1)
              if now <= (((((r1 * 256 + r2) * 256 + r3) * 256 + r4) * 256 + r5) * 256 + r6) * 256 + r7 then
                a = aD
              else
                a = aE
              end
              -- The token that completed it and its attempt.
              raw = ks .. char(math.floor(prev / 256), prev % 256)
            else
              local untl = 0
              if s == v3Held then
                local u1, u2, u3, u4, u5, u6, u7 = byte(cv, v3CallUntilAt, v3CallUntilAt + v3TimeSize - 1)
                untl = (((((u1 * 256 + u2) * 256 + u3) * 256 + u4) * 256 + u5) * 256 + u6) * 256 + u7
              end
              if untl > now then
                a, num = aB, math.ceil((untl - now) / 1000)
              elseif resend then
                a, num = aB, lease_ms
              elseif refused then
                a = aR
              else
                -- The lease ran out, or the claim was released: fence its
                -- holder off (a settle of it sent late is refused) and
                -- claim it again.
                local ok = redis.pcall('SETRANGE', cbase .. ks, v3CallHeadSize + p - 1, 'T')
                if type(ok) == 'table' and ok.err then
                  -- Redis refused the call's first write (OOM, READONLY).
                  a, refused = aR, ok.err
                else
                  calls[ks] = sub(cv, 1, v3CallHeadSize + p - 1) .. 'T' .. sub(cv, v3CallHeadSize + p + 1)
                  a, attempt, free = aT, math.min(prev + 1, v3MaxAttempts) + v3RecoveredBit, true
                  if s == v3Released then
                    a, attempt = aA, attempt - v3RecoveredBit
                  end
                end
              end
            end
          else
            -- Not held there any more (taken over, moved, forgotten): the
            -- entry is a leftover.
            free = true
          end
        end
      end
      if free then
        blk, changed, count = sub(blk, 1, pos - 1) .. sub(blk, pos + v3EntrySize), true, count - 1
      end
    end
  end
  -- A place's state in the call record follows from its answer: held
  -- when claimed (P, T, A), else X (see the SET below).
  if own then
    -- Held by the first run.
  elseif resend and (a == aP or a == aT or a == aA) then
    a, num = aB, lease_ms
  elseif recatt and (a == aP or a == aT or a == aA) then
    -- A record of its own, NX: a value of another type there (which MGET
    -- answers nil) is refused, not overwritten.
    local c, rec = 1, '0'
    if attempt then
      c = attempt % v3RecoveredBit
      num = c
      if attempt >= v3RecoveredBit then
        rec = '1'
      end
    end
    local mine = ''
    if fpw > 0 then
      mine = string.match(sub(fps, (j - 1) * fpw + 1, j * fpw), '^(.-)%.*$')
    end
    if refused then
      a = aR
    else
      local ok = redis.pcall('SET', KEYS[j + 1], record_head('P', fmt('%d', token), c, rec, fmt('%d', now + lease_ms * 1000), recatt, mine),
        'PX', reckeep, 'NX')
      if type(ok) == 'table' and ok.err then
        a, refused = aR, ok.err
      elseif not ok then
        a, num = aN, nil
      else
        recorded = true
      end
    end
  elseif a == aP or a == aT or a == aA then
    blk, changed, count = blk .. sub(packed, o + v3PackedDigestAt - 1, o + v3PackedSize - 1) .. tok6, true, count + 1
    claimed = true
    if attempt then
      atts = atts or {}
      atts[j] = attempt
      num = attempt % v3RecoveredBit
    end
  end
  ans[j] = a
  if num then
    nn = nn + 1
    nums[nn] = fmt('%d', num) .. ','
  elseif raw then
    nn = nn + 1
    nums[nn] = raw
  end
end

local answers = concat(ans)
if resend then
  return tok7 .. sub(raw, v3StateLevelAt, v3StateCountAt - 1) .. answers .. concat(nums)
end

-- Split while the index holds more than the fill a block, a few a call.
local splits = math.ceil(n / v3IndexFill) + 1
while splits > 0 and level < v3MaxLevel and count > v3IndexFill * (2 ^ level + split) do
  local half = 2 ^ level
  local from = char(math.floor(split / 65536), math.floor(split / 256) % 256, split % 256)
  local hi = split + half
  local to = char(math.floor(hi / 65536), math.floor(hi / 256) % 256, hi % 256)
  local b = bl[from]
  if not b then
    b = redis.call('HGET', ikey, from) or ''
    nw = nw + 1
    wnames[nw] = from
  end
  -- Runs of entries that stay or go, each cut out once. Bit L of an
  -- entry's hash is tested with % (Lua's arithmetic), not math.floor (a C
  -- call an entry: a split of 16 entries cost some 59k Redis instructions
  -- with it, 50k without).
  local keep, move, nk, nm = {}, {}, 0, 0
  local at, bit, q, m = v3EntryHashAt + 2 - math.floor(level / 8), 2 ^ (level % 8), 0, #b
  local two = 2 * bit
  while q < m do
    local side, r = byte(b, q + at) % two >= bit, q + v3EntrySize
    while r < m and (byte(b, r + at) % two >= bit) == side do
      r = r + v3EntrySize
    end
    if side then
      nm = nm + 1
      move[nm] = sub(b, q + 1, r)
    else
      nk = nk + 1
      keep[nk] = sub(b, q + 1, r)
    end
    q = r
  end
  bl[from] = concat(keep)
  nw = nw + 1
  wnames[nw] = to
  bl[to] = concat(move)
  split = split + 1
  if split == half then
    level, split = level + 1, 0
  end
  splits = splits - 1
end

local keep_s = math.ceil(keep_ms / 1000)
local now_s = math.floor(now / 1000000)
local stateChanged = (nw > 0 or claimed) and not refused
local expire = due < now_s + keep_s + 1
if expire then
  due, stateChanged = now_s + 2 * keep_s - 1, not refused
end
if not claimed and not recorded then
  token, tok7 = last, '\0\0\0\0\0\0\0'
end
local s3 = char(math.floor(split / 65536), math.floor(split / 256) % 256, split % 256)
if stateChanged then
  local c, d = count, due
  local c4, d4 = c % 256, d % 256
  c, d = (c - c4) / 256, (d - d4) / 256
  local c3, d3 = c % 256, d % 256
  c, d = (c - c3) / 256, (d - d3) / 256
  local c2, d2 = c % 256, d % 256
  c, d = (c - c2) / 256, (d - d2) / 256
  local tokst = tok7
  if not claimed then
    tokst = sub(raw or '', v3StateTokenAt, v3StateTokenAt + 6)
    if tokst == '' then
      tokst = '\0\0\0\0\0\0\0'
    end
  end
  -- The state and the blocks written, in one HSET.
  local cid = callid
  if not claimed then
    cid = sub(raw or '', v3StateCallAt, v3StateCallAt + v3CallIDSize - 1)
    if cid == '' then
      cid = '\0\0\0\0\0\0\0\0\0\0\0'
    end
  end
  -- A block left empty (swept, or split off whole) is deleted, not
  -- written: a block is a field only while it holds an entry.
  local w, gone, nh, ng = {'', V3_STATE_TAG .. char(level) .. s3 .. char(c, c2, c3, c4) .. tokst .. char(d, d2, d3, d4) .. cid}, {}, 2, 0
  for j = 1, nw do
    local f = wnames[j]
    if bl[f] == '' then
      ng = ng + 1
      gone[ng] = f
    else
      w[nh + 1], w[nh + 2], nh = f, bl[f], nh + 2
    end
  end
  -- The first write of a call that took nothing over: Redis may refuse it
  -- (the HDEL and PEXPIRE below, not refused under OOM, go after it).
  local ok = redis.pcall('HSET', ikey, unpack(w))
  if type(ok) == 'table' and ok.err then
    refused = ok.err
  else
    if ng > 0 then
      redis.call('HDEL', ikey, unpack(gone))
    end
    if expire then
      redis.call('PEXPIRE', ikey, 2 * keep_ms)
    end
  end
end

if refused then
  -- Nothing written: what this call claimed answers refused, followed by
  -- Redis's error after the numbers, and a number stays with each busy
  -- answer only. The reply gives the index's state as it was.
  local k, kept, nk, why = 0, {}, 0, ''
  for j = 1, n do
    local a = ans[j]
    if a == aB or a == aT or a == aA or a == aD or a == aE or a == aO then
      k = k + 1
    end
    if a == aP or a == aT or a == aA or a == aR then
      ans[j], why = aR, refused
    elseif a == aB or a == aD or a == aE or a == aO then
      nk = nk + 1
      kept[nk] = nums[k]
    end
  end
  return '\0\0\0\0\0\0\0' .. ls0 .. concat(ans) .. concat(kept) .. why
end

if claimed then
  local attempts, aw = '', 0
  if atts then
    aw = v3AttemptSize
    local ab = {}
    for j = 1, n do
      local at = atts[j] or 1
      ab[2 * j - 1], ab[2 * j] = math.floor(at / 256), at % 256
    end
    attempts = char(unpack(ab))
  end
  -- UNTIL, 7 bytes big-endian (locals, not a table: cheaper in Lua).
  local u = now + lease_ms * 1000
  local u7 = u % 256
  u = (u - u7) / 256
  local u6 = u % 256
  u = (u - u6) / 256
  local u5 = u % 256
  u = (u - u5) / 256
  local u4 = u % 256
  u = (u - u4) / 256
  local u3 = u % 256
  u = (u - u3) / 256
  local u2 = u % 256
  redis.call('SET', cbase .. tok6,
    V3_CALL_TAG .. char((u - u2) / 256, u2, u3, u4, u5, u6, u7) .. '\0\0\0\0\0\0\0\0\0\0\0\0\0\0' .. callid ..
    char(fpw, aw) .. (string.gsub((string.gsub(answers, '[^PTA]', 'X')), '[TA]', 'P')) .. attempts .. fps, 'PX', keep_ms)
end
return tok7 .. char(level) .. s3 .. answers .. concat(nums)
