package idem

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The record format rule holds for compact claims and markers too: these
// index entries and call records are written exactly as the first compact
// layout ("v1 scale=N") writes them, and every later release must read them
// as this one does, with markers or without. Never edit a row: add rows.
//
// An index key (idem:i:N on one server) is a hash: its field "" is the
// layout, every other field a block of 16-byte entries DIGEST7 PLACE2
// TOKEN7. A call record idem:c:TOKEN is
// "i1B" LEASE_UNTIL_US ":" DONE_US ":" ATTEMPT ":" FPW ":" STATES FPS.
// In the rows, DONE is replaced by when the call completed, in Redis's
// microseconds, as each row says.
var markerFormatV1 = []struct {
	name string
	// call is the call record; place is the entry's place in it.
	call  string
	place uint16
	// doneAgo is how long before the read the call completed its claims.
	doneAgo time.Duration
	check   func(t *testing.T, k *Keeper, key string, token int64)
}{
	{"marker within the retention", "i1B1700000000000000:DONE:AAAAAAAAAAA:0:C", 1, time.Minute, func(t *testing.T, k *Keeper, key string, token int64) {
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
	{"marker past the retention", "i1B1700000000000000:DONE:AAAAAAAAAAA:0:C", 1, 48 * time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key)
		assert.ErrorIs(t, err, ErrResultExpired)
		res, err := Consume(context.Background(), k, "s", []string{key}, func(s string) string { return s },
			func(context.Context, string) error { t.Error("a marked message ran"); return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageReplayed, res[0].Status)
	}},
	{"marker past the marker retention", "i1B1700000000000000:DONE:AAAAAAAAAAA:0:C", 1, 10 * 24 * time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.Equal(t, 1, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), token)
	}},
	{"second place of a call", "i1B1700000000000000:DONE:AAAAAAAAAAA:0:XC", 2, time.Minute, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		assert.True(t, out.Replayed)
		assert.Equal(t, token, out.Token)
	}},
	{"place not claimed by the call", "i1B1700000000000000:DONE:AAAAAAAAAAA:0:CX", 2, time.Minute, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim, "an entry whose place the call did not claim is stale")
		assert.Equal(t, 1, out.Claim.Attempt())
	}},
	{"marker with a fingerprint", "i1B1700000000000000:DONE:AAAAAAAAAAA:16:C" + fingerprintDigest([]byte("body")), 1, time.Minute, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("other")))
		assert.ErrorIs(t, err, ErrMismatch)
		out, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("body")))
		require.NoError(t, err)
		assert.True(t, out.Replayed)
	}},
	{"fingerprints padded to the call's widest", "i1B1700000000000000:DONE:AAAAAAAAAAA:16:CC" + fingerprintDigest([]byte("body")) + "................", 2, time.Minute, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("body")))
		assert.ErrorIs(t, err, ErrMismatch, "the second place has no fingerprint")
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		assert.True(t, out.Replayed)
	}},
	{"compact claim, lease alive", "i1B4102444800000000:0:AAAAAAAAAAA:0:P", 1, 0, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key)
		assert.ErrorIs(t, err, ErrInProgress)
		res, err := Consume(context.Background(), k, "s", []string{key}, func(s string) string { return s },
			func(context.Context, string) error { t.Error("a held message ran"); return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageRetry, res[0].Status)
		assert.ErrorIs(t, res[0].Err, ErrInProgress)
	}},
	{"compact claim, lease run out", "i1B1700000000000000:0:AAAAAAAAAAA:0:P", 1, 0, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.True(t, out.Claim.Recovered())
		assert.Equal(t, 2, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), token)
	}},
	{"compact claim released", "i1B1700000000000000:0:AAAAAAAAAAA:0:R", 1, 0, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.False(t, out.Claim.Recovered())
		assert.Equal(t, 2, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), token)
	}},
	{"compact claim forgotten", "i1B1700000000000000:DONE:AAAAAAAAAAA:0:F", 1, time.Minute, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.Equal(t, 1, out.Claim.Attempt())
	}},
}

// TestMarkerPlacementV1: where the index keeps an id's entry is part of the
// format: the same id must land in the same key, block and digest.
func TestMarkerPlacementV1(t *testing.T) {
	s, err := NewRedisStore(redistest.Miniredis(t).Client, WithMarkerScale(1000))
	require.NoError(t, err)
	require.NoError(t, s.layoutReady(context.Background()))
	e := s.entry(recordID("s", "golden-1"))
	assert.Equal(t, "idem:i:0", e.key)
	assert.Equal(t, "\x00\x00\x1b", string(e.block[:]))
	assert.Equal(t, "k@Y\xe1\xc6\xfa\xa6", string(e.d7[:]))
	assert.Equal(t, int64(32), s.compact.blocks)

	// At a scale of 2^30: 2^20 blocks in each of 32 index keys.
	s, err = NewRedisStore(redistest.Miniredis(t).Client, WithMarkerScale(1<<30))
	require.NoError(t, err)
	require.NoError(t, s.layoutReady(context.Background()))
	e = s.entry(recordID("s", "golden-1"))
	assert.Equal(t, "idem:i:27", e.key)
	assert.Equal(t, "\x05\xd7{", string(e.block[:]))
	assert.Equal(t, "k@Y\xe1\xc6\xfa\xa6", string(e.d7[:]))
	assert.Equal(t, int64(1<<20), s.compact.blocks)
	assert.Equal(t, int64(32), s.compact.keys)
}

func TestMarkerFormatV1StillReads(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s, err := NewRedisStore(b.Client, WithMarkerScale(1000))
		require.NoError(t, err)
		require.NoError(t, s.layoutReady(ctx))
		keepers := map[string][]Option{
			"markers":         {WithMarkerScale(1000)},
			"without markers": {WithMarkerScale(1000), WithoutMarkers()},
		}
		for kname, opts := range keepers {
			k := newKeeper(t, b, opts...)
			for i, row := range markerFormatV1 {
				t.Run(kname+"/"+row.name, func(t *testing.T) {
					key := kname + "/" + row.name
					token := int64(1700000000000000 + i)
					now, err := b.Client.Time(ctx).Result()
					require.NoError(t, err)
					call := row.call
					if done := now.Add(-row.doneAgo).UnixMicro(); row.doneAgo > 0 {
						call = replaceDone(call, done)
					}
					tok := strconv.FormatInt(token, 10)
					e := s.entry(recordID("s", key))
					var entry [16]byte
					copy(entry[:7], e.d7[:])
					entry[7], entry[8] = byte(row.place>>8), byte(row.place)
					for j := 0; j < 7; j++ {
						entry[15-j] = byte(token >> (8 * j))
					}
					blk, err := b.Client.HGet(ctx, e.key, string(e.block[:])).Result()
					if err != nil {
						blk = ""
					}
					require.NoError(t, b.Client.HSet(ctx, e.key, "", "v1 scale=1000", string(e.block[:]), blk+string(entry[:])).Err())
					require.NoError(t, b.Client.Set(ctx, "idem:c:"+tok, call, time.Hour).Err())
					row.check(t, k, key, token)
				})
			}
		}
	})
}

// replaceDone puts done in place of DONE in a call record.
func replaceDone(call string, done int64) string {
	const mark = "DONE"
	for i := 0; i+len(mark) <= len(call); i++ {
		if call[i:i+len(mark)] == mark {
			return call[:i] + strconv.FormatInt(done, 10) + call[i+len(mark):]
		}
	}
	return call
}
