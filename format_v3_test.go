package idem

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The v3 formats (see format.go), pinned byte by byte before anything
// writes them: once a release writes them, never edit a row; add rows.

// v3GoldenCall is a call record of three places, with attempts and
// fingerprints: until 1700000030000000, done 1700000001000000, results
// kept until 1700086400000000, call id AAAAAAAAAAE; places C (attempt 1),
// X (attempt 3, recovered), T (attempt 2); fingerprints of 16 bytes:
// sixteen Z, none, "abc".
var v3GoldenCall = v3Call{
	until: 1700000030000000, done: 1700000001000000, resultUntil: 1700086400000000,
	callID: "AAAAAAAAAAE", fpw: 16, aw: 2,
	states:   "CXT",
	attempts: "\x00\x01\x80\x03\x00\x02",
	fps:      "ZZZZZZZZZZZZZZZZ" + "................" + "abc.............",
}

const v3GoldenCallBytes = "i3B" + "\x06\x0a\x24\x19\xe8\x03\x80" + "\x06\x0a\x24\x18\x2d\x82\x40" + "\x06\x0a\x38\x35\xf5\xa0\x00" + "AAAAAAAAAAE" + "\x10\x02" +
	"CXT" + "\x00\x01\x80\x03\x00\x02" + "ZZZZZZZZZZZZZZZZ" + "................" + "abc............."

// v3GoldenState: level 16, split point 59,464, 1,000,000 entries, last
// token 1700000000000123 given to call AAAAAAAAAAE, the key known to live
// until 1700000000 s.
var v3GoldenState = v3State{level: 16, split: 59464, count: 1000000, token: 1700000000000123, due: 1700000000, callID: "AAAAAAAAAAE"}

const v3GoldenStateBytes = "v3" + "\x10" + "\x00\xe8\x48" + "\x00\x0f\x42\x40" + "\x06\x0a\x24\x18\x1e\x40\x7b" + "\x65\x53\xf1\x00" + "AAAAAAAAAAE"

// v3GoldenEntry: digest "k@Y\xe1\xc6" and block hash 0xfaa63e (golden-1's),
// place 2, token 1700000000000123 (0x060a24181e407b: its low 48 bits kept).
const v3GoldenEntryBytes = "k@Y\xe1\xc6" + "\xfa\xa6\x3e" + "\x00\x02" + "\x0a\x24\x18\x1e\x40\x7b"

func TestFormatV3Golden(t *testing.T) {
	k := v3KeyOf(recordID("s", "golden-1"))
	assert.Equal(t, "k@Y\xe1\xc6", string(k.d5[:]), "digest: bytes 0-4 of the index digest")
	assert.Equal(t, uint32(0xfaa63e), k.h, "block hash: bytes 5-7 of the index digest")

	assert.Equal(t, v3GoldenEntryBytes, string(v3AppendEntry(nil, k, 2, 1700000000000123)))
	assert.Equal(t, "\x0a\xa6\x3e", string(v3AppendBlockName(nil, 0x0aa63e)))
	assert.Equal(t, "\x00\x00\x00", string(v3AppendBlockName(nil, 0)))
	assert.Equal(t, "\xff\xff\xff", string(v3AppendBlockName(nil, 1<<24-1)))
	assert.Equal(t, v3GoldenStateBytes, string(appendV3State(nil, v3GoldenState)))
	assert.Equal(t, "v3"+strings.Repeat("\x00", 30), string(appendV3State(nil, v3State{})))

	call, ok := appendV3Call(nil, v3GoldenCall)
	require.True(t, ok)
	assert.Equal(t, v3GoldenCallBytes, string(call))
	plain, ok := appendV3Call([]byte("kept"), v3Call{until: 1700000030000000, callID: "AAAAAAAAAAE", states: "PPC"})
	require.True(t, ok)
	assert.Equal(t, "kept"+"i3B"+"\x06\x0a\x24\x19\xe8\x03\x80"+strings.Repeat("\x00", 14)+"AAAAAAAAAAE"+"\x00\x00"+"PPC", string(plain))
}

