package idem

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// redeliveryBatch returns a batch of n message keys of which a share dup are
// redeliveries of messages handled before (their keys are returned as done,
// to handle first), the rest new, shuffled.
func redeliveryBatch(n int, dup float64, seed uint64) (batch, done []string) {
	rnd := rand.New(rand.NewPCG(seed, 5))
	redelivered := int(float64(n) * dup)
	for i := 0; i < n; i++ {
		key := fmt.Sprintf("msg-%d-%d", seed, i)
		if i < redelivered {
			done = append(done, key)
		}
		batch = append(batch, key)
	}
	rnd.Shuffle(len(batch), func(i, j int) { batch[i], batch[j] = batch[j], batch[i] })
	return batch, done
}

// TestBatchRoundTrips: a batch of 500 messages, a fifth of them
// redeliveries, costs one round trip to claim, one to renew and one to
// complete; Consume, whose handlers end within a third of the lease and
// within its settle window, two.
func TestBatchRoundTrips(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var cnt redistest.Counter
		b.Client.AddHook(&cnt)
		k := newKeeper(t, b, WithLease(time.Hour))
		ctx := context.Background()
		require.NoError(t, k.store.(*redisStore).LoadScripts(ctx))
		batch, done := redeliveryBatch(500, 0.2, 1)
		_, err := Consume(ctx, k, "s", done, func(s string) string { return s }, func(context.Context, string) error { return nil })
		require.NoError(t, err)

		steps := batchSteps(t, k, batch, cnt.Count)
		assert.Equal(t, map[string]int64{"claim": 1, "renew": 1, "complete": 1}, steps)

		batch, done = redeliveryBatch(500, 0.2, 2)
		_, err = Consume(ctx, k, "s", done, func(s string) string { return s }, func(context.Context, string) error { return nil })
		require.NoError(t, err)
		var res []MessageResult
		assert.EqualValues(t, 2, cnt.Count(func() {
			res, err = Consume(ctx, k, "s", batch, func(s string) string { return s }, func(context.Context, string) error { return nil }, WithSettleWindow(time.Hour, len(batch)))
			require.NoError(t, err)
		}), "Consume: the claim and the completion, the handlers returning within the settle window")
		for _, r := range res {
			assert.True(t, r.Ack)
		}
	})
}

// batchSteps claims batch, renews the claims and completes them, and
// returns the round trips of each step, as count counts them.
func batchSteps(t *testing.T, k *Keeper, batch []string, count func(func()) int64) map[string]int64 {
	ctx := context.Background()
	var res []batchResult
	steps := map[string]int64{}
	steps["claim"] = count(func() {
		var err error
		res, err = k.batchBegin(ctx, "s", batch)
		require.NoError(t, err)
	})
	var claims []*Claim
	var items []completion
	replayed := 0
	for _, r := range res {
		require.NoError(t, r.Err)
		if r.Outcome.Replayed {
			replayed++
			continue
		}
		claims = append(claims, r.Outcome.Claim)
		items = append(items, completion{Claim: r.Outcome.Claim})
	}
	require.Equal(t, len(batch)/5, replayed)
	steps["renew"] = count(func() {
		for _, err := range k.extendClaims(ctx, claims) {
			require.NoError(t, err)
		}
	})
	steps["complete"] = count(func() {
		for _, err := range k.completeClaims(ctx, items) {
			require.NoError(t, err)
		}
	})
	return steps
}

// TestBatchRecordMemory: a message completed by Consume WithoutMarkers
// keeps no result, and its record, with the short completed header, costs
// no more MEMORY USAGE than a plain string of 24 bytes under a key of the
// same length on the same server (40 bytes with a fingerprint). Measured
// against that baseline, not a fixed count, so that the bound holds on
// every build: Debian's redis-server 7.0 with jemalloc gives 104 and 120
// bytes for both, a libc malloc build or Valkey other counts.
func TestBatchRecordMemory(t *testing.T) {
	b := redistest.Real(t)
	k := newKeeper(t, b, WithoutMarkers())
	ctx := context.Background()
	id := func(s string) string { return s }
	fps := [][]byte{[]byte(`{"order":1001,"amount":4200}`)}
	_, err := Consume(ctx, k, "tenant-42", []string{"msg-plain"}, id, func(context.Context, string) error { return nil })
	require.NoError(t, err)
	_, err = Consume(ctx, k, "tenant-42", []string{"msg-fp"}, id, func(context.Context, string) error { return nil }, WithFingerprints(fps))
	require.NoError(t, err)
	usage := func(key string) int64 {
		n, err := b.Client.MemoryUsage(ctx, key).Result()
		require.NoError(t, err)
		return n
	}
	for _, c := range []struct {
		msg    string
		budget int // bytes of a plain string value the record may cost as much as
	}{{"msg-plain", 24}, {"msg-fp", 40}} {
		key := k.store.(*redisStore).RecordKey("tenant-42", c.msg)
		require.True(t, strings.HasPrefix(key, "idem:"), key)
		ttl, err := b.Client.PTTL(ctx, key).Result()
		require.NoError(t, err)
		require.Positive(t, ttl, "%s: the record expires", c.msg)
		// A name of the same length, with an expiry too (Valkey keeps it in the key's object).
		base := "base:" + key[len("idem:"):]
		require.NoError(t, b.Client.Set(ctx, base, strings.Repeat("v", c.budget), ttl).Err())
		rec, want := usage(key), usage(base)
		t.Logf("%s: MEMORY USAGE %d bytes; a %d-byte string under a key of the same length: %d", c.msg, rec, c.budget, want)
		assert.LessOrEqual(t, rec, want, "%s: the record costs more than a %d-byte string", c.msg, c.budget)
	}
}
