package idem

// Markers: what a message handled by Consume leaves (a compact claim
// completed with an empty result), how every kind of claim answers it while
// it lasts, and that it never answers for another id.

import (
	"context"
	"encoding/base64"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCompactCompletionKeepsItsRetention: a marker keeps the retention its
// completion asked for, as a record does. Completion.Retention (and
// Claim.Complete's retention) is "how long the result is kept". A claim of
// BeginBatch(WithCompactClaims()) completed with an empty result and a
// retention of 10s, read 700ms later by a Keeper whose retention is 200ms
// and marker retention 400ms, must still be replayed: a claim kept in a record
// (WithCompactClaims off, or the same call's claim that went to a record)
// is. The marker instead answers by the reader's retention and marker
// retention only, so past 400ms the key is free and the operation runs again.
func TestCompactCompletionKeepsItsRetention(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		// Scaled down so that a real redis-server can wait for it: a retention
		// of 200ms, a marker retention of 400ms, a completion kept 10s, read
		// 700ms later.
		k := newKeeper(t, b, WithLease(100*time.Millisecond), WithRetention(200*time.Millisecond), WithMarkerRetention(400*time.Millisecond))
		ctx := context.Background()

		for _, compact := range []bool{false, true} {
			key := map[bool]string{false: "record", true: "compact"}[compact]
			var opts []Option
			if compact {
				opts = append(opts, withCompactClaims())
			}
			res, err := k.batchBegin(ctx, "s", []string{key}, opts...)
			require.NoError(t, err)
			require.NoError(t, res[0].Err)
			c := res[0].Outcome.Claim
			require.NotNil(t, c)
			t.Logf("%s: ref %d", key, c.ref)
			errs := k.completeClaims(ctx, []completion{{Claim: c, Value: nil, Retention: 10 * time.Second}})
			require.NoError(t, errs[0])
		}

		b.Advance(700 * time.Millisecond) // within the 10s asked for
		for _, key := range []string{"record", "compact"} {
			o, err := k.Begin(ctx, "s", key)
			if o.Claim != nil {
				_ = o.Claim.Release(ctx)
			}
			assert.NoError(t, err, "%s", key)
			assert.Nil(t, o.Claim, "%s: completed 700ms ago with a retention of 10s (marker retention 400ms), claimed again: the operation runs twice", key)
			assert.True(t, o.Replayed, "%s: not replayed", key)
		}
	})
}

// TestMarkerNeverAnswersForANonCanonicalTwin: ids are told apart by every
// character, the padding bits of the last one included. A redisStore takes any id (recordStore.Claim,
// recordStore.ClaimBatch; Inspect and Forget take any 22 base64url
// characters), and indexDigest decodes a 22-character base64url id without
// checking that it is the canonical encoding: the last character carries 2
// bits of padding that the decoder drops. Two distinct ids that differ only
// there have one digest, one index entry: the marker of one answers for the
// other ("a marker never answers for another id"), and Inspect of one shows
// the other's marker. Record ids made by RecordID are canonical; ids a
// caller of the store makes need not be.
func TestMarkerNeverAnswersForANonCanonicalTwin(t *testing.T) {
	b := redistest.Real(t)
	ctx := context.Background()
	s, err := openRedisStore(b.Client)
	require.NoError(t, err)
	a, other := "AAAAAAAAAAAAAAAAAAAAAA", "AAAAAAAAAAAAAAAAAAAAAB" // two ids, two record keys
	require.NotEqual(t, s.key(a), s.key(other))

	req := batchClaimRequest{IDs: []string{a}, Attempt: "AAAAAAAAAAA", Lease: time.Minute, Keep: time.Hour,
		Retention: time.Hour, MarkerRetention: time.Hour, Compact: true}
	got := s.ClaimBatch(ctx, req)
	require.NoError(t, got[0].Err)
	require.Equal(t, statusClaimed, got[0].Reply.Status)
	errs := s.CompleteBatch(ctx, []batchCompletion{{claimFence: claimFence{ID: a, Token: got[0].Reply.Token, Ref: got[0].Reply.Ref}, Value: emptyBytes, Keep: time.Hour}})
	require.NoError(t, errs[0])

	r, err := s.Claim(ctx, other, claimRequest{Attempt: "BBBBBBBBBBB", Lease: time.Minute, Keep: time.Hour, Retention: time.Hour, MarkerRetention: time.Hour})
	require.NoError(t, err)
	assert.Equal(t, statusClaimed, r.Status, "%s was never claimed, but is answered as %s's marker (status %d)", other, a, r.Status)

	rec, err := s.Inspect(ctx, other)
	require.NoError(t, err)
	t.Logf("Inspect(%s): state %s token %d", other, rec.State, rec.Token)
}