// TestFormatV3Sizes: the sizes the formats promise.
func TestFormatV3Sizes(t *testing.T) {
	assert.Len(t, v3GoldenEntryBytes, v3EntrySize)
	assert.Len(t, v3GoldenStateBytes, v3StateSize)
	assert.Len(t, v3GoldenCallBytes, v3CallHeadSize+3*(1+2+16))
	assert.Equal(t, 3+3*v3TimeSize+v3CallIDSize+2, v3CallHeadSize)
	assert.Equal(t, v3EntrySize, v3DigestSize+3+2+6)
	assert.Equal(t, v3EntryPlaceAt, v3EntryHashAt+3)
	assert.Equal(t, v3EntryTokenAt, v3EntryPlaceAt+2)
	assert.Equal(t, v3PackedPlaceAt, v3PackedHashAt+3)
	assert.Equal(t, v3PackedSize, v3BlockNameSize+v3EntryTokenAt-1, "a packed message is its block and its entry but the token")
	assert.Equal(t, v3CallHeadSize, v3CallAWAt)
}

// TestFormatV3Placement: where the v3 index keeps an id's entry is part of
// the format: the same hash lands in the same block for the same state.
func TestFormatV3Placement(t *testing.T) {
	h := v3KeyOf(recordID("s", "golden-1")).h
	for _, c := range []struct {
		l    uint8
		s    uint32
		want uint32
	}{{0, 0, 0}, {3, 0, 6}, {3, 7, 14}, {20, 5, 0xaa63e}, {20, 0xaa63f, 0x1aa63e}, {23, 0x7aa63f, 0xfaa63e}, {23, 0x7aa63e, 0x7aa63e}, {24, 0, 0xfaa63e}} {
		b := v3Block(h, c.l, c.s)
		assert.Equal(t, c.want, b, "state %d %d", c.l, c.s)
		assert.Less(t, b, v3State{level: c.l, split: c.s}.blocks())
	}
	// Every block of a state is reached, and a split moves only the block
	// split: from (l, s) to (l, s+1), hash h moves only if its block was s,
	// to s + 2^l.
	const l = 4
	for s := uint32(0); s < 1<<l; s++ {
		seen := map[uint32]bool{}
		for h := uint32(0); h < 1<<12; h++ {
			b, after := v3Block(h, l, s), v3Block(h, l, s+1)
			seen[b] = true
			if b != s {
				assert.Equal(t, b, after, "h %#x moved, state %d %d", h, l, s)
			} else {
				assert.Contains(t, []uint32{s, s + 1<<l}, after)
			}
		}
		assert.Len(t, seen, int(v3State{level: l, split: s}.blocks()))
	}
}

// TestFormatV3Independent: an entry's digest and its block come from
// different bytes of the index digest, so ids of one block differ in all
// 40 stored bits.
func TestFormatV3Independent(t *testing.T) {
	var d [16]byte
	for i := range 1000 {
		id := recordID("s", strconv.Itoa(i))
		indexDigest(&d, id)
		k := v3KeyOf(id)
		assert.Equal(t, d[:5], k.d5[:])
		assert.Equal(t, uint32(d[5])<<16|uint32(d[6])<<8|uint32(d[7]), k.h)
	}
	// Within one block of a large index, the digests still take every
	// value of their first byte: nothing of the block is in them.
	first := map[byte]bool{}
	for i := range 1 << 16 {
		k := v3KeyOf(recordID("s", strconv.Itoa(i)))
		if v3Block(k.h, 8, 0) == 0xa5 {
			first[k.d5[0]] = true
		}
	}
	assert.Greater(t, len(first), 128, "digests of one block share bits")
}

