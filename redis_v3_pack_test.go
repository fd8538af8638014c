package idem

import (
	"context"
	"os"
	"strconv"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// v3PackGoldenKeys are four messages: AAAAA at hash 6, BBBBB at 0xe, CCCCC
// at 1, DDDDD at 6; in an index of level 3 and split point 7 their blocks
// are 6, 14, 1 and 6.
var v3PackGoldenKeys = []v3Key{
	{d5: [5]byte([]byte("AAAAA")), h: 0x06},
	{d5: [5]byte([]byte("BBBBB")), h: 0x0e},
	{d5: [5]byte([]byte("CCCCC")), h: 0x01},
	{d5: [5]byte([]byte("DDDDD")), h: 0x06},
}

// TestV3PackGolden pins the claim argument and reply byte by byte.
func TestV3PackGolden(t *testing.T) {
	p := &v3Packer{level: 3, split: 7}
	got, ok := p.pack(v3PackGoldenKeys)
	require.True(t, ok)
	assert.Equal(t, ""+
		"\x00\x00\x01"+"CCCCC"+"\x00\x00\x01"+"\x00\x01"+
		"\x00\x00\x06"+"AAAAA"+"\x00\x00\x06"+"\x00\x02"+
		"\x00\x00\x06"+"DDDDD"+"\x00\x00\x06"+"\x00\x03"+
		"\x00\x00\x0e"+"BBBBB"+"\x00\x00\x0e"+"\x00\x04", string(got))
	for i, place := range []int{2, 4, 1, 3} {
		assert.Equal(t, place, p.place(i), "message %d", i)
		assert.Equal(t, i, p.index(place))
	}

	// Token 1700000000000123, level 4 split point 0 after the call (block 7
	// split); by place: claimed, busy 2500 ms left, taken over at attempt
	// 2, done.
	ans := make([]v3Answer, 4)
	tok, _, err := p.decode("\x06\x0a\x24\x18\x1e\x40\x7b"+"\x04\x00\x00\x00"+"PBTD"+"2500,2,"+"\x0a\x24\x18\x1e\x40\x00\x00\x03", ans)
	require.NoError(t, err)
	assert.Equal(t, int64(1700000000000123), tok)
	assert.Equal(t, []v3Answer{{code: v3AnswerBusy, n: 2500}, {code: v3AnswerDone, n: 0x0a24181e4000, attempt: 3}, {code: v3AnswerClaimed}, {code: v3AnswerTakenOver, n: 2}}, ans)
	assert.Equal(t, uint8(4), p.level)
	assert.Equal(t, uint32(0), p.split)
	// The next call packs by the state read: hash 0x0f was in block 7, now
	// in block 15.
	got, _ = p.pack([]v3Key{v3PackGoldenKeys[0], {d5: [5]byte([]byte("EEEEE")), h: 0x0f}})
	assert.Equal(t, "\x00\x00\x06"+"AAAAA"+"\x00\x00\x06"+"\x00\x01"+"\x00\x00\x0f"+"EEEEE"+"\x00\x00\x0f"+"\x00\x02", string(got))
}

// TestV3DecodeRefuses: a reply that is not one is ErrCorrupt and leaves
// the state the packer packs by as it was.
func TestV3DecodeRefuses(t *testing.T) {
	head := "\x06\x0a\x24\x18\x1e\x40\x7b" + "\x04\x00\x00\x00"
	for name, r := range map[string]string{
		"empty":                "",
		"too few answers":      head + "PBT",
		"unknown answer":       head + "PBTZ" + "1,2,",
		"number missing":       head + "PBTD" + "2500,",
		"number not ended":     head + "PBTD" + "2500,2",
		"empty number":         head + "PBTD" + ",2,",
		"leading zero":         head + "PBTD" + "02500,2,",
		"number of 19 digits":  head + "PBTD" + "1234567890123456789,2,",
		"bytes after":          head + "PBTD" + "2500,2,x",
		"level 25":             "\x06\x0a\x24\x18\x1e\x40\x7b" + "\x19\x00\x00\x00" + "PBTD" + "2500,2,",
		"split not below 2^L":  "\x06\x0a\x24\x18\x1e\x40\x7b" + "\x03\x00\x00\x09" + "PBTD" + "2500,2,",
		"token above 2^53 - 1": "\x20\x00\x00\x00\x00\x00\x00" + "\x04\x00\x00\x00" + "PBTD" + "2500,2,",
	} {
		p := &v3Packer{level: 3, split: 7}
		p.pack(v3PackGoldenKeys)
		_, _, err := p.decode(r, make([]v3Answer, 4))
		assert.ErrorIs(t, err, ErrCorrupt, name)
		assert.Equal(t, uint8(3), p.level, name)
		assert.Equal(t, uint32(7), p.split, name)
	}
	p := &v3Packer{}
	p.pack(v3PackGoldenKeys)
	_, _, err := p.decode(head+"PPPP", make([]v3Answer, 3))
	assert.ErrorIs(t, err, ErrCorrupt, "answers for another batch size")
	tok, _, err := p.decode("\x00\x00\x00\x00\x00\x00\x00"+"\x00\x00\x00\x00"+"DDUB"+"\x00\x00\x00\x00\x00\x07\x00\x01"+"\x00\x00\x00\x00\x00\x08\x00\x01"+"0,", make([]v3Answer, 4))
	require.NoError(t, err, "a call that claimed nothing, 0 ms left")
	assert.Zero(t, tok)
}

// v3EncodeReply is the reply of a call of token, ending in state (l, s),
// answering ans by place, as the claim script writes it (see format.go).
func v3EncodeReply(token int64, l uint8, s uint32, ans []v3Answer) string {
	b := []byte{byte(token >> 48), byte(token >> 40), byte(token >> 32), byte(token >> 24), byte(token >> 16), byte(token >> 8), byte(token),
		l, byte(s >> 16), byte(s >> 8), byte(s)}
	for _, a := range ans {
		b = append(b, a.code)
	}
	for _, a := range ans {
		switch {
		case a.code == v3AnswerDone || a.code == v3AnswerExpired:
			b = append(b, byte(a.n>>40), byte(a.n>>32), byte(a.n>>24), byte(a.n>>16), byte(a.n>>8), byte(a.n), byte(a.attempt>>8), byte(a.attempt))
		case a.code == v3AnswerEarlier:
			b = append(b, byte(a.n>>40), byte(a.n>>32), byte(a.n>>24), byte(a.n>>16), byte(a.n>>8), byte(a.n),
				byte(a.place>>8), byte(a.place), byte(a.attempt>>8), byte(a.attempt))
		case v3AnswerNumbered(a.code):
			b = strconv.AppendInt(b, a.n, 10)
			b = append(b, ',')
		}
	}
	return string(b)
}

var v3AnswerCodes = []byte{v3AnswerClaimed, v3AnswerRepeat, v3AnswerDone, v3AnswerExpired, v3AnswerBusy,
	v3AnswerTakenOver, v3AnswerReclaimed, v3AnswerMismatch, v3AnswerNotOurs, v3AnswerRecord, v3AnswerEarlier, v3AnswerCallMissing}

// FuzzV3Pack packs arbitrary keys in an arbitrary index state, checks the
// argument against its format, answers it by a reference encoder and reads
// the answers back in the caller's order; and reads an arbitrary reply
// without panicking, exactly as a reference encoder would write what it
// accepts.
func FuzzV3Pack(f *testing.F) {
	f.Add([]byte("AAAAA\x00\x00\x06BBBBB\x00\x00\x0eCCCCC\x00\x00\x01AAAAA\x00\x00\x06"), uint8(3), uint32(7), []byte("PBTD2500,2,"))
	f.Add([]byte{}, uint8(0), uint32(0), []byte{})
	f.Add([]byte("\xff\xff\xff\xff\xff\xff\xff\xff"), uint8(24), uint32(0), []byte("B0,"))
	f.Fuzz(func(t *testing.T, data []byte, level uint8, split uint32, tail []byte) {
		level %= v3MaxLevel + 1
		split %= 1 << level
		if level == v3MaxLevel {
			split = 0
		}
		keys := make([]v3Key, min(len(data)/8, 2000))
		for i := range keys {
			d := data[8*i:]
			keys[i] = v3Key{d5: [5]byte(d[:5]), h: uint32(d[5])<<16 | uint32(d[6])<<8 | uint32(d[7])}
		}
		p := &v3Packer{level: level, split: split}
		arg, ok := p.pack(keys)
		require.True(t, ok)
		require.Len(t, arg, len(keys)*v3PackedSize)
		seen := make([]bool, len(keys))
		prev, prevIdx := uint32(0), -1
		for j := range keys {
			e := arg[j*v3PackedSize : (j+1)*v3PackedSize]
			i := p.index(j + 1)
			require.False(t, seen[i], "message %d packed twice", i)
			seen[i] = true
			k := keys[i]
			b := uint32(e[0])<<16 | uint32(e[1])<<8 | uint32(e[2])
			assert.Equal(t, v3Block(k.h, level, split), b)
			assert.Equal(t, k.d5[:], e[v3PackedDigestAt-1:v3PackedDigestAt-1+5])
			assert.Equal(t, j+1, int(e[v3PackedPlaceAt-1])<<8|int(e[v3PackedPlaceAt]))
			assert.Equal(t, k.h, uint32(e[v3PackedHashAt-1])<<16|uint32(e[v3PackedHashAt])<<8|uint32(e[v3PackedHashAt+1]))
			assert.Equal(t, j+1, p.place(i))
			require.True(t, b > prev || b == prev && i > prevIdx || j == 0, "not sorted by block, then the caller's order")
			prev, prevIdx = b, i
		}

		// Answers by place from the data, a reply of them, read back.
		byPlace := make([]v3Answer, len(keys))
		for j := range byPlace {
			c := v3AnswerCodes[int(data[8*p.index(j+1)])%len(v3AnswerCodes)]
			byPlace[j] = v3Answer{code: c}
			switch {
			case c == v3AnswerDone || c == v3AnswerExpired:
				byPlace[j].n, byPlace[j].attempt = int64(data[8*p.index(j+1)+1])*1000003, uint16(data[8*p.index(j+1)+2])
			case c == v3AnswerEarlier:
				byPlace[j].n, byPlace[j].attempt, byPlace[j].place = int64(data[8*p.index(j+1)+1])*1000003, uint16(data[8*p.index(j+1)+2]), uint16(data[8*p.index(j+1)+3])
			case v3AnswerNumbered(c):
				byPlace[j].n = int64(data[8*p.index(j+1)+1]) * 1000003
			}
		}
		nl, ns := uint8(min(int(level)+1, v3MaxLevel)), uint32(0)
		ans := make([]v3Answer, len(keys))
		tok, _, err := p.decode(v3EncodeReply(1700000000000123, nl, ns, byPlace), ans)
		require.NoError(t, err)
		assert.Equal(t, int64(1700000000000123), tok)
		for j, a := range byPlace {
			assert.Equal(t, a, ans[p.index(j+1)])
		}
		assert.Equal(t, nl, p.level)
		assert.Equal(t, ns, p.split)

		// Any reply: read exactly as written (Redis's refusal after the
		// numbers, when an answer is R), or refused.
		r := "\x00\x06\x0a\x24\x18\x1e\x40" + "\x02\x00\x00\x01" + string(tail)
		tok, refusal, err := p.decode(r, ans)
		if err != nil {
			assert.ErrorIs(t, err, ErrCorrupt)
			return
		}
		byPlace = byPlace[:0]
		for j := range keys {
			byPlace = append(byPlace, ans[p.index(j+1)])
		}
		assert.Equal(t, r, v3EncodeReply(tok, 2, 1, byPlace)+refusal)
	})
}

// v3PackBatch is a batch of n messages' v3 keys, of ids of one scope.
func v3PackBatch(n int) []v3Key {
	keys := make([]v3Key, n)
	for i := range keys {
		keys[i] = v3KeyOf(recordID("s", "message-"+strconv.Itoa(i)))
	}
	return keys
}

// TestV3PackAllocates: packing a batch and reading its reply allocate
// nothing once the packer's buffers have grown.
func TestV3PackAllocates(t *testing.T) {
	keys := v3PackBatch(500)
	p := &v3Packer{level: 16, split: 59464}
	p.pack(keys)
	byPlace := make([]v3Answer, len(keys))
	for j := range byPlace {
		byPlace[j] = v3Answer{code: v3AnswerClaimed}
	}
	byPlace[7] = v3Answer{code: v3AnswerBusy, n: 29000}
	reply := v3EncodeReply(1700000000000123, 16, 59464, byPlace)
	ans := make([]v3Answer, len(keys))
	allocs := testing.AllocsPerRun(20, func() {
		p.pack(keys)
		if _, _, err := p.decode(reply, ans); err != nil {
			t.Fatal(err)
		}
	})
	assert.Zero(t, allocs, "allocations a batch of 500")

	_, ok := p.pack(make([]v3Key, v3MaxPlaces))
	assert.True(t, ok, "a batch of 65535")
	arg, ok := p.pack(make([]v3Key, v3MaxPlaces+1))
	assert.False(t, ok, "more places than PLACE2 holds")
	assert.Nil(t, arg)
}

// BenchmarkV3Pack: a batch's packing and reply, per message (ns/op is a
// batch's; msg/s and allocs/msg as reported), with the keys' digests made
// in the loop or before it.
func BenchmarkV3Pack(b *testing.B) {
	for _, n := range []int{10, 100, 500} {
		ids := make([]string, n)
		for i := range ids {
			ids[i] = recordID("s", "message-"+strconv.Itoa(i))
		}
		keys := v3PackBatch(n)
		p := &v3Packer{level: 16, split: 59464}
		p.pack(keys)
		byPlace := make([]v3Answer, n)
		for j := range byPlace {
			byPlace[j] = v3Answer{code: v3AnswerClaimed}
		}
		reply := v3EncodeReply(1700000000000123, 16, 59464, byPlace)
		ans := make([]v3Answer, n)
		for _, digests := range []bool{false, true} {
			name := "batch=" + strconv.Itoa(n)
			if digests {
				name += "/digests"
			}
			b.Run(name, func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if digests {
						for i, id := range ids {
							keys[i] = v3KeyOf(id)
						}
					}
					p.pack(keys)
					if _, _, err := p.decode(reply, ans); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/msg")
			})
		}
	}
}