// markerEvents records the claims an Observer is told of, and whether they
// came from a marker.
type markerEvents struct {
	mu     sync.Mutex
	claims []Event
}

func (m *markerEvents) Observe(_ context.Context, ev Event) {
	if ev.Step == StepClaim {
		m.mu.Lock()
		m.claims = append(m.claims, ev)
		m.mu.Unlock()
	}
}

func (m *markerEvents) last() Event {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.claims[len(m.claims)-1]
}

// TestMarkerAnswers: a message handled by Consume is answered from its
// marker: Consume acknowledges its redelivery without running it; Begin and
// Do answer it as a completed operation with an empty result within the
// retention, then ErrResultExpired (never a second run) within the marker
// retention; after that the key is free, with a higher token.
func TestMarkerAnswers(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		seen := &markerEvents{}
		// A lease long enough that a loaded machine's stall does not end
		// it before the handler runs; the retentions as short as it allows.
		k := newKeeper(t, b, WithLease(600*time.Millisecond), WithRetention(1500*time.Millisecond),
			WithMarkerRetention(3*time.Second), WithObserver(seen))
		runs := 0
		handle := func(ctx context.Context, m msg) error {
			c, ok := ClaimFromContext(ctx)
			require.True(t, ok)
			require.Positive(t, c.Token())
			runs++
			return nil
		}
		first, err := Consume(ctx, k, "s", msgs("m1"), msgID, handle)
		require.NoError(t, err)
		require.Equal(t, MessageHandled, first[0].Status)
		tokenOf := seen.last().Token

		again, err := Consume(ctx, k, "s", msgs("m1"), msgID, handle)
		require.NoError(t, err)
		assert.Equal(t, MessageReplayed, again[0].Status)
		assert.True(t, again[0].Ack)
		assert.True(t, seen.last().Marker, "the redelivery was answered from the marker")
		assert.Equal(t, ResultReplayed, seen.last().Result)

		out, err := k.Begin(ctx, "s", "m1")
		require.NoError(t, err)
		assert.True(t, out.Replayed, "within the retention: a completed operation")
		assert.Empty(t, out.Value)
		assert.Equal(t, tokenOf, out.Token, "the token of the claim that completed it")
		v, err := Do(ctx, k, "s", "m1", func(context.Context) ([]byte, error) { return []byte("ran again"), nil })
		require.NoError(t, err)
		assert.Empty(t, v)

		b.Advance(1800 * time.Millisecond) // past the retention, within the marker retention
		_, err = k.Begin(ctx, "s", "m1")
		assert.ErrorIs(t, err, ErrResultExpired)
		assert.True(t, seen.last().Marker)
		assert.Equal(t, ResultExpired, seen.last().Result)
		_, err = Do(ctx, k, "s", "m1", func(context.Context) (int, error) { return 1, nil })
		assert.ErrorIs(t, err, ErrResultExpired, "Do never runs it again")
		again, err = Consume(ctx, k, "s", msgs("m1"), msgID, handle)
		require.NoError(t, err)
		assert.Equal(t, MessageReplayed, again[0].Status, "Consume acknowledges it: handled before")
		assert.Equal(t, ResultReplayed, seen.last().Result, "for a message, the ordinary answer of a repeat, not a result lost")
		assert.True(t, seen.last().Marker)
		assert.True(t, again[0].Ack)
		assert.NoError(t, again[0].Err)
		assert.Equal(t, 1, runs)

		b.Advance(1800 * time.Millisecond) // past the marker retention
		out, err = k.Begin(ctx, "s", "m1")
		require.NoError(t, err)
		require.NotNil(t, out.Claim, "once the marker retention has passed, the key is free")
		assert.Equal(t, 1, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), tokenOf, "tokens go on increasing after the marker is gone")
		require.NoError(t, out.Claim.Release(ctx))
	})
}