func TestFormatV3ReadsWhatItWrites(t *testing.T) {
	m, ok := parseV3State(v3GoldenStateBytes)
	require.True(t, ok)
	assert.Equal(t, v3GoldenState, m)
	assert.Equal(t, uint32(65536+59464), m.blocks())
	top := v3State{level: 24, token: maxToken, count: 1<<32 - 1, due: 1<<32 - 1, callID: "___________"}
	m, ok = parseV3State(string(appendV3State(nil, top)))
	require.True(t, ok)
	assert.Equal(t, top, m)
	assert.Equal(t, uint32(1<<24), m.blocks())

	c, ok := parseV3Call(v3GoldenCallBytes)
	require.True(t, ok)
	assert.Equal(t, v3GoldenCall, c)
	assert.Equal(t, 3, c.places())
	for p, want := range []struct {
		n   int
		rec bool
		fp  string
	}{{1, false, "ZZZZZZZZZZZZZZZZ"}, {3, true, ""}, {2, false, "abc"}} {
		n, rec := c.attempt(p + 1)
		assert.Equal(t, want.n, n, "place %d", p+1)
		assert.Equal(t, want.rec, rec, "place %d", p+1)
		assert.Equal(t, want.fp, c.fingerprint(p+1), "place %d", p+1)
	}
	c, ok = parseV3Call("i3B\x06\x0a\x24\x19\xe8\x03\x80" + strings.Repeat("\x00", 14) + "AAAAAAAAAAE\x00\x00PPC")
	require.True(t, ok)
	n, rec := c.attempt(2)
	assert.Equal(t, 1, n)
	assert.False(t, rec)
	assert.Equal(t, "", c.fingerprint(3))
	assert.Equal(t, "PPC", c.states)
	empty, ok := parseV3Call("i3B" + strings.Repeat("\x00", 21) + "AAAAAAAAAAE\x00\x00")
	require.True(t, ok, "a call record of no place")
	assert.Zero(t, empty.places())

	e, ok := v3ReadEntry(v3GoldenEntryBytes)
	require.True(t, ok)
	assert.Equal(t, "k@Y\xe1\xc6", string(e.key.d5[:]))
	assert.Equal(t, uint32(0xfaa63e), e.key.h)
	assert.Equal(t, uint16(2), e.place)
	assert.Equal(t, int64(1700000000000123%(1<<48)), e.t48)
	assert.Equal(t, int64(1700000000000123), v3WholeToken(e.t48, 1700000000000123))
}

func TestFormatV3RefusesWhatIsNotIt(t *testing.T) {
	for name, raw := range map[string]string{
		"empty":               "",
		"v2":                  "v2 16 59464 1000000",
		"short":               v3GoldenStateBytes[:31],
		"call id":             v3GoldenStateBytes[:31] + "=",
		"call id short":       v3GoldenStateBytes[:21] + "\x00\x00\x00\x00\x00AAAAAA",
		"long":                v3GoldenStateBytes + "\x00",
		"tag":                 "v4" + v3GoldenStateBytes[2:],
		"level 25":            "v3\x19" + v3GoldenStateBytes[3:],
		"split not below 2^L": "v3\x02\x00\x00\x04" + v3GoldenStateBytes[6:],
		"split at level 24":   "v3\x18\x00\x00\x01" + v3GoldenStateBytes[6:],
		"token past 2^53":     "v3\x00\x00\x00\x00\x00\x00\x00\x00" + "\x20\x00\x00\x00\x00\x00\x00" + "\x00\x00\x00\x00" + strings.Repeat("\x00", 11),
	} {
		_, ok := parseV3State(raw)
		assert.False(t, ok, name)
	}
	_, ok := parseV3State("v3\x00\x00\x00\x00\x00\x00\x00\x00" + "\x1f\xff\xff\xff\xff\xff\xff" + "\x00\x00\x00\x00" + strings.Repeat("\x00", 11))
	assert.True(t, ok, "token 2^53 - 1")

	head := v3GoldenCallBytes[:v3CallHeadSize]
	for name, v := range map[string]string{
		"empty":                "",
		"v2 call record":       "i2B1700000000000000:0:0:AAAAAAAAAAA:0:P",
		"short header":         head[:v3CallHeadSize-1],
		"tag":                  "i3C" + v3GoldenCallBytes[3:],
		"time past 2^53":       "i3B\x20" + v3GoldenCallBytes[4:],
		"call id":              v3GoldenCallBytes[:v3CallIDAt-1] + "AAAAAAAAAA=" + v3GoldenCallBytes[v3CallIDAt-1+v3CallIDSize:],
		"fingerprint width":    head[:v3CallFPWAt-1] + "\x41\x00" + "P" + strings.Repeat(".", 65),
		"attempt width 1":      head[:v3CallFPWAt-1] + "\x00\x01" + "P\x01",
		"places do not divide": v3GoldenCallBytes[:len(v3GoldenCallBytes)-1],
	} {
		_, ok := parseV3Call(v)
		assert.False(t, ok, name)
	}

	_, ok = v3ReadEntry(v3GoldenEntryBytes[:15])
	assert.False(t, ok, "15 bytes")
	_, ok = v3ReadEntry(v3GoldenEntryBytes[:8] + "\x00\x00" + v3GoldenEntryBytes[10:])
	assert.False(t, ok, "place 0")

	for name, c := range map[string]v3Call{
		"call id short":      {callID: "AAAA"},
		"call id not base64": {callID: "AAAAAAAAAA="},
		"fps short":          {callID: "AAAAAAAAAAE", states: "PP", fpw: 2, fps: "ab"},
		"attempt width 1":    {callID: "AAAAAAAAAAE", states: "P", aw: 1, attempts: "\x01"},
		"time past 2^53":     {callID: "AAAAAAAAAAE", until: 1 << 53},
		"time negative":      {callID: "AAAAAAAAAAE", done: -1},
		"fingerprint width":  {callID: "AAAAAAAAAAE", states: "P", fpw: 65, fps: strings.Repeat(".", 65)},
	} {
		out, ok := appendV3Call([]byte("x"), c)
		assert.False(t, ok, name)
		assert.Equal(t, "x", string(out), name)
	}
}

