package idem

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The record format rule holds for compact claims and markers too: these
// index entries and call records are written exactly as the self-sizing
// layout ("v2") writes them, and every later release must read them as
// this one does, with markers or without. Never edit a row: add rows.
//
// An index key (idem:i:0 on one server) is a hash: its field "" is
// "v2 L S N" (see lib.lua), every other field a block of 16-byte entries
// DIGEST8 PLACE2 TOKEN6 named by its number in 4 bytes. A call record
// idem:c:TOKEN is
// "i2B" LEASE_UNTIL_US ":" DONE_US ":" RESULT_UNTIL_US ":" ATTEMPT ":" FPW ":" STATES FPS.
// In the rows, DONE is replaced by when the call completed and UNTIL by
// when its results' retention ends, in Redis's microseconds, as each row
// says.
var markerFormat = []struct {
	name string
	// v3 is the row's call record in the v3 layout, its zero value for
	// none: its done and result retention are set as doneAgo and untilIn
	// say.
	v3 v3Call
	// call is the call record in v2, "" for none; place is the entry's
	// place in it.
	call  string
	place uint16
	// doneAgo is how long before the read the call completed its claims;
	// untilIn how long after the read the retention of its results ends.
	doneAgo, untilIn time.Duration
	check            func(t *testing.T, k *Keeper, key string, token int64)
}{
	{"marker within the retention", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "C"}, "i2B1700000000000000:DONE:UNTIL:AAAAAAAAAAA:0:C", 1, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		assert.True(t, out.Replayed)
		assert.Empty(t, out.Value)
		assert.Equal(t, token, out.Token)
		res, err := Consume(context.Background(), k, "s", []string{key}, func(s string) string { return s },
			func(context.Context, string) error { t.Error("a marked message ran"); return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageReplayed, res[0].Status)
		assert.True(t, res[0].Ack)
	}},
	{"marker past the retention", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "C"}, "i2B1700000000000000:DONE:UNTIL:AAAAAAAAAAA:0:C", 1, 48 * time.Hour, -24 * time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key)
		assert.ErrorIs(t, err, ErrResultExpired)
		res, err := Consume(context.Background(), k, "s", []string{key}, func(s string) string { return s },
			func(context.Context, string) error { t.Error("a marked message ran"); return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageReplayed, res[0].Status)
	}},
	{"entry whose call record is gone", v3Call{}, "", 1, 0, 0, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.Equal(t, 1, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), token)
	}},
	{"second place of a call", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "XC"}, "i2B1700000000000000:DONE:UNTIL:AAAAAAAAAAA:0:XC", 2, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		assert.True(t, out.Replayed)
		assert.Equal(t, token, out.Token)
	}},
	{"place not claimed by the call", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "CX"}, "i2B1700000000000000:DONE:UNTIL:AAAAAAAAAAA:0:CX", 2, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim, "an entry whose place the call did not claim is stale")
		assert.Equal(t, 1, out.Claim.Attempt())
	}},
	{"marker with a fingerprint", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "C", fpw: 16, fps: fingerprintDigest([]byte("body"))}, "i2B1700000000000000:DONE:UNTIL:AAAAAAAAAAA:16:C" + fingerprintDigest([]byte("body")), 1, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("other")))
		assert.ErrorIs(t, err, ErrMismatch)
		out, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("body")))
		require.NoError(t, err)
		assert.True(t, out.Replayed)
	}},
	{"fingerprints padded to the call's widest", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "CC", fpw: 16, fps: fingerprintDigest([]byte("body")) + "................"}, "i2B1700000000000000:DONE:UNTIL:AAAAAAAAAAA:16:CC" + fingerprintDigest([]byte("body")) + "................", 2, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("body")))
		assert.ErrorIs(t, err, ErrMismatch, "the second place has no fingerprint")
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		assert.True(t, out.Replayed)
	}},
	{"compact claim, lease alive", v3Call{until: 4102444800000000, callID: "AAAAAAAAAAE", states: "P"}, "i2B4102444800000000:0:0:AAAAAAAAAAA:0:P", 1, 0, 0, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key)
		assert.ErrorIs(t, err, ErrInProgress)
		res, err := Consume(context.Background(), k, "s", []string{key}, func(s string) string { return s },
			func(context.Context, string) error { t.Error("a held message ran"); return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageRetry, res[0].Status)
		assert.ErrorIs(t, res[0].Err, ErrInProgress)
	}},
	{"compact claim, lease run out", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "P"}, "i2B1700000000000000:0:0:AAAAAAAAAAA:0:P", 1, 0, 0, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.True(t, out.Claim.Recovered())
		assert.Equal(t, 2, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), token)
	}},
	{"compact claim released", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "R"}, "i2B1700000000000000:0:0:AAAAAAAAAAA:0:R", 1, 0, 0, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.False(t, out.Claim.Recovered())
		assert.Equal(t, 2, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), token)
	}},
	{"compact claim forgotten", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "F"}, "i2B1700000000000000:DONE:UNTIL:AAAAAAAAAAA:0:F", 1, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.Equal(t, 1, out.Claim.Attempt())
	}},
}