// TestMarkerKeepsTheFingerprint: a message consumed with a fingerprint
// leaves a marker that keeps it: the same message again is replayed, one
// with another body under the key is rejected, in a later batch as in the
// same one.
func TestMarkerKeepsTheFingerprint(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b)
		ran := map[string]int{}
		handle := func(_ context.Context, m msg) error { ran[m.Body]++; return nil }
		fp := func(ms ...msg) [][]byte {
			out := make([][]byte, len(ms))
			for i, m := range ms {
				out[i] = []byte(m.Body)
			}
			return out
		}
		a, other := msg{ID: "order-7", Body: "charge 10"}, msg{ID: "order-7", Body: "charge 99"}
		res, err := Consume(ctx, k, "orders", []msg{a}, msgID, handle, WithFingerprints(fp(a)))
		require.NoError(t, err)
		require.Equal(t, MessageHandled, res[0].Status)

		res, err = Consume(ctx, k, "orders", []msg{a, {ID: "order-8", Body: "x"}}, msgID, handle, WithFingerprints(fp(a, msg{Body: "x"})))
		require.NoError(t, err)
		assert.Equal(t, MessageReplayed, res[0].Status, "the same body: replayed")
		assert.Equal(t, MessageHandled, res[1].Status)

		res, err = Consume(ctx, k, "orders", []msg{other}, msgID, handle, WithFingerprints(fp(other)))
		require.NoError(t, err)
		assert.Equal(t, MessageRejected, res[0].Status, "another body under a handled key: rejected")
		assert.ErrorIs(t, res[0].Err, ErrMismatch)
		assert.False(t, res[0].Ack)

		res, err = Consume(ctx, k, "orders", []msg{a}, msgID, handle)
		require.NoError(t, err)
		assert.Equal(t, MessageRejected, res[0].Status, "no fingerprint against a marker that has one: rejected")
		assert.Equal(t, map[string]int{"charge 10": 1, "x": 1}, ran)
	})
}

// resentScripts sends each call of the scripts in resend twice, as go-redis
// does when the first reply was lost, and answers the second reply.
type resentScripts struct {
	redis.Scripter
	resend map[string]bool
	sent   atomic.Int64
}

func (r *resentScripts) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	if !r.resend[sha] {
		return r.Scripter.EvalSha(ctx, sha, keys, args...)
	}
	first := r.Scripter.EvalSha(ctx, sha, keys, args...)
	if first.Err() != nil {
		return first // NOSCRIPT: Script.Run sends it again with EVAL
	}
	r.sent.Add(1)
	return r.Scripter.EvalSha(ctx, sha, keys, args...)
}

// TestMarkerLostReplies: every compact step whose reply was lost and that is
// sent again answers the same: the claim of the first run (the same token),
// the completion already done, so that the message runs once and is
// acknowledged once.
func TestMarkerLostReplies(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		r := &resentScripts{Scripter: b.Client, resend: map[string]bool{
			v3ClaimScript.Hash(): true, v3SettleScript.Hash(): true,
		}}
		s, err := openRedisStore(r)
		require.NoError(t, err)
		k, err := keeperOn(s, WithLease(time.Minute))
		require.NoError(t, err)
		require.NoError(t, s.LoadScripts(ctx))
		runs := map[string]int{}
		batch := msgs("a", "b", "c", "d")
		res, err := Consume(ctx, k, "s", batch, msgID, func(_ context.Context, m msg) error { runs[m.ID]++; return nil })
		require.NoError(t, err)
		for i, x := range res {
			assert.Equal(t, MessageHandled, x.Status, "message %d: %v", i, x.Err)
		}
		assert.Equal(t, map[string]int{"a": 1, "b": 1, "c": 1, "d": 1}, runs)
		assert.Positive(t, r.sent.Load())

		// A batch claimed twice answers the first run's claims: a claim of
		// the call that holds them (10), which extends and completes.
		rs, err := k.batchBegin(ctx, "s", []string{"e", "f"}, withCompactClaims())
		require.NoError(t, err)
		for _, x := range rs {
			require.NoError(t, x.Err)
			require.NotNil(t, x.Outcome.Claim)
			assert.Equal(t, 1, x.Outcome.Claim.Attempt())
			assert.Positive(t, x.Outcome.Claim.fence().Ref, "a compact claim")
		}
		for _, err := range k.extendClaims(ctx, []*Claim{rs[0].Outcome.Claim, rs[1].Outcome.Claim}) {
			assert.NoError(t, err)
		}
		for _, err := range k.completeClaims(ctx, []completion{{Claim: rs[0].Outcome.Claim}, {Claim: rs[1].Outcome.Claim, Value: []byte("v")}}) {
			assert.NoError(t, err)
		}
		out, err := k.Begin(ctx, "s", "f")
		require.NoError(t, err)
		assert.Equal(t, "v", string(out.Value), "completed with a value: a record of its own")
	})
}