// TestFormatV3WholeToken: a token is made whole from its low 48 bits by
// Redis's clock, a little ahead of it or 8 years behind.
func TestFormatV3WholeToken(t *testing.T) {
	const now = 1700000000000123
	for _, tok := range []int64{now, now + 1, now + 1<<31, now + 1<<32, now - 1, now - 1<<40, now + 1<<32 - 1<<48 + 1} {
		assert.Equal(t, tok, v3WholeToken(tok%(1<<48), now), "token %d", tok)
	}
	assert.NotEqual(t, int64(now+1<<32+1), v3WholeToken((now+1<<32+1)%(1<<48), now), "past the window ahead")
}

// TestFormatV3Lua: Lua reads what Go writes and Go what Lua writes, through
// format.lua's constants and patterns alone, on miniredis and redis-server.
func TestFormatV3Lua(t *testing.T) {
	body, err := os.ReadFile("testdata/lua/format_v3.lua")
	require.NoError(t, err)
	src := luaSource(string(body))
	prelude := strings.TrimSuffix(src, string(body))
	assert.NotContains(t, prelude, "function", "the v3 layout's definitions make no function")
	for _, name := range []string{"V3_STATE", "V3_CALL", "v3EntrySize", "v3TokenModulus", "v3RecoveredBit"} {
		assert.Contains(t, prelude, "local "+name+" = ")
	}
	assert.NotContains(t, prelude, "RECORD_LONG", "a definition sent unasked")

	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		run := func(args ...any) []any {
			t.Helper()
			r, err := b.Client.Eval(ctx, src, nil, args...).Slice()
			require.NoError(t, err)
			return r
		}
		now := int64(1700000000000200)
		k := v3KeyOf(recordID("s", "golden-1"))
		blk := v3AppendEntry(nil, k, 2, 1700000000000123)
		blk = v3AppendEntry(blk, v3Key{d5: [5]byte{0, 0, 0, 0, 1}, h: 0xffffff}, 65535, now+1<<31)
		blk = v3AppendEntry(blk, v3Key{d5: [5]byte{0xff, 0, 0, 0, 0}}, 1, now-1<<40)
		hashes := []uint32{k.h, 0, 0x7fffff, 0xffffff, 0x00e848, 0x01e848}
		var hs []byte
		for _, h := range hashes {
			hs = append(hs, byte(h>>16), byte(h>>8), byte(h))
		}

		got := run("read", now, v3GoldenStateBytes, string(blk), v3GoldenCallBytes, string(hs))
		want := []any{int64(16), int64(59464), int64(1000000), int64(1700000000000123), int64(1700000000), "AAAAAAAAAAE",
			"k@Y\xe1\xc6", int64(0xfaa63e), int64(2), int64(1700000000000123),
			"\x00\x00\x00\x00\x01", int64(0xffffff), int64(65535), now + 1<<31,
			"\xff\x00\x00\x00\x00", int64(0), int64(1), now - 1<<40}
		for _, h := range hashes {
			want = append(want, int64(v3Block(h, v3GoldenState.level, v3GoldenState.split)))
		}
		want = append(want, int64(1700000030000000), int64(1700000001000000), int64(1700086400000000), "AAAAAAAAAAE",
			int64(16), int64(2), int64(3), "CXT",
			int64(1), int64(0), "ZZZZZZZZZZZZZZZZ",
			int64(3), int64(1), "",
			int64(2), int64(0), "abc")
		assert.Equal(t, want, got)

		for name, args := range map[string][]any{
			"not a state":       {"read", now, "v2 0 0 0", "", v3GoldenCallBytes, ""},
			"not a call record": {"read", now, v3GoldenStateBytes, "", "i2B1700000000000000:0:0:AAAAAAAAAAA:0:P", ""},
		} {
			assert.Equal(t, []any{name}, run(args...), name)
		}

		got = run("write", 16, 59464, 1000000, "1700000000000123", 1700000000,
			"k@Y\xe1\xc6\xfa\xa6\x3e", 2, "1700000000000123", 0x0aa63e,
			"1700000030000000", "1700000001000000", "1700086400000000", "AAAAAAAAAAE", "CXT", "1,3+,2",
			"ZZZZZZZZZZZZZZZZ,,abc", 16)
		assert.Equal(t, []any{v3GoldenStateBytes, v3GoldenEntryBytes, "\x0a\xa6\x3e", v3GoldenCallBytes}, got)
		m, ok := parseV3State(got[0].(string))
		require.True(t, ok)
		assert.Equal(t, v3GoldenState, m)
		c, ok := parseV3Call(got[3].(string))
		require.True(t, ok)
		assert.Equal(t, v3GoldenCall, c)

		got = run("write", 24, 0, 0, now, 0, "\x00\x00\x00\x00\x00\xff\xff\xff", 65535, now, 1<<24-1,
			now+30_000_000, 0, 0, "AAAAAAAAAAE", "PPC", "", "", 0)
		m, ok = parseV3State(got[0].(string))
		require.True(t, ok)
		assert.Equal(t, v3State{level: 24, token: now, callID: "AAAAAAAAAAE"}, m)
		e, ok := v3ReadEntry(got[1].(string))
		require.True(t, ok)
		assert.Equal(t, uint16(65535), e.place)
		assert.Equal(t, now, v3WholeToken(e.t48, now))
		assert.Equal(t, "\xff\xff\xff", got[2])
		c, ok = parseV3Call(got[3].(string))
		require.True(t, ok)
		assert.Equal(t, v3Call{until: now + 30_000_000, callID: "AAAAAAAAAAE", states: "PPC"}, c)
	})
}