// TestV3PackLua: a script reads the packed argument with format.lua's
// constants and writes the reply that the packer reads, on miniredis and
// redis-server.
func TestV3PackLua(t *testing.T) {
	body, err := os.ReadFile("testdata/lua/format_v3.lua")
	require.NoError(t, err)
	src := luaSource(string(body))
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		p := &v3Packer{level: 3, split: 7}
		arg, ok := p.pack(v3PackGoldenKeys)
		require.True(t, ok)
		head := "\x06\x0a\x24\x18\x1e\x40\x7b" + "\x04\x00\x00\x00"
		r, err := b.Client.Eval(context.Background(), src, nil, "claim", string(arg), head, "PBTA", "29000,2,3").Slice()
		require.NoError(t, err)
		want := []any{}
		for j := range v3PackGoldenKeys {
			k := v3PackGoldenKeys[p.index(j+1)]
			blk := v3Block(k.h, 3, 7)
			want = append(want, string(v3AppendBlockName(nil, blk)), string(k.d5[:]), int64(j+1), int64(k.h))
		}
		want = append(want, head+"PBTA"+"29000,2,3,")
		assert.Equal(t, want, r)
		ans := make([]v3Answer, len(v3PackGoldenKeys))
		tok, _, err := p.decode(r[len(r)-1].(string), ans)
		require.NoError(t, err)
		assert.Equal(t, int64(1700000000000123), tok)
		assert.Equal(t, []v3Answer{{code: v3AnswerBusy, n: 29000}, {code: v3AnswerReclaimed, n: 3}, {code: v3AnswerClaimed}, {code: v3AnswerTakenOver, n: 2}}, ans)
	})
}