// TestMarkersAreReadWithoutMarkers: a Keeper made WithoutMarkers claims in
// records, and still answers the markers others left: nothing handled
// runs again.
func TestMarkersAreReadWithoutMarkers(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b)
		plain := newKeeper(t, b, WithoutMarkers())
		res, err := Consume(ctx, k, "s", msgs("m1", "m2"), msgID, func(context.Context, msg) error { return nil })
		require.NoError(t, err)
		require.Equal(t, MessageHandled, res[0].Status)

		res, err = Consume(ctx, plain, "s", msgs("m1", "m3"), msgID, func(context.Context, msg) error { return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageReplayed, res[0].Status, "a marker, read by a Keeper without markers")
		assert.Equal(t, MessageHandled, res[1].Status)
		out, err := plain.Begin(ctx, "s", "m2")
		require.NoError(t, err)
		assert.True(t, out.Replayed)

		// And the other way round: what plain claimed is a record, which
		// the Keeper with markers answers.
		res, err = Consume(ctx, k, "s", msgs("m3"), msgID, func(context.Context, msg) error { return nil })
		require.NoError(t, err)
		assert.Equal(t, MessageReplayed, res[0].Status)
		v, err := b.Client.Exists(ctx, k.store.(*redisStore).RecordKey("s", "m3")).Result()
		require.NoError(t, err)
		assert.EqualValues(t, 1, v, "WithoutMarkers keeps a record")
	})
}

// TestMarkerDigestsDoNotCollide: many ids that share blocks are each
// answered for themselves: every new one is claimed, every handled one
// replayed, none mistaken for another.
func TestMarkerDigestsDoNotCollide(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		// Ids that share blocks as the index splits them.
		k := newKeeper(t, b)
		const n = 600
		var batch []msg
		for i := range n {
			batch = append(batch, msg{ID: fmt.Sprint("id-", i)})
		}
		ran := map[string]int{}
		handle := func(_ context.Context, m msg) error { ran[m.ID]++; return nil }
		for off := 0; off < n; off += 100 {
			res, err := Consume(ctx, k, "s", batch[off:off+100:off+100], msgID, handle)
			require.NoError(t, err)
			for i, r := range res {
				require.Equal(t, MessageHandled, r.Status, "id-%d: %v", off+i, r.Err)
			}
		}
		for off := 0; off < n; off += 150 {
			res, err := Consume(ctx, k, "s", batch[off:off+150:off+150], msgID, handle)
			require.NoError(t, err)
			for i, r := range res {
				require.Equal(t, MessageReplayed, r.Status, "id-%d: %v", off+i, r.Err)
			}
		}
		for _, m := range batch {
			assert.Equal(t, 1, ran[m.ID], m.ID)
		}
	})
}

// TestMarkersAreSwept: a block written drops the entries that no call can
// hold any more (v3MaxHold past their call record's keep), and keeps the
// others.
func TestMarkersAreSwept(t *testing.T) {
	b := redistest.Miniredis(t)
	ctx := context.Background()
	k := newKeeper(t, b, WithLease(time.Second), WithRetention(time.Minute), WithMarkerRetention(time.Minute))
	s := k.store.(*redisStore)
	handle := func(context.Context, string) error { return nil }
	id := func(s string) string { return s }
	old := make([]string, 70)
	for i := range old {
		old[i] = fmt.Sprint("old-", i)
	}
	_, err := Consume(ctx, k, "s", old, id, handle)
	require.NoError(t, err)
	b.Advance(2*time.Minute + v3MaxHold) // the old markers' entries are stale
	fresh := make([]string, 70)
	for i := range fresh {
		fresh[i] = fmt.Sprint("new-", i)
	}
	_, err = Consume(ctx, k, "s", fresh, id, handle)
	require.NoError(t, err)
	_, index, _ := s.compactIndexArgs(recordID("s", "new-0"))
	blocks, err := b.Client.HGetAll(ctx, index).Result()
	require.NoError(t, err)
	entries := 0
	for f, v := range blocks {
		if f != "" {
			entries += len(v) / 16
		}
	}
	assert.Less(t, entries, 140, "the blocks written were swept of stale entries")
	assert.GreaterOrEqual(t, entries, 70, "the live entries are kept")
	res, err := Consume(ctx, k, "s", fresh, id, handle)
	require.NoError(t, err)
	for _, r := range res {
		assert.Equal(t, MessageReplayed, r.Status)
	}
}

