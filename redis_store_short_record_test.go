package idem

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCompletedRecordShortForm pins what a completion writes: the short form
// "i1C:" FP ":" TOKEN36 ":" ATTEMPT ":" RECOVERED ":" and the envelope, from
// Complete and from CompleteBatch alike, for a first attempt and for one that
// took over an abandoned claim.
func TestCompletedRecordShortForm(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(time.Second))
		s := k.store.(*redisStore)
		ctx := context.Background()
		raw := func(key string) string {
			v, err := b.Client.Get(ctx, s.RecordKey("s", key)).Result()
			require.NoError(t, err)
			return v
		}
		fp := fingerprintDigest([]byte("body"))

		out, err := k.Begin(ctx, "s", "single", WithFingerprint([]byte("body")))
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte("ok"), 0))
		want := "i1C:" + fp + ":" + strconv.FormatInt(out.Claim.Token(), 36) + ":1:0:\x01bok"
		assert.Equal(t, want, raw("single"))
		assert.Len(t, want, 36+2+2, "header of 36 bytes with a fingerprint")

		res, err := k.batchBegin(ctx, "s", []string{"batch"})
		require.NoError(t, err)
		c := res[0].Outcome.Claim
		require.NotNil(t, c)
		for _, err := range k.completeClaims(ctx, []completion{{Claim: c, Value: []byte("ok")}}) {
			require.NoError(t, err)
		}
		assert.Equal(t, "i1C::"+strconv.FormatInt(c.Token(), 36)+":1:0:\x01bok", raw("batch"))

		first, err := k.Begin(ctx, "s", "taken")
		require.NoError(t, err)
		b.Advance(1100 * time.Millisecond) // the first claim's lease runs out
		second, err := k.Begin(ctx, "s", "taken")
		require.NoError(t, err)
		require.True(t, second.Claim.Recovered())
		require.NoError(t, second.Claim.Complete(ctx, []byte("ok"), 0))
		assert.Equal(t, "i1C::"+strconv.FormatInt(second.Claim.Token(), 36)+":2:1:\x01bok", raw("taken"))
		assert.ErrorIs(t, first.Claim.Complete(ctx, []byte("late"), 0), ErrLeaseLost)
	})
}

// TestShortCompletedRecordSteps takes every step on a completed record of the
// short form: a Complete of its own token again succeeds (a retried call),
// every other step of a claim is refused with ErrLeaseLost and writes
// nothing, alone or in a batch; Inspect reads it and Forget removes it.
func TestShortCompletedRecordSteps(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		s := k.store.(*redisStore)
		ctx := context.Background()
		out, err := k.Begin(ctx, "s", "done", WithFingerprint([]byte("body")))
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte("ok"), 0))
		id, tok := recordID("s", "done"), out.Claim.Token()
		before := b.Client.Get(ctx, s.RecordKey("s", "done")).Val()

		assert.NoError(t, errOf(s.Complete(ctx, id, tok, []byte("ok"), time.Hour)), "the same completion again")
		assert.ErrorIs(t, errOf(s.Complete(ctx, id, tok+1, []byte("other"), time.Hour)), ErrLeaseLost)
		assert.ErrorIs(t, s.Release(ctx, id, tok, time.Hour), ErrLeaseLost)
		assert.ErrorIs(t, s.Extend(ctx, id, tok, time.Minute, time.Hour), ErrLeaseLost)
		assert.ErrorIs(t, s.Checkpoint(ctx, claimFence{ID: id, Token: tok}, "step", nil, 0), ErrLeaseLost)
		fence := []claimFence{{ID: id, Token: tok}}
		assert.NoError(t, s.CompleteBatch(ctx, []batchCompletion{{claimFence: fence[0], Value: []byte("ok"), Keep: time.Hour}})[0])
		assert.ErrorIs(t, s.CompleteBatch(ctx, []batchCompletion{{claimFence: claimFence{ID: id, Token: tok + 1}, Value: []byte("x"), Keep: time.Hour}})[0], ErrLeaseLost)
		assert.ErrorIs(t, s.ReleaseBatch(ctx, fence, time.Hour)[0], ErrLeaseLost)
		assert.ErrorIs(t, s.ExtendBatch(ctx, fence, time.Minute, time.Hour)[0], ErrLeaseLost)
		assert.Equal(t, before, b.Client.Get(ctx, s.RecordKey("s", "done")).Val(), "a refused step wrote")

		r, err := k.Inspect(ctx, "s", "done")
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, r.State)
		assert.Equal(t, tok, r.Token)
		assert.Equal(t, 1, r.Attempt)
		assert.True(t, r.Fingerprint)
		assert.Equal(t, StoredBytes, r.Stored)
		assert.Equal(t, 2, r.Size)
		assert.Positive(t, r.ExpiresIn)

		r, err = k.Forget(ctx, "s", "done", false)
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, r.State)
		assert.Equal(t, tok, r.Token)
		assert.Zero(t, b.Client.Exists(ctx, s.RecordKey("s", "done")).Val())
	})
}

