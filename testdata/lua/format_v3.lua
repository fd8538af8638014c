-- format_v3.lua: a test script (format_v3_test.go), sent as the store's
-- scripts are (luaSource: the definitions of format.lua it names first). It
-- reads and writes the v3 formats with format.lua's constants and patterns
-- alone, as a v3 script would, so that Go and Lua are held to one layout.
--
-- ARGV[1] 'claim': ARGV[2] a packed claim argument, ARGV[3] a reply's
-- head, ARGV[4] the answers by place, ARGV[5] the numbers of those that
-- carry one, comma-separated. Returns for each message its block name,
-- digest, place and hash, then the reply.
--
-- ARGV[1] 'read': ARGV[2] Redis's clock (µs, decimal), ARGV[3] a state
-- field, ARGV[4] a block of entries, ARGV[5] a call record, ARGV[6] block
-- hashes, 3 bytes each. Returns {L, S, N, TOKEN, DUE, CALL, then for each entry
-- its digest, block hash, place and whole token, then the block of each hash in the
-- state read, then the call record's UNTIL, DONE, RESULT_UNTIL, CALL_ID,
-- FPW, AW, places, states, then for each place its attempt, recovered (0
-- or 1) and fingerprint}; or {'not a state'} / {'not a call record'}.
--
-- ARGV[1] 'write': ARGV[2..6] L, S, N, TOKEN, DUE; ARGV[7] a digest and its
-- block hash (8 bytes), ARGV[8]
-- a place, ARGV[9] a token; ARGV[10] a block number; ARGV[11..13] UNTIL,
-- DONE, RESULT_UNTIL; ARGV[14] CALL_ID (the state's too); ARGV[15] states; ARGV[16] attempts,
-- a place each, 'a' or 'a+' (recovered), comma-separated ('' for AW 0);
-- ARGV[17] fingerprints, comma-separated, and ARGV[18] their width.
-- Returns {state, entry, block name, call record}.
local function be(x, n)
  local b = {}
  for j = n, 1, -1 do
    b[j] = x % 256
    x = (x - b[j]) / 256
  end
  return string.char(unpack(b))
end

local function num(s, at, n)
  local x = 0
  for j = at, at + n - 1 do
    x = x * 256 + string.byte(s, j)
  end
  return x
end

if ARGV[1] == 'claim' then
  local packed, out, nums = ARGV[2], {}, {}
  local answers = ARGV[4]
  local numbers = {}
  for x in string.gmatch(ARGV[5], '[^,]+') do
    numbers[#numbers + 1] = tonumber(x)
  end
  for o = 1, #packed, v3PackedSize do
    out[#out + 1] = string.sub(packed, o, o + v3BlockNameSize - 1)
    out[#out + 1] = string.sub(packed, o + v3PackedDigestAt - 1, o + v3PackedHashAt - 2)
    out[#out + 1] = num(packed, o + v3PackedPlaceAt - 1, 2)
    out[#out + 1] = num(packed, o + v3PackedHashAt - 1, 3)
    local a = string.byte(answers, (o - 1) / v3PackedSize + 1)
    if a == v3AnswerBusy or a == v3AnswerTakenOver or a == v3AnswerReclaimed then
      nums[#nums + 1] = string.format('%d', table.remove(numbers, 1)) .. ','
    end
  end
  out[#out + 1] = ARGV[3] .. answers .. table.concat(nums)
  return out
end

if ARGV[1] == 'read' then
  local now, raw, blk, cv, hs = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], ARGV[6]
  if not string.find(raw, V3_STATE) then
    return {'not a state'}
  end
  local l = string.byte(raw, v3StateLevelAt)
  local s = num(raw, v3StateSplitAt, 3)
  local out = {l, s, num(raw, v3StateCountAt, 4), num(raw, v3StateTokenAt, 7), num(raw, v3StateDueAt, 4),
    string.sub(raw, v3StateCallAt, v3StateCallAt + v3CallIDSize - 1)}
  for pos = 1, #blk, v3EntrySize do
    local ref = now + v3TokenAhead
    local t48 = num(blk, pos + v3EntryTokenAt - 1, 6)
    out[#out + 1] = string.sub(blk, pos, pos + v3DigestSize - 1)
    out[#out + 1] = num(blk, pos + v3EntryHashAt - 1, 3)
    out[#out + 1] = num(blk, pos + v3EntryPlaceAt - 1, 2)
    out[#out + 1] = ref - (ref - t48) % v3TokenModulus
  end
  for j = 1, #hs, v3BlockNameSize do
    local h = num(hs, j, v3BlockNameSize)
    local half = 2 ^ l
    local b = h % half
    if b < s then
      b = h % (2 * half)
    end
    out[#out + 1] = b
  end
  local _, e, u, done, runtil, id, fpw, aw = string.find(cv, V3_CALL)
  if not e or e ~= v3CallHeadSize then
    return {'not a call record'}
  end
  fpw, aw = string.byte(fpw), string.byte(aw)
  if fpw ~= string.byte(cv, v3CallFPWAt) or aw ~= string.byte(cv, v3CallAWAt) or
    u ~= string.sub(cv, v3CallUntilAt, v3CallUntilAt + v3TimeSize - 1) or
    done ~= string.sub(cv, v3CallDoneAt, v3CallDoneAt + v3TimeSize - 1) or
    runtil ~= string.sub(cv, v3CallResultUntilAt, v3CallResultUntilAt + v3TimeSize - 1) or
    id ~= string.sub(cv, v3CallIDAt, v3CallIDAt + v3CallIDSize - 1) then
    return {'offsets and pattern differ'}
  end
  u, done, runtil = num(u, 1, v3TimeSize), num(done, 1, v3TimeSize), num(runtil, 1, v3TimeSize)
  local n = (#cv - e) / (1 + aw + fpw)
  local states = string.sub(cv, e + 1, e + n)
  for _, x in ipairs({u, done, runtil, id, fpw, aw, n, states}) do
    out[#out + 1] = x
  end
  for p = 1, n do
    local a, rec = 1, 0
    if aw == v3AttemptSize then
      a = num(cv, e + n + (p - 1) * aw + 1, v3AttemptSize)
      if a >= v3RecoveredBit then
        a, rec = a - v3RecoveredBit, 1
      end
    end
    local from = e + n + n * aw + (p - 1) * fpw + 1
    local fp = string.gsub(string.sub(cv, from, from + fpw - 1), '%.+$', '')
    out[#out + 1] = a
    out[#out + 1] = rec
    out[#out + 1] = fp
  end
  return out
end

local state = V3_STATE_TAG .. be(tonumber(ARGV[2]), 1) .. be(tonumber(ARGV[3]), 3) .. be(tonumber(ARGV[4]), 4) ..
  be(tonumber(ARGV[5]), 7) .. be(tonumber(ARGV[6]), 4) .. ARGV[14]
local entry = ARGV[7] .. be(tonumber(ARGV[8]), 2) .. be(tonumber(ARGV[9]) % v3TokenModulus, 6)
local name = be(tonumber(ARGV[10]), v3BlockNameSize)
local states, fpw = ARGV[15], tonumber(ARGV[18])
local attempts, aw = '', 0
if ARGV[16] ~= '' then
  aw = v3AttemptSize
  for a in string.gmatch(ARGV[16], '[^,]+') do
    local n = tonumber((string.gsub(a, '%+$', '')))
    if string.sub(a, -1) == '+' then
      n = n + v3RecoveredBit
    end
    attempts = attempts .. be(n, v3AttemptSize)
  end
end
local fps = ''
if fpw > 0 then
  for fp in string.gmatch(ARGV[17] .. ',', '([^,]*),') do
    fps = fps .. fp .. string.rep('.', fpw - #fp)
  end
end
local call = V3_CALL_TAG .. be(tonumber(ARGV[11]), v3TimeSize) .. be(tonumber(ARGV[12]), v3TimeSize) ..
  be(tonumber(ARGV[13]), v3TimeSize) .. ARGV[14] .. string.char(fpw, aw) .. states .. attempts .. fps
return {state, entry, name, call}