// TestEmptiedBlocksAreDeleted: a block whose last entry a claim sweeps is
// deleted, not kept as an empty field: here a message redelivered, past
// its marker's life, to a Keeper without markers, which claims it in a
// record and leaves no entry in its block.
func TestEmptiedBlocksAreDeleted(t *testing.T) {
	b := redistest.Miniredis(t)
	ctx := context.Background()
	opts := []Option{WithLease(time.Second), WithRetention(time.Minute), WithMarkerRetention(time.Minute)}
	k := newKeeper(t, b, opts...)
	handle := func(context.Context, string) error { return nil }
	id := func(s string) string { return s }
	_, err := Consume(ctx, k, "s", []string{"old"}, id, handle)
	require.NoError(t, err)
	_, index, _ := k.store.(*redisStore).compactIndexArgs(recordID("s", "old"))

	// The marker's entry goes stale while other messages keep the index
	// key alive.
	for i, gone := 0, time.Duration(0); gone <= 2*time.Minute+v3MaxHold; i, gone = i+1, gone+30*time.Second {
		b.Advance(30 * time.Second)
		_, err := Consume(ctx, k, "s", []string{fmt.Sprint("alive-", i)}, id, handle)
		require.NoError(t, err)
	}
	res, err := Consume(ctx, newKeeper(t, b, append(opts, WithoutMarkers())...), "s", []string{"old"}, id, handle)
	require.NoError(t, err)
	require.Equal(t, MessageHandled, res[0].Status)
	blocks, err := b.Client.HGetAll(ctx, index).Result()
	require.NoError(t, err)
	require.Contains(t, blocks, "", "the index key lives")
	for f, v := range blocks {
		assert.True(t, f == "" || v != "", "block %x is kept empty", f)
	}
	e := v3KeyOf(recordID("s", "old"))
	st, ok := parseV3State(blocks[""])
	require.True(t, ok)
	assert.NotContains(t, blocks, string(v3AppendBlockName(nil, v3Block(e.h, st.level, st.split))), "the old marker's block")
}

// TestMarkerMemory: a message handled by Consume costs at most 24 bytes of
// Redis memory, where its record (WithoutMarkers) costs well over a
// hundred. What the ids cost is the keys' MEMORY USAGE (every field of
// every key, SAMPLES 0): used_memory, less the connections' buffers, also
// moves with what the process holds besides the data (the slow log, say),
// by up to a few hundred kilobytes on a busy machine, so it is checked with
// 2 bytes an id to spare.
func TestMarkerMemory(t *testing.T) {
	redistest.Long(t)
	const n = 100_000
	for _, c := range []struct {
		name string
		opts []Option
		max  float64
	}{{"markers", nil, 24}, {"records", []Option{WithoutMarkers()}, 200}} {
		t.Run(c.name, func(t *testing.T) {
			b := redistest.Real(t)
			ctx := context.Background()
			k := newKeeper(t, b, c.opts...)
			// used is used_memory less the connections' buffers
			// (mem_clients_normal).
			used := func() float64 {
				info, err := b.Client.Info(ctx, "memory").Result()
				require.NoError(t, err)
				field := func(name string) float64 {
					for _, l := range strings.Split(info, "\r\n") {
						if v, ok := strings.CutPrefix(l, name+":"); ok {
							var x float64
							_, err := fmt.Sscan(v, &x)
							require.NoError(t, err)
							return x
						}
					}
					t.Fatalf("INFO memory has no %s", name)
					return 0
				}
				return field("used_memory") - field("mem_clients_normal")
			}
			// keys is the sum of every key's MEMORY USAGE.
			keys := func() float64 {
				var sum float64
				iter := b.Client.Scan(ctx, 0, "*", 1000).Iterator()
				for iter.Next(ctx) {
					u, err := b.Client.MemoryUsage(ctx, iter.Val(), 0).Result()
					require.NoError(t, err)
					sum += float64(u)
				}
				require.NoError(t, iter.Err())
				return sum
			}
			_, err := Consume(ctx, k, "s", []string{"warm"}, func(s string) string { return s }, func(context.Context, string) error { return nil })
			require.NoError(t, err)
			usedBefore, keysBefore := used(), keys()
			batch := make([]string, 500)
			for off := 0; off < n; off += len(batch) {
				for i := range batch {
					batch[i] = fmt.Sprint("msg-", off+i)
				}
				res, err := Consume(ctx, k, "s", batch, func(s string) string { return s }, func(context.Context, string) error { return nil })
				require.NoError(t, err)
				for _, r := range res {
					require.True(t, r.Ack, "%v", r.Err)
				}
			}
			perKeys, perUsed := (keys()-keysBefore)/n, (used()-usedBefore)/n
			t.Logf("%s: %.1f bytes of the keys' MEMORY USAGE and %.1f of used_memory per handled message, over %d", c.name, perKeys, perUsed, n)
			assert.LessOrEqual(t, perKeys, c.max)
			assert.LessOrEqual(t, perUsed, c.max+2)
		})
	}
}