// TestFormatV3Keys: the v3 index and call records have names of their own,
// apart from the layouts' before and from every record key.
func TestFormatV3Keys(t *testing.T) {
	assert.Equal(t, "idem:i3", v3IndexKey(DefaultPrefix, false, 0))
	assert.Equal(t, "idem:c3:", v3CallBase(DefaultPrefix, false, 0))
	assert.Equal(t, "idem:c3:\x0a\x24\x18\x1e\x40\x7b", v3CallKey(v3CallBase(DefaultPrefix, false, 0), 1700000000000123), "the token's low 6 bytes")
	tag := slotTag(42)
	assert.Equal(t, "idem:{"+tag+"}i3", v3IndexKey(DefaultPrefix, true, 42))
	assert.Equal(t, "idem:{"+tag+"}c3:", v3CallBase(DefaultPrefix, true, 42))
	assert.Equal(t, uint16(42), keySlot(v3IndexKey(DefaultPrefix, true, 42)))
	assert.Equal(t, uint16(42), keySlot(v3CallBase(DefaultPrefix, true, 42)+"1700000000000123"))

	for _, name := range []string{v3IndexKey(DefaultPrefix, false, 0), v3IndexKey(DefaultPrefix, true, 42)} {
		assert.NotEqual(t, oldIndexKey(DefaultPrefix), name)
		assert.NotEqual(t, prefixRecordKey(DefaultPrefix), name)
		assert.Error(t, checkRecordID(idOfKey(name)), "%s reads as a record key", name)
	}
	// v2's call records were prefix + "c:" + the token in decimal.
	assert.False(t, strings.HasPrefix(v3CallBase(DefaultPrefix, false, 0), DefaultPrefix+"c:"))
}