// TestShortCompletedRecordDamaged: a value that starts as a short completed
// record but does not read as one is refused with ErrCorrupt by Begin (a
// fingerprint that differs is answered ErrMismatch only when the header
// reads), Inspect, and every step that must read it, and is never
// overwritten.
func TestShortCompletedRecordDamaged(t *testing.T) {
	rows := []struct{ name, value, begin string }{
		{"header only", "i1C:", "unknown format"},
		{"no fields after the fingerprint", "i1C::", "unknown format"},
		{"token upper case", "i1C::GQLL7VATQ8:1:0:\x01bx", "unknown format"},
		{"token not base 36", "i1C::gq-l:1:0:\x01bx", "unknown format"},
		{"token zero", "i1C::0:1:0:\x01bx", "token or attempt count out of range"},
		{"token past 2^53", "i1C::2gosa7pa2gw:1:0:\x01bx", "token or attempt count out of range"},
		{"attempt zero", "i1C::gqll7vatq8:0:0:\x01bx", "token or attempt count out of range"},
		{"attempt of ten digits", "i1C::gqll7vatq8:1000000000:0:\x01bx", "token or attempt count out of range"},
		{"recovered flag 2", "i1C::gqll7vatq8:1:2:\x01bx", "unknown format"},
		{"header cut short", "i1C::gqll7vatq8:1:0", "unknown format"},
		{"fingerprint not base64url", "i1C:a b:gqll7vatq8:1:0:\x01bx", "unknown format"},
	}
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		s := k.store.(*redisStore)
		ctx := context.Background()
		for _, row := range rows {
			key := "damaged/" + row.name
			rk := s.RecordKey("s", key)
			require.NoError(t, b.Client.Set(ctx, rk, row.value, time.Hour).Err())
			_, err := k.Begin(ctx, "s", key)
			assert.EqualError(t, err, "idem: corrupt record: "+row.begin, row.name)
			_, err = k.Inspect(ctx, "s", key)
			assert.ErrorIs(t, err, ErrCorrupt, "%s: Inspect", row.name)
			for step, err := range map[string]error{
				"Complete": errOf(s.Complete(ctx, recordID("s", key), 1, []byte("x"), time.Hour)),
				"Release":  s.Release(ctx, recordID("s", key), 1, time.Hour),
				"Extend":   s.Extend(ctx, recordID("s", key), 1, time.Second, time.Hour),
			} {
				assert.True(t, errors.Is(err, ErrCorrupt) || errors.Is(err, ErrLeaseLost), "%s: %s: %v", row.name, step, err)
			}
			assert.Equal(t, row.value, b.Client.Get(ctx, rk).Val(), "%s: overwritten", row.name)
		}
	})
}