// TestCompactClaimSentTwice: a compact claim call run again whole (its reply
// lost) answers the first run's claims: the same token and place for each
// record, nothing claimed twice.
func TestCompactClaimSentTwice(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s, err := openRedisStore(b.Client)
		require.NoError(t, err)
		req := batchClaimRequest{
			IDs: []string{recordID("s", "a"), recordID("s", "b"), recordID("s", "c")}, Attempt: "attempt-1",
			Lease: time.Minute, Keep: time.Hour, Retention: time.Hour, MarkerRetention: 2 * time.Hour, Compact: true,
		}
		first := s.ClaimBatch(ctx, req)
		again := s.ClaimBatch(ctx, req)
		for i := range first {
			require.NoError(t, first[i].Err)
			require.NoError(t, again[i].Err)
			assert.Equal(t, statusClaimed, again[i].Reply.Status)
			assert.Equal(t, first[i].Reply.Token, again[i].Reply.Token, "record %d", i)
			assert.Equal(t, first[i].Reply.Ref, again[i].Reply.Ref, "record %d", i)
			assert.Positive(t, first[i].Reply.Ref)
		}
		req.Attempt = "attempt-2" // another call: the claims are held
		for i, r := range s.ClaimBatch(ctx, req) {
			require.NoError(t, r.Err)
			assert.Equal(t, statusInProgress, r.Reply.Status, "record %d", i)
		}
	})
}

// TestMarkerEntryIsKnownByAllItsBytes: an entry holds 8 bytes of the id's
// digest, the last 3 its block hash, whose low bits choose its block: two
// ids whose digests differ only in the first byte of the hash, which no
// block of an index below level 16 reads, share a block and still answer
// each for itself.
func TestMarkerEntryIsKnownByAllItsBytes(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s, err := openRedisStore(b.Client)
		require.NoError(t, err)
		id := func(b5 byte) string {
			var raw [16]byte
			copy(raw[:], "same5.bytes.16..")
			raw[5] = b5
			return base64.RawURLEncoding.EncodeToString(raw[:])
		}
		a, c := id(1), id(2)
		ka, kc := v3KeyOf(a), v3KeyOf(c)
		require.Equal(t, ka.d5, kc.d5, "the entries start alike")
		require.NotEqual(t, ka.h, kc.h)
		require.Equal(t, v3Block(ka.h, v3StartLevel, 0), v3Block(kc.h, v3StartLevel, 0), "one block")

		req := batchClaimRequest{IDs: []string{a}, Attempt: "AAAAAAAAAAA", Lease: time.Minute, Keep: time.Hour,
			Retention: time.Hour, MarkerRetention: time.Hour, Compact: true}
		got := s.ClaimBatch(ctx, req)
		require.NoError(t, got[0].Err)
		require.Equal(t, statusClaimed, got[0].Reply.Status)
		errs := s.CompleteBatch(ctx, []batchCompletion{{claimFence: claimFence{ID: a, Token: got[0].Reply.Token, Ref: got[0].Reply.Ref}, Value: emptyBytes, Keep: time.Hour}})
		require.NoError(t, errs[0])

		req.IDs, req.Attempt = []string{a, c}, "BBBBBBBBBBB"
		got = s.ClaimBatch(ctx, req)
		require.NoError(t, got[0].Err)
		require.NoError(t, got[1].Err)
		assert.Equal(t, statusCompleted, got[0].Reply.Status, "a is done")
		assert.True(t, got[0].Reply.Marker)
		assert.Equal(t, statusClaimed, got[1].Reply.Status, "c is not a")
	})
}

