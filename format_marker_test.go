package idem

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The record format rule holds for compact claims and markers too: these
// index entries and call records are written exactly as the v3 layout
// writes them (format.go, "The v3 layout"), and every later release must
// read them as this one does, with markers or without. Never edit a row:
// add rows.
//
// In each row, the call record's done and result retention are set from
// doneAgo and untilIn, relative to Redis's clock at the read.
var markerFormat = []struct {
	name string
	// v3 is the row's call record, its zero value for none; place is the
	// entry's place in it.
	v3    v3Call
	place uint16
	// doneAgo is how long before the read the call completed its claims;
	// untilIn how long after the read the retention of its results ends.
	doneAgo, untilIn time.Duration
	check            func(t *testing.T, k *Keeper, key string, token int64)
}{
	{"marker within the retention", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "C"}, 1, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
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
	{"marker past the retention", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "C"}, 1, 48 * time.Hour, -24 * time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key)
		assert.ErrorIs(t, err, ErrResultExpired)
		res, err := Consume(context.Background(), k, "s", []string{key}, func(s string) string { return s },
			func(context.Context, string) error { t.Error("a marked message ran"); return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageReplayed, res[0].Status)
	}},
	{"entry whose call record is gone", v3Call{}, 1, 0, 0, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.Equal(t, 1, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), token)
	}},
	{"second place of a call", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "XC"}, 2, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		assert.True(t, out.Replayed)
		assert.Equal(t, token, out.Token)
	}},
	{"place not claimed by the call", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "CX"}, 2, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim, "an entry whose place the call did not claim is stale")
		assert.Equal(t, 1, out.Claim.Attempt())
	}},
	{"marker with a fingerprint", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "C", fpw: 16, fps: fingerprintDigest([]byte("body"))}, 1, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("other")))
		assert.ErrorIs(t, err, ErrMismatch)
		out, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("body")))
		require.NoError(t, err)
		assert.True(t, out.Replayed)
	}},
	{"fingerprints padded to the call's widest", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "CC", fpw: 16, fps: fingerprintDigest([]byte("body")) + "................"}, 2, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("body")))
		assert.ErrorIs(t, err, ErrMismatch, "the second place has no fingerprint")
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		assert.True(t, out.Replayed)
	}},
	{"compact claim, lease alive", v3Call{until: 4102444800000000, callID: "AAAAAAAAAAE", states: "P"}, 1, 0, 0, func(t *testing.T, k *Keeper, key string, token int64) {
		_, err := k.Begin(context.Background(), "s", key)
		assert.ErrorIs(t, err, ErrInProgress)
		res, err := Consume(context.Background(), k, "s", []string{key}, func(s string) string { return s },
			func(context.Context, string) error { t.Error("a held message ran"); return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageRetry, res[0].Status)
		assert.ErrorIs(t, res[0].Err, ErrInProgress)
	}},
	{"compact claim, lease run out", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "P"}, 1, 0, 0, beginsAgain(2, true)},
	{"compact claim released", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "R"}, 1, 0, 0, beginsAgain(2, false)},
	{"compact claim forgotten", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", states: "F"}, 1, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.Equal(t, 1, out.Claim.Attempt())
	}},
	{"marker of a claim's third attempt", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", aw: 2, states: "XC", attempts: "\x00\x01\x00\x03"}, 2, time.Minute, time.Hour, func(t *testing.T, k *Keeper, key string, token int64) {
		// Begin and Do claim by claim.lua, which answers the attempt a
		// marker's place holds, as a batch's claim does.
		rep, err := k.store.Claim(context.Background(), k.RecordID("s", key), claimRequest{Attempt: newAttemptID(), Lease: time.Minute, Keep: time.Hour})
		require.NoError(t, err)
		assert.Equal(t, statusCompleted, rep.Status)
		assert.True(t, rep.Marker)
		assert.Equal(t, token, rep.Token)
		assert.Equal(t, 3, rep.Attempt)
		out := k.store.ClaimBatch(context.Background(), batchClaimRequest{IDs: []string{k.RecordID("s", key)}, Attempt: newAttemptID(),
			Lease: time.Minute, Keep: time.Hour, Retention: time.Hour, MarkerRetention: time.Hour, Compact: true})
		require.NoError(t, out[0].Err)
		assert.Equal(t, statusCompleted, out[0].Reply.Status)
		assert.Equal(t, 3, out[0].Reply.Attempt)
	}},
	{"compact claim run out at its third attempt", v3Call{until: 1700000000000000, callID: "AAAAAAAAAAE", aw: 2, states: "XP", attempts: "\x00\x01\x80\x03"}, 2, 0, 0, beginsAgain(4, true)},
}

// beginsAgain is a row's check that Begin claims the key again, at attempt
// and recovered or not, with a token above the row's.
func beginsAgain(attempt int, recovered bool) func(t *testing.T, k *Keeper, key string, token int64) {
	return func(t *testing.T, k *Keeper, key string, token int64) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.Equal(t, recovered, out.Claim.Recovered())
		assert.Equal(t, attempt, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), token)
	}
}

// TestMarkerFormatV3StillReads writes each row's call record and its
// entry, in a v3 index of a few blocks, and reads it with Keepers with and
// without markers: the format is v3's (format.go, "The v3 layout").
func TestMarkerFormatV3StillReads(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s, err := openRedisStore(b.Client)
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