// FuzzShortCompletedRecord puts "i1C:" and arbitrary bytes where a record
// lives, and takes every step on it through the single-record and the batch
// scripts: both answer the same, every error is typed, a claim answers the
// stored result (the tail of the value, with a token and attempt in range) or
// ErrMismatch, never a claim, and nothing is ever written: a completed record,
// or a value that is not a record, is not a claim's to change.
//
// Fuzz it with -fuzztime as a count (-fuzztime 2000x): without a bound it
// never ends, and the miniredis under it keeps growing.
func FuzzShortCompletedRecord(f *testing.F) {
	for _, tail := range []string{
		"::gqll7vatq8:1:0:\x01bok", fingerprintDigest([]byte("body")) + ":gqll7vatq8:2:1:\x01v\x2a", "", ":", "::",
		"::0:1:0:\x01bx", "::GQLL7VATQ8:1:0:\x01bx", "::2gosa7pa2gv:999999999:1:", "::2gosa7pa2gw:1:0:", "a b:1:1:0:",
	} {
		f.Add(tail, "", int64(1700000000000000))
	}
	m := miniredis.RunT(f)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	f.Cleanup(func() { c.Close() })
	s, err := openRedisStore(c, WithPrefix("fuzz:"))
	require.NoError(f, err)
	ctx := context.Background()
	var n atomic.Int64
	f.Fuzz(func(t *testing.T, tail, fp string, token int64) {
		value := "i1C:" + tail
		if !isBase64URL(fp) {
			fp = "" // refused before Redis is touched
		}
		ids := [2]string{recordID("fuzz", fmt.Sprint(n.Add(1))), recordID("fuzz", fmt.Sprint(n.Add(1)))}
		for _, id := range ids {
			require.NoError(t, c.Set(ctx, s.key(id), value, time.Minute).Err())
		}
		unchanged := func(step string) {
			for _, id := range ids {
				got, _ := c.Get(ctx, s.key(id)).Result()
				require.Equal(t, value, got, "%s on %q wrote", step, value)
			}
		}
		req := claimRequest{Fingerprint: fp, Attempt: "att", Lease: time.Minute, Keep: time.Minute}
		r, err := s.Claim(ctx, ids[0], req)
		rb := s.ClaimBatch(ctx, batchClaimRequest{IDs: ids[1:], Fingerprints: []string{fp}, Attempt: "att", Lease: time.Minute, Keep: time.Minute})[0]
		require.Equal(t, errClass(err), errClass(rb.Err), "claim on %q", value)
		require.Equal(t, r, rb.Reply, "claim on %q", value)
		switch {
		case err != nil:
			require.ErrorIs(t, err, ErrCorrupt, "claim on %q", value)
		case r.Status == statusCompleted:
			require.True(t, strings.HasSuffix(value, string(r.Value)), "claim on %q: %+v", value, r)
			require.True(t, r.Token >= 1 && r.Token <= maxToken && r.Attempt >= 1, "claim on %q: %+v", value, r)
		default:
			require.Equal(t, statusMismatch, r.Status, "claim on %q: %+v", value, r)
		}
		unchanged("claim")
		fence := []claimFence{{ID: ids[1], Token: token}}
		for step, errs := range map[string][2]error{
			"complete": {errOf(s.Complete(ctx, ids[0], token, []byte("x"), time.Minute)), s.CompleteBatch(ctx, []batchCompletion{{claimFence: fence[0], Value: []byte("x"), Keep: time.Minute}})[0]},
			"release":  {s.Release(ctx, ids[0], token, time.Minute), s.ReleaseBatch(ctx, fence, time.Minute)[0]},
			"extend":   {s.Extend(ctx, ids[0], token, time.Minute, time.Minute), s.ExtendBatch(ctx, fence, time.Minute, time.Minute)[0]},
		} {
			require.Equal(t, errClass(errs[0]), errClass(errs[1]), "%s on %q", step, value)
			require.True(t, errs[0] == nil || errors.Is(errs[0], ErrCorrupt) || errors.Is(errs[0], ErrLeaseLost), "%s on %q: untyped %v", step, value, errs[0])
			unchanged(step)
		}
	})
}