// TestConsumeReplaysAMarkerPastTheRetention: a message handled by Consume
// leaves a marker kept for the marker retention; its redelivery after the
// retention, and within the marker retention, is "done before": Consume
// answers MessageReplayed, acknowledged, and the handler does not run (the
// contract: "a redelivery within it is answered done before, as from a full
// record"; WithMarkerRetention: "for that long a redelivery is answered
// handled before (MessageReplayed)"). Begin answers ErrResultExpired then.
func TestConsumeReplaysAMarkerPastTheRetention(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		const retention = time.Second
		k := newKeeper(t, b, WithLease(retention), WithRetention(retention), WithMarkerRetention(time.Hour))
		ctx := context.Background()
		ran := 0
		handle := func(context.Context, msg) error { ran++; return nil }
		res, err := Consume(ctx, k, "s", msgs("m1"), msgID, handle)
		require.NoError(t, err)
		require.Equal(t, MessageHandled, res[0].Status)

		b.Advance(retention + retention/2)
		_, err = k.Begin(ctx, "s", "m1")
		require.ErrorIs(t, err, ErrResultExpired, "Begin past the retention, within the marker retention")

		res, err = Consume(ctx, k, "s", msgs("m1"), msgID, handle)
		require.NoError(t, err)
		assert.Equal(t, 1, ran, "the handler ran again")
		assert.Equal(t, MessageReplayed, res[0].Status,
			"a redelivery past the retention and within the marker retention must be answered done before; got %s (Ack %v, %v): the broker redelivers it until the marker retention ends, and then it runs again",
			res[0].Status, res[0].Ack, res[0].Err)
		assert.True(t, res[0].Ack, "not acknowledged")
	})
}

// TestConsumeRemembersARetriedMessageForTheMarkerRetention: a message that
// took more than one delivery to handle (its first handler failed and
// released it, or its first consumer died holding it and a redelivery took
// it over) is remembered as long as one handled at the first try: for the
// marker retention, past the result retention (WithMarkerRetention: "a
// message handled by Consume ... is remembered: for that long a redelivery
// is answered handled before"). Begin past the retention answers
// ErrResultExpired, never a claim; Consume never runs it again.
func TestConsumeRemembersARetriedMessageForTheMarkerRetention(t *testing.T) {
	const retention = time.Second
	cases := map[string]func(t *testing.T, b *redistest.Backend, k *Keeper){
		"failed first": func(t *testing.T, b *redistest.Backend, k *Keeper) {
			res, err := Consume(context.Background(), k, "s", msgs("m1"), msgID, func(context.Context, msg) error { return errFlaky })
			require.NoError(t, err)
			require.Equal(t, MessageRetry, res[0].Status)
		},
		"its consumer died": func(t *testing.T, b *redistest.Backend, k *Keeper) {
			res, err := k.batchBegin(context.Background(), "s", []string{"m1"}, withCompactClaims())
			require.NoError(t, err)
			require.NotNil(t, res[0].Outcome.Claim) // and never settled
			b.Advance(retention + 10*time.Millisecond)
		},
		"first try": func(t *testing.T, b *redistest.Backend, k *Keeper) {},
	}
	for name, before := range cases {
		t.Run(name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				k := newKeeper(t, b, WithLease(retention), WithRetention(retention), WithMarkerRetention(time.Hour))
				ctx := context.Background()
				before(t, b, k)
				ran := 0
				handle := func(context.Context, msg) error { ran++; return nil }
				res, err := Consume(ctx, k, "s", msgs("m1"), msgID, handle)
				require.NoError(t, err)
				require.Equal(t, MessageHandled, res[0].Status, "%v", res[0].Err)

				b.Advance(retention + retention/2)
				out, err := k.Begin(ctx, "s", "m1")
				if out.Claim != nil {
					assert.Fail(t, "forgotten", "Begin past the retention, within the marker retention, claimed a message Consume handled (attempt %d, token %d): it is no longer remembered, and its redelivery runs again",
						out.Claim.Attempt(), out.Claim.Token())
					require.NoError(t, out.Claim.Release(ctx))
				} else {
					assert.ErrorIs(t, err, ErrResultExpired)
				}
				_, err = Consume(ctx, k, "s", msgs("m1"), msgID, handle)
				require.NoError(t, err)
				assert.Equal(t, 1, ran, "the handler ran again within the marker retention")
			})
		})
	}
}