// blockOf is where an index of state "v2 l sp N" keeps the entry whose
// digest starts with d8, as lib.lua's index_place computes it.
func blockOf(d8 [8]byte, l, sp uint32) uint32 {
	h := uint32(d8[4])<<24 | uint32(d8[5])<<16 | uint32(d8[6])<<8 | uint32(d8[7])
	half := uint64(1) << l
	b := uint64(h) % half
	if b < uint64(sp) {
		b = uint64(h) % (2 * half)
	}
	return uint32(b)
}

// TestMarkerPlacementV2: where the index keeps an id's entry is part of the
// format: the same id must have the same digest and index key, and land in
// the same block for the same state of the index.
func TestMarkerPlacementV2(t *testing.T) {
	s, err := NewRedisStore(redistest.Miniredis(t).Client, withLayoutV2())
	require.NoError(t, err)
	require.NoError(t, s.layoutReady(context.Background()))
	e := s.entry(recordID("s", "golden-1"))
	assert.Equal(t, "idem:i:0", e.key)
	assert.Equal(t, "k@Y\xe1\xc6\xfa\xa6>", string(e.d8[:]))
	for _, c := range []struct{ l, sp, want uint32 }{{0, 0, 0}, {3, 0, 6}, {3, 7, 14}, {20, 5, 0xaa63e}, {20, 0xaa63f, 0x1aa63e}} {
		assert.Equal(t, c.want, blockOf(e.d8, c.l, c.sp), "state v2 %d %d", c.l, c.sp)
	}
}

// TestMarkerFormatV2StillReads writes each row's call record and its entry,
// in an index of a few blocks, and reads it with Keepers with and without
// markers, of the v2 layout: the format is
// v2's.
func TestMarkerFormatV2StillReads(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s, err := NewRedisStore(b.Client, withLayoutV2())
		require.NoError(t, err)
		require.NoError(t, s.layoutReady(ctx))
		keepers := map[string][]Option{
			"markers":         {withLayoutV2()},
			"without markers": {withLayoutV2(), WithoutMarkers()},
		}
		const l, sp = 2, 1 // 5 blocks
		for kname, opts := range keepers {
			k := newKeeper(t, b, opts...)
			for i, row := range markerFormat {
				t.Run(kname+"/"+row.name, func(t *testing.T) {
					key := kname + "/" + row.name
					token := int64(1700000000000000 + i)
					now, err := b.Client.Time(ctx).Result()
					require.NoError(t, err)
					call := row.call
					if row.doneAgo > 0 {
						call = replaceMark(call, "DONE", now.Add(-row.doneAgo).UnixMicro())
						call = replaceMark(call, "UNTIL", now.Add(row.untilIn).UnixMicro())
					}
					tok := strconv.FormatInt(token, 10)
					e := s.entry(recordID("s", key))
					var entry [16]byte
					copy(entry[:8], e.d8[:])
					entry[8], entry[9] = byte(row.place>>8), byte(row.place)
					for j := 0; j < 6; j++ {
						entry[15-j] = byte(token >> (8 * j))
					}
					blk := blockOf(e.d8, l, sp)
					field := string([]byte{byte(blk >> 24), byte(blk >> 16), byte(blk >> 8), byte(blk)})
					old, err := b.Client.HGet(ctx, e.key, field).Result()
					if err != nil {
						old = ""
					}
					require.NoError(t, b.Client.HSet(ctx, e.key, "", "v2 2 1 10", field, old+string(entry[:])).Err())
					if call != "" {
						require.NoError(t, b.Client.Set(ctx, "idem:c:"+tok, call, time.Hour).Err())
					}
					row.check(t, k, key, token)
				})
			}
		}
	})
}

