package idem

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The record format rule: a release reads the next format before any release
// writes it. These records are written exactly as the first format ("i1",
// envelope 1) writes them; every later release must read them as this one
// does. Never edit a row: add rows for each new format.
var formatV1 = []struct {
	name, record string
	check        func(t *testing.T, k *Keeper, key string)
}{
	{"completed bytes", "i1C1700000000000000:1:0:0:::\x01bshipped", func(t *testing.T, k *Keeper, key string) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		assert.True(t, out.Replayed)
		assert.Equal(t, "shipped", string(out.Value))
		assert.EqualValues(t, 1700000000000000, out.Token)
	}},
	{"completed value of Do", "i1C1700000000000000:2:1:0:::\x01v\x2a", func(t *testing.T, k *Keeper, key string) {
		v, err := Do(context.Background(), k, "s", key, func(context.Context) (int, error) { return 0, nil })
		require.NoError(t, err)
		assert.Equal(t, 42, v)
	}},
	{"completed final error of Do", "i1C1700000000000000:1:0:0:::\x01ecard declined", func(t *testing.T, k *Keeper, key string) {
		_, err := Do(context.Background(), k, "s", key, func(context.Context) (int, error) { return 0, nil })
		var final *FinalError
		require.ErrorAs(t, err, &final)
		assert.True(t, final.Replayed)
		assert.Equal(t, "card declined", err.Error())
	}},
	{"completed with a fingerprint", "i1C1700000000000000:1:0:0::" + fingerprintDigest([]byte("body")) + ":\x01bok", func(t *testing.T, k *Keeper, key string) {
		_, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("other")))
		assert.ErrorIs(t, err, ErrMismatch)
		out, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("body")))
		require.NoError(t, err)
		assert.Equal(t, "ok", string(out.Value))
	}},
	{"pending, lease alive", "i1P1700000000000000:1:0:4102444800000000:AAAAAAAAAAA::", func(t *testing.T, k *Keeper, key string) {
		_, err := k.Begin(context.Background(), "s", key)
		assert.ErrorIs(t, err, ErrInProgress)
	}},
	{"pending, lease run out", "i1P1700000000000000:1:0:1700000000000000:AAAAAAAAAAA::", func(t *testing.T, k *Keeper, key string) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.True(t, out.Claim.Recovered())
		assert.Equal(t, 2, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), int64(1700000000000000))
	}},
	{"released", "i1R1700000000000000:3:0:0:::", func(t *testing.T, k *Keeper, key string) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.False(t, out.Claim.Recovered())
		assert.Equal(t, 4, out.Claim.Attempt())
	}},
	// Added with FinalCode: kind 'E' in envelope 1, a msgpack array
	// [message, code, details].
	{"completed coded final error of Do", "i1C1700000000000000:1:0:0:::\x01E" + codedFinalV1, func(t *testing.T, k *Keeper, key string) {
		_, err := Do(context.Background(), k, "s", key, func(context.Context) (int, error) { return 0, nil })
		var final *FinalError
		require.ErrorAs(t, err, &final)
		assert.True(t, final.Replayed)
		assert.Equal(t, "card declined", err.Error())
		assert.Equal(t, "card_declined", final.Code)
		assert.Equal(t, map[string]string{"decline_code": "insufficient_funds"}, final.Details)
	}},
	{"coded final error with a field added later", "i1C1700000000000000:1:0:0:::\x01E\x94" + codedFinalV1[1:] + "\xc0", func(t *testing.T, k *Keeper, key string) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		var final *FinalError
		require.ErrorAs(t, out.Err, &final)
		assert.Equal(t, "card_declined", final.Code)
		assert.Equal(t, "insufficient_funds", final.Details["decline_code"])
	}},
	// Added with checkpoints: a pending or released record may hold
	// checkpoints after its header, each LEN ":" NAME LEN ":" VALUE; a
	// released one that holds some keeps its fingerprint.
	{"pending with checkpoints, lease alive", "i1P1700000000000000:1:0:4102444800000000:AAAAAAAAAAA::7:charged4:ch_1", func(t *testing.T, k *Keeper, key string) {
		_, err := k.Begin(context.Background(), "s", key)
		assert.ErrorIs(t, err, ErrInProgress)
	}},
	{"pending with checkpoints, lease run out", "i1P1700000000000000:2:1:1700000000000000:AAAAAAAAAAA::7:charged4:ch_17:shipped0:", func(t *testing.T, k *Keeper, key string) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.True(t, out.Claim.Recovered())
		assert.Equal(t, 3, out.Claim.Attempt())
		assert.Equal(t, []recoveryPoint{{"charged", []byte("ch_1")}, {"shipped", []byte{}}}, out.Claim.allCheckpoints())
	}},
	{"released with checkpoints", "i1R1700000000000000:1:0:0::" + fingerprintDigest([]byte("body")) + ":7:charged4:ch_1", func(t *testing.T, k *Keeper, key string) {
		_, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("other")))
		assert.ErrorIs(t, err, ErrMismatch)
		out, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("body")))
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.False(t, out.Claim.Recovered())
		assert.Equal(t, 2, out.Claim.Attempt())
		v, ok := out.Claim.Checkpointed("charged")
		assert.True(t, ok)
		assert.Equal(t, "ch_1", string(v))
	}},
	// Added with the short form of a completed record, which complete.lua
	// writes: "i1C:" FP ":" TOKEN36 ":" ATTEMPT ":" RECOVERED ":" PAYLOAD, the
	// token in base 36 ("gqll7vatq8" is 1700000000000000).
	{"short completed bytes", "i1C::gqll7vatq8:1:0:\x01bshipped", func(t *testing.T, k *Keeper, key string) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		assert.True(t, out.Replayed)
		assert.Equal(t, "shipped", string(out.Value))
		assert.EqualValues(t, 1700000000000000, out.Token)
	}},
	{"short completed value of Do", "i1C::gqll7vatq8:2:1:\x01v\x2a", func(t *testing.T, k *Keeper, key string) {
		v, err := Do(context.Background(), k, "s", key, func(context.Context) (int, error) { return 0, nil })
		require.NoError(t, err)
		assert.Equal(t, 42, v)
	}},
	{"short completed final error of Do", "i1C::gqll7vatq8:1:0:\x01ecard declined", func(t *testing.T, k *Keeper, key string) {
		_, err := Do(context.Background(), k, "s", key, func(context.Context) (int, error) { return 0, nil })
		var final *FinalError
		require.ErrorAs(t, err, &final)
		assert.True(t, final.Replayed)
		assert.Equal(t, "card declined", err.Error())
	}},
	{"short completed coded final error of Do", "i1C::gqll7vatq8:1:0:\x01E" + codedFinalV1, func(t *testing.T, k *Keeper, key string) {
		_, err := Do(context.Background(), k, "s", key, func(context.Context) (int, error) { return 0, nil })
		var final *FinalError
		require.ErrorAs(t, err, &final)
		assert.Equal(t, "card_declined", final.Code)
	}},
	{"short completed with a fingerprint", "i1C:" + fingerprintDigest([]byte("body")) + ":gqll7vatq8:1:0:\x01bok", func(t *testing.T, k *Keeper, key string) {
		_, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("other")))
		assert.ErrorIs(t, err, ErrMismatch)
		_, err = k.Begin(context.Background(), "s", key)
		assert.ErrorIs(t, err, ErrMismatch, "no fingerprint against one")
		out, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("body")))
		require.NoError(t, err)
		assert.Equal(t, "ok", string(out.Value))
	}},
	{"short completed, recovered, inspected", "i1C::gqll7vatq8:3:1:\x01bok", func(t *testing.T, k *Keeper, key string) {
		r, err := k.Inspect(context.Background(), "s", key)
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, r.State)
		assert.EqualValues(t, 1700000000000000, r.Token)
		assert.Equal(t, 3, r.Attempt)
		assert.True(t, r.Recovered)
		assert.False(t, r.Fingerprint)
		assert.Equal(t, StoredBytes, r.Stored)
		assert.Equal(t, 2, r.Size)
	}},
	// Added with markers: a message handled by Consume in a record of its
	// own keeps the envelope kind 'm' and, in decimal, when its result's
	// retention ends: an empty result until then, ErrResultExpired after.
	{"marker kept in a record, within the retention", "i1C::gqll7vatq8:2:1:\x01m4102444800000000", func(t *testing.T, k *Keeper, key string) {
		out, err := k.Begin(context.Background(), "s", key)
		require.NoError(t, err)
		assert.True(t, out.Replayed)
		assert.Empty(t, out.Value)
		assert.EqualValues(t, 1700000000000000, out.Token)
		r, err := k.Inspect(context.Background(), "s", key)
		require.NoError(t, err)
		assert.Equal(t, StoredBytes, r.Stored)
		assert.Zero(t, r.Size)
	}},
	{"marker kept in a record, past the retention", "i1C::gqll7vatq8:2:1:\x01m1700000000000000", func(t *testing.T, k *Keeper, key string) {
		_, err := k.Begin(context.Background(), "s", key)
		assert.ErrorIs(t, err, ErrResultExpired)
		res, err := Consume(context.Background(), k, "s", []string{key}, func(s string) string { return s },
			func(context.Context, string) error { t.Error("a handled message ran"); return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageReplayed, res[0].Status)
	}},
	{"marker kept in a record, with a fingerprint", "i1C:" + fingerprintDigest([]byte("body")) + ":gqll7vatq8:2:1:\x01m4102444800000000", func(t *testing.T, k *Keeper, key string) {
		_, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("other")))
		assert.ErrorIs(t, err, ErrMismatch)
		out, err := k.Begin(context.Background(), "s", key, WithFingerprint([]byte("body")))
		require.NoError(t, err)
		assert.True(t, out.Replayed)
	}},
}

// codedFinalV1 is the body of a kind 'E' record: [message, code, details].
const codedFinalV1 = "\x93\xadcard declined\xadcard_declined\x81\xacdecline_code\xb2insufficient_funds"

func TestRecordFormatV1StillReads(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, err := NewRedis(b.Client)
		require.NoError(t, err)
		for _, row := range formatV1 {
			t.Run(row.name, func(t *testing.T) {
				key := row.name
				rk := DefaultPrefix + "{" + recordID("s", key) + "}"
				require.NoError(t, b.Client.Set(context.Background(), rk, row.record, time.Hour).Err())
				row.check(t, k, key)
			})
		}
	})
}