// TestMarkerFormatV3StillReads writes each row's call record and its
// entry, in a v3 index of a few blocks, and reads it with Keepers with and
// without markers: the format is v3's (format.go, "The v3 layout").
func TestMarkerFormatV3StillReads(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s, err := NewRedisStore(b.Client)
		require.NoError(t, err)
		keepers := map[string][]Option{"markers": nil, "without markers": {WithoutMarkers()}}
		const l, sp = 2, 1 // 5 blocks
		for kname, opts := range keepers {
			k := newKeeper(t, b, opts...)
			for i, row := range markerFormat {
				t.Run(kname+"/"+row.name, func(t *testing.T) {
					key := kname + "/" + row.name
					now, err := b.Client.Time(ctx).Result()
					require.NoError(t, err)
					// A v3 token is Redis's clock at the call's claim: an
					// entry past its call record's keep is stale, one
					// younger without its call record unavailable (moving).
					token := now.Add(-time.Minute).UnixMicro() + int64(i)
					if row.v3.callID == "" {
						token = now.Add(-30*24*time.Hour).UnixMicro() + int64(i)
					}
					call := row.v3
					if row.doneAgo > 0 {
						call.done, call.resultUntil = now.Add(-row.doneAgo).UnixMicro(), now.Add(row.untilIn).UnixMicro()
					}
					id := recordID("s", key)
					index, calls := s.v3Names(s.key(id))
					e := v3KeyOf(id)
					field := string(v3AppendBlockName(nil, v3Block(e.h, l, sp)))
					old, err := b.Client.HGet(ctx, index, field).Result()
					if err != nil {
						old = ""
					}
					state := appendV3State(nil, v3State{level: l, split: sp, count: 10, token: token})
					require.NoError(t, b.Client.HSet(ctx, index, "", state, field, old+string(v3AppendEntry(nil, e, row.place, token))).Err())
					if call.callID != "" {
						rec, ok := appendV3Call(nil, call)
						require.True(t, ok)
						require.NoError(t, b.Client.Set(ctx, v3CallKey(calls, token), rec, time.Hour).Err())
					}
					row.check(t, k, key, token)
				})
			}
		}
	})
}

// TestIndexOfAnotherLayoutIsRefused: an index key that another version of
// idem laid out (the first layout's "v1 scale=N") is refused with
// ErrInvalidConfig by every call that meets it, and nothing is written.
func TestIndexOfAnotherLayoutIsRefused(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		require.NoError(t, b.Client.HSet(ctx, "idem:i:0", "", "v1 scale=2097152").Err())
		k := newKeeper(t, b)
		consumeRefused(t, k, []string{"a", "b"})
		_, err := k.Begin(ctx, "s", "c")
		assert.ErrorIs(t, err, ErrInvalidConfig)
		_, err = k.Inspect(ctx, "s", "c")
		assert.ErrorIs(t, err, ErrInvalidConfig)
		keys, err := b.Client.Keys(ctx, "*").Result()
		require.NoError(t, err)
		assert.Equal(t, []string{"idem:i:0"}, keys, "written beside an index of another layout")
		n, err := b.Client.HLen(ctx, "idem:i:0").Result()
		require.NoError(t, err)
		assert.EqualValues(t, 1, n)
	})
}

// replaceMark puts v in place of mark in a call record.
func replaceMark(call, mark string, v int64) string {
	return strings.Replace(call, mark, strconv.FormatInt(v, 10), 1)
}
