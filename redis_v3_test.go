package idem

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The guarantees of the v3 layout's claim and settle (lua/v3_claim.lua,
// lua/v3_settle.lua), at the store, on miniredis and redis-server: a live
// claim answers busy; an expired lease is taken over with a higher token
// and the old holder's settle refused; a released id is claimed again with
// a higher token; a settled id answers done within the retention and is
// free after it; an id twice in a call is claimed once; a call sent again
// claims nothing twice.

// v3Store returns a redisStore of the v3 layout on b.
func v3Store(t *testing.T, b *redistest.Backend) *redisStore {
	t.Helper()
	s, err := openRedisStore(b.Client)
	require.NoError(t, err)
	require.NotNil(t, s.v3, "a *redis.Client store takes the v3 layout")
	return s
}

// v3Request is a compact claim request of ids with lease, the marker
// answering as done for retention and as expired for twice that.
func v3Request(ids []string, lease, retention time.Duration) batchClaimRequest {
	return batchClaimRequest{IDs: ids, Attempt: newAttemptID(), Lease: lease, Keep: lease,
		Retention: retention, MarkerRetention: 2 * retention, Compact: true, distinct: true}
}

func v3IDs(prefix string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = recordID("s", fmt.Sprintf("%s-%d", prefix, i))
	}
	return ids
}

// claimAll asserts every reply claimed, by one call, at attempt 1, and
// returns the fences.
func claimAll(t *testing.T, out []batchClaimReply, ids []string) []claimFence {
	t.Helper()
	fences := make([]claimFence, len(out))
	for i, r := range out {
		require.NoError(t, r.Err, "id %d", i)
		require.Equal(t, statusClaimed, r.Reply.Status, "id %d", i)
		assert.Equal(t, 1, r.Reply.Attempt, "id %d", i)
		assert.Positive(t, r.Reply.Ref, "id %d", i)
		assert.Equal(t, out[0].Reply.Token, r.Reply.Token, "one token a call")
		fences[i] = claimFence{ID: ids[i], Token: r.Reply.Token, Ref: r.Reply.Ref}
	}
	return fences
}

// markersOf completes fences as Consume does: markers whose results are
// kept for retention from now by Redis's clock, the call record for keep.
func markersOf(t *testing.T, b *redistest.Backend, fences []claimFence, retention, keep time.Duration) []batchCompletion {
	now, err := b.Client.Time(context.Background()).Result()
	require.NoError(t, err)
	items := make([]batchCompletion, len(fences))
	for i, f := range fences {
		items[i] = batchCompletion{claimFence: f, Value: markerEnvelope(now.Add(retention)), Keep: keep}
	}
	return items
}

func TestV3ClaimSettleGuarantees(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s := v3Store(t, b)
		const lease, retention = 300 * time.Millisecond, time.Second
		ids := v3IDs("g", 5)

		// New ids: claimed by one call.
		first := claimAll(t, s.ClaimBatch(ctx, v3Request(ids, lease, retention)), ids)

		// A live claim answers busy, with the lease left.
		for i, r := range s.ClaimBatch(ctx, v3Request(ids, lease, retention)) {
			require.NoError(t, r.Err)
			assert.Equal(t, statusInProgress, r.Reply.Status, "id %d", i)
			assert.Greater(t, r.Reply.LeaseLeft, time.Duration(0))
			assert.LessOrEqual(t, r.Reply.LeaseLeft, lease)
		}

		// Renewed, completed (ids 0-1) and released (id 2); ids 3-4 are
		// left to run out.
		for _, err := range s.ExtendBatch(ctx, first, lease, lease) {
			require.NoError(t, err)
		}
		done, given := s.SettleBatch(ctx, markersOf(t, b, first[:2], retention, 2*retention), first[2:3], lease)
		require.Equal(t, []error{nil, nil}, done)
		require.Equal(t, []error{nil}, given)
		// A settle sent again is done before, not lost.
		done, given = s.SettleBatch(ctx, markersOf(t, b, first[:2], retention, 2*retention), first[2:3], lease)
		require.Equal(t, []error{nil, nil}, done)
		require.Equal(t, []error{nil}, given)

		b.Advance(lease + 50*time.Millisecond)
		out := s.ClaimBatch(ctx, v3Request(ids, lease, retention))
		for i := 0; i < 2; i++ {
			require.NoError(t, out[i].Err)
			assert.Equal(t, statusCompleted, out[i].Reply.Status, "a settled id answers done")
			assert.True(t, out[i].Reply.Marker)
		}
		// The released id: claimed again, attempt 2, a higher token.
		require.NoError(t, out[2].Err)
		assert.Equal(t, statusClaimed, out[2].Reply.Status)
		assert.Equal(t, 2, out[2].Reply.Attempt)
		assert.False(t, out[2].Reply.Recovered)
		assert.Greater(t, out[2].Reply.Token, first[2].Token)
		// The expired leases: taken over, attempt 2, recovered.
		for i := 3; i < 5; i++ {
			require.NoError(t, out[i].Err)
			assert.Equal(t, statusClaimed, out[i].Reply.Status, "id %d", i)
			assert.Equal(t, 2, out[i].Reply.Attempt)
			assert.True(t, out[i].Reply.Recovered)
			assert.Equal(t, out[2].Reply.Token, out[i].Reply.Token)
		}
		// The old holder's settle of them is refused, and its renewal.
		done, _ = s.SettleBatch(ctx, markersOf(t, b, first[3:5], retention, 2*retention), nil, lease)
		for _, err := range done {
			assert.ErrorIs(t, err, ErrLeaseLost)
		}
		for _, err := range s.ExtendBatch(ctx, first[3:5], lease, lease) {
			assert.ErrorIs(t, err, ErrLeaseLost)
		}
		// The new holder settles them.
		token2 := out[2].Reply.Token
		second := []claimFence{{ids[3], out[3].Reply.Token, out[3].Reply.Ref}, {ids[4], out[4].Reply.Token, out[4].Reply.Ref}}
		done, _ = s.SettleBatch(ctx, markersOf(t, b, second, retention, 2*retention), nil, lease)
		assert.Equal(t, []error{nil, nil}, done)

		// Past the retention: expired; past the marker retention: free.
		b.Advance(retention + 100*time.Millisecond)
		out = s.ClaimBatch(ctx, v3Request(ids[:2], lease, retention))
		for i := range out {
			require.NoError(t, out[i].Err)
			assert.Equal(t, statusResultExpired, out[i].Reply.Status, "id %d", i)
		}
		b.Advance(retention + 100*time.Millisecond)
		again := claimAll(t, s.ClaimBatch(ctx, v3Request(ids[:2], lease, retention)), ids[:2])
		assert.Greater(t, again[0].Token, token2)
	})
}

// TestV3OneClaimAnId: an id twice in one call is claimed once (the second
// place answers as held), and a call sent again (go-redis resends a script
// whose reply was lost) answers as its first run did, claiming nothing a
// second time: its own claims by its first token, the rest as they were
// answered; once another call came between, the same.
func TestV3OneClaimAnId(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s := v3Store(t, b)
		const lease = 300 * time.Millisecond
		ids := v3IDs("twice", 4)
		done := claimAll(t, s.ClaimBatch(ctx, v3Request(ids[3:], time.Minute, time.Minute)), ids[3:])
		d, _ := s.SettleBatch(ctx, markersOf(t, b, done, time.Minute, time.Minute), nil, time.Minute)
		require.Equal(t, []error{nil}, d)

		req := v3Request(append(ids, ids[1]), time.Minute, time.Minute)
		out := s.ClaimBatch(ctx, req)
		first := claimAll(t, out[:3], ids[:3])
		require.NoError(t, out[3].Err)
		assert.Equal(t, statusCompleted, out[3].Reply.Status, "done before")
		require.NoError(t, out[4].Err)
		assert.Equal(t, statusInProgress, out[4].Reply.Status, "the repeat")

		again := s.ClaimBatch(ctx, req)
		assert.Equal(t, out, again, "sent again, the call answers as its first run did")

		// A takeover, sent again: the same attempt, recovered.
		take := v3IDs("take", 1)
		short := v3Request(take, lease, time.Minute)
		claimAll(t, s.ClaimBatch(ctx, short), take)
		b.Advance(lease + 50*time.Millisecond)
		short.Attempt = newAttemptID()
		took := s.ClaimBatch(ctx, short)
		require.NoError(t, took[0].Err)
		require.Equal(t, statusClaimed, took[0].Reply.Status)
		require.True(t, took[0].Reply.Recovered)
		assert.Equal(t, took, s.ClaimBatch(ctx, short))

		// Another call came between: the first run's claims answer by its
		// token and places still, claimed anew by none.
		claimAll(t, s.ClaimBatch(ctx, v3Request(v3IDs("between", 2), time.Minute, time.Minute)), v3IDs("between", 2))
		late := s.ClaimBatch(ctx, req)
		assert.Equal(t, out, late, "sent again after another call, the call answers as its first run did")
		// Nothing was claimed twice: the first claims settle.
		d, _ = s.SettleBatch(ctx, markersOf(t, b, first[1:], time.Minute, time.Minute), nil, time.Minute)
		assert.Equal(t, []error{nil, nil}, d)
	})
}

// TestV3ChunksAreCalls: a request over v3Chunk ids goes as calls of their
// own, each claiming its part under a token and a call id of its own; no
// chunk is taken for the one before it sent again.
func TestV3ChunksAreCalls(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s := v3Store(t, b)
		ids := v3IDs("chunks", v3Chunk+v3Chunk/2)
		out := s.ClaimBatch(ctx, v3Request(ids, time.Minute, time.Minute))
		tokens := map[int64]int{}
		fences := make([]claimFence, len(out))
		for i, r := range out {
			require.NoError(t, r.Err, "id %d", i)
			require.Equal(t, statusClaimed, r.Reply.Status, "id %d", i)
			tokens[r.Reply.Token]++
			fences[i] = claimFence{ID: ids[i], Token: r.Reply.Token, Ref: r.Reply.Ref}
		}
		assert.Len(t, tokens, 2, "a token a call")
		done, _ := s.SettleBatch(ctx, markersOf(t, b, fences, time.Minute, time.Minute), nil, time.Minute)
		for i, err := range done {
			require.NoError(t, err, "id %d", i)
		}
		for i, r := range s.ClaimBatch(ctx, v3Request(ids, time.Minute, time.Minute)) {
			require.NoError(t, r.Err)
			require.Equal(t, statusCompleted, r.Reply.Status, "id %d", i)
		}
	})
}

// TestV3Grows: the index splits its blocks as it grows, moving each entry
// to the block its hash chooses, and a store that packs by a state the
// index has left behind is answered rightly.
func TestV3Grows(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		// s and other take turns, so that each packs by a state the other
		// has split since (same level, a split point behind); stale packs
		// by the empty index's.
		// An index begins at 2^v3StartLevel blocks: past the fill of
		// those, it splits.
		s, other, stale := v3Store(t, b), v3Store(t, b), v3Store(t, b)
		ids := v3IDs("grow", (2*v3IndexFill<<v3StartLevel/v3Chunk+1)*v3Chunk)
		require.Greater(t, len(ids), 2*v3IndexFill<<v3StartLevel)
		for at := 0; at < len(ids); at += v3Chunk {
			part := ids[at : at+v3Chunk]
			st := []*redisStore{s, other}[at/v3Chunk%2]
			fences := claimAll(t, st.ClaimBatch(ctx, v3Request(part, time.Minute, time.Minute)), part)
			done, _ := st.SettleBatch(ctx, markersOf(t, b, fences, time.Minute, time.Minute), nil, time.Minute)
			for _, err := range done {
				require.NoError(t, err)
			}
		}
		raw, err := b.Client.HGet(ctx, s.v3.index, "").Result()
		require.NoError(t, err)
		m, ok := parseV3State(raw)
		require.True(t, ok)
		assert.Equal(t, uint32(len(ids)), m.count)
		assert.Greater(t, int64(m.due), time.Now().Add(-time.Minute).Unix(), "the state knows until when the key lives")
		assert.LessOrEqual(t, m.count, uint32(v3IndexFill)*m.blocks()+uint32(v3IndexFill), "split to the fill")
		assert.Greater(t, m.blocks(), uint32(1)<<v3StartLevel, "split past the start")
		assert.GreaterOrEqual(t, m.blocks(), uint32(len(ids)/v3IndexFill/2))
		n, err := b.Client.HLen(ctx, s.v3.index).Result()
		require.NoError(t, err)
		assert.Equal(t, int64(m.blocks())+1, n, "a field a block, and the state")

		for _, st := range []*redisStore{s, other, stale} {
			for i, r := range st.ClaimBatch(ctx, v3Request(ids, time.Minute, time.Minute)) {
				require.NoError(t, r.Err)
				require.Equal(t, statusCompleted, r.Reply.Status, "id %d", i)
			}
		}
		assert.Equal(t, uint32(m.level)<<24|m.split, stale.v3.ls.Load(), "the stale store learned the state")
	})
}

// TestV3RecordsAndFingerprints: a record of its own answers for its id; an
// id held or done under another fingerprint answers mismatch.
func TestV3RecordsAndFingerprints(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s := v3Store(t, b)
		k, err := keeperOn(s)
		require.NoError(t, err)
		_, err = Do(ctx, k, "s", "own", func(context.Context) (string, error) { return "x", nil })
		require.NoError(t, err)

		ids := []string{recordID("s", "own"), recordID("s", "fp")}
		req := v3Request(ids, time.Minute, time.Minute)
		req.Fingerprints = []string{"", "AAAA"}
		out := s.ClaimBatch(ctx, req)
		require.NoError(t, out[0].Err)
		assert.Equal(t, statusCompleted, out[0].Reply.Status, "the record of its own")
		require.NoError(t, out[1].Err)
		require.Equal(t, statusClaimed, out[1].Reply.Status)

		req = v3Request(ids[1:], time.Minute, time.Minute)
		req.Fingerprints = []string{"BBBBBB"}
		out = s.ClaimBatch(ctx, req)
		require.NoError(t, out[0].Err)
		assert.Equal(t, statusMismatch, out[0].Reply.Status)
		req.Fingerprints = []string{"AAAA"}
		out = s.ClaimBatch(ctx, req)
		require.NoError(t, out[0].Err)
		assert.Equal(t, statusInProgress, out[0].Reply.Status)
	})
}

// TestV3StepsSentTwice: with every script sent twice, as go-redis sends a
// script whose reply was lost, each v3 step answers as on a clean line:
// the claim as its first run, the renewal, completion and release as done.
func TestV3StepsSentTwice(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		client, twice := resendClient(t, b)
		s, err := openRedisStore(client)
		require.NoError(t, err)
		require.NoError(t, s.LoadScripts(ctx))
		twice.on.Store(true)
		ids := v3IDs("sent-twice", 6)
		first := claimAll(t, s.ClaimBatch(ctx, v3Request(ids, time.Minute, time.Minute)), ids)
		for _, err := range s.ExtendBatch(ctx, first, time.Minute, time.Minute) {
			require.NoError(t, err)
		}
		done, given := s.SettleBatch(ctx, markersOf(t, b, first[:4], time.Minute, time.Minute), first[4:], time.Minute)
		assert.Equal(t, []error{nil, nil, nil, nil}, done)
		assert.Equal(t, []error{nil, nil}, given)
		twice.on.Store(false)
		clean := v3Store(t, b)
		out := clean.ClaimBatch(ctx, v3Request(ids, time.Minute, time.Minute))
		for i, r := range out {
			require.NoError(t, r.Err)
			if i < 4 {
				assert.Equal(t, statusCompleted, r.Reply.Status, "id %d", i)
			} else {
				assert.Equal(t, statusClaimed, r.Reply.Status, "id %d", i)
				assert.Equal(t, 2, r.Reply.Attempt, "id %d: released once", i)
			}
		}
	})
}

// TestV3CompletionWithAValue: a compact claim completed with a value (a
// Final error's, as Consume stores it) moves to a record of its own, which
// answers for the id, to a v3 claim and to Begin alike; sent again it is
// done before; the old holder of a claim taken over cannot move it.
func TestV3CompletionWithAValue(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s := v3Store(t, b)
		k, err := keeperOn(s, WithLease(time.Minute))
		require.NoError(t, err)
		const lease = 300 * time.Millisecond
		ids := []string{k.RecordID("s", "valued"), k.RecordID("s", "marker"), k.RecordID("s", "late")}
		req := v3Request(ids, lease, time.Minute)
		out := s.ClaimBatch(ctx, req)
		f := claimAll(t, out, ids)
		value := seal(kindBytes, []byte("declined"))
		items := []batchCompletion{{claimFence: f[0], Value: value, Keep: time.Minute}}
		items = append(items, markersOf(t, b, f[1:2], time.Minute, time.Minute)...)
		for range 2 {
			assert.Equal(t, []error{nil, nil}, s.CompleteBatch(ctx, items), "done, then done before")
		}
		rec, err := b.Client.Get(ctx, s.key(ids[0])).Result()
		require.NoError(t, err, "a record of its own")
		assert.Contains(t, rec, "declined")

		for i, r := range s.ClaimBatch(ctx, v3Request(ids[:2], time.Minute, time.Minute)) {
			require.NoError(t, r.Err)
			assert.Equal(t, statusCompleted, r.Reply.Status, "id %d", i)
		}
		got, err := k.Begin(ctx, "s", "valued")
		require.NoError(t, err)
		assert.True(t, got.Replayed)
		assert.Equal(t, "declined", string(got.Value), "Begin reads the record of its own")
		fp := v3Request(ids[:1], time.Minute, time.Minute)
		fp.Fingerprints = []string{"BBBB"}
		assert.Equal(t, statusMismatch, s.ClaimBatch(ctx, fp)[0].Reply.Status, "the record keeps its fingerprint")

		// Taken over after its lease: the old holder's value is refused.
		b.Advance(lease + 50*time.Millisecond)
		taken := s.ClaimBatch(ctx, v3Request(ids[2:], lease, time.Minute))
		require.NoError(t, taken[0].Err)
		require.True(t, taken[0].Reply.Recovered)
		errs := s.CompleteBatch(ctx, []batchCompletion{{claimFence: f[2], Value: value, Keep: time.Minute}})
		assert.ErrorIs(t, errs[0], ErrLeaseLost)
		_, err = b.Client.Get(ctx, s.key(ids[2])).Result()
		assert.ErrorIs(t, err, redis.Nil, "nothing written for the old holder")
	})
}

// TestV3SettleSplit: a settle's answer for each claim is its place's state
// before the call (held: done; the target: done before; moved; else lost),
// a missing call record loses every claim, a value not ours answers so for
// each, and a place past the record's is corrupt.
func TestV3SettleSplit(t *testing.T) {
	each, err := v3SettleSplit('C', []int{1, 2, 3, 4, 5})([]any{"PCMRT"}, 5)
	require.NoError(t, err)
	assert.Equal(t, [][]any{replyDone, replyDone, {int64(compactSettleMoved)}, replyLost, replyLost}, each)

	each, err = v3SettleSplit('E', []int{2, 1})([]any{"EP"}, 2)
	require.NoError(t, err)
	assert.Equal(t, [][]any{replyDone, replyLost}, each, "a renewal is done only where held")

	each, err = v3SettleSplit('R', []int{1, 2})([]any{int64(transitionLost)}, 2)
	require.NoError(t, err)
	assert.Equal(t, [][]any{replyLost, replyLost}, each)

	each, err = v3SettleSplit('R', []int{1})([]any{int64(transitionLost), "wrong type"}, 1)
	require.NoError(t, err)
	assert.Equal(t, [][]any{{int64(replyNotOurs), "wrong type"}}, each)

	_, err = v3SettleSplit('C', []int{3})([]any{"PP"}, 1)
	assert.ErrorIs(t, err, ErrCorrupt)

	each, err = v3SettleSplit(0, nil)([]any{int64(transitionDone), int64(compactSettleDoneBefore)}, 2)
	require.NoError(t, err)
	assert.Equal(t, [][]any{replyDone, replyDone}, each, "a move's answers, a claim each")
}

// TestV3RefusedWriteClaimsNothing: on a Redis that refuses writes (OOM on
// a full server, READONLY on a replica), a v3 claim writes nothing and
// claims nothing: a new id and an expired lease it would take over answer
// Redis's refusal, while a completed id is still answered done. The old
// holder of the expired lease is not fenced off by the refused call.
func TestV3RefusedWriteClaimsNothing(t *testing.T) {
	for _, mode := range []string{"OOM", "READONLY"} {
		t.Run(mode, func(t *testing.T) {
			srv := redistest.Start(t, "--maxmemory-policy", "noeviction")
			admin := srv.Client(t)
			ctx := context.Background()
			s, err := openRedisStore(admin)
			require.NoError(t, err)
			const lease, retention = 100 * time.Millisecond, time.Minute
			ids := v3IDs("refused", 3)
			first := claimAll(t, s.ClaimBatch(ctx, v3Request(ids[:2], lease, retention)), ids[:2])
			done, _ := s.SettleBatch(ctx, markersOf(t, &redistest.Backend{Client: admin}, first[:1], retention, 2*retention), nil, lease)
			require.Equal(t, []error{nil}, done)
			time.Sleep(lease + 50*time.Millisecond) // ids[1]'s lease runs out

			on := s
			if mode == "OOM" {
				filler := strings.Repeat("x", 4096)
				for i := 0; i < 300; i++ {
					require.NoError(t, admin.Set(ctx, fmt.Sprintf("filler-%d", i), filler, 0).Err())
				}
				require.NoError(t, admin.ConfigSet(ctx, "maxmemory", "1mb").Err())
			} else {
				r := redistest.StartReplica(t, srv.Addr)
				n, err := admin.Do(ctx, "wait", 1, 2000).Int()
				require.NoError(t, err)
				require.Equal(t, 1, n, "the replica has the claims")
				on, err = openRedisStore(r.Client(t))
				require.NoError(t, err)
			}
			before, err := admin.HGetAll(ctx, s.v3.index).Result()
			require.NoError(t, err)

			// ids[1] would be taken over (a write to its call record first),
			// ids[2] claimed (the index's write first).
			for _, order := range [][]string{{ids[0], ids[1], ids[2]}, {ids[2], ids[0]}} {
				out := on.ClaimBatch(ctx, v3Request(order, lease, retention))
				for i, id := range order {
					if id == ids[0] {
						require.NoError(t, out[i].Err)
						assert.Equal(t, statusCompleted, out[i].Reply.Status, "a completed id is answered")
						continue
					}
					require.Error(t, out[i].Err, "id %s", id)
					assert.Contains(t, out[i].Err.Error(), mode)
					assert.NotErrorIs(t, out[i].Err, ErrCorrupt)
				}
			}
			after, err := admin.HGetAll(ctx, s.v3.index).Result()
			require.NoError(t, err)
			assert.Equal(t, before, after, "the index is as it was")

			// Writes allowed again, the old holder still holds ids[1].
			if mode == "OOM" {
				require.NoError(t, admin.ConfigSet(ctx, "maxmemory", "0").Err())
			}
			done, _ = s.SettleBatch(ctx, markersOf(t, &redistest.Backend{Client: admin}, first[1:2], retention, 2*retention), nil, lease)
			assert.Equal(t, []error{nil}, done, "the refused call fenced no one off")
			claimAll(t, s.ClaimBatch(ctx, v3Request(ids[2:], lease, retention)), ids[2:])
		})
	}
}

// TestV3RecordsOfTheirOwnAreTakenOver: a v3 claim of an id that has a
// record of its own (Do or Begin made it, or a checkpoint moved a claim
// there) takes it over where it lives once its lease ran out, with its
// checkpoints, recovered, at the next attempt, and claims a released one
// again; a live one answers busy, and one of another fingerprint a
// mismatch. The other ids of the call are claimed in the index as usual.
func TestV3RecordsOfTheirOwnAreTakenOver(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s := v3Store(t, b)
		const lease = 300 * time.Millisecond
		ids := v3IDs("own", 5)
		single := func(id, fp string) claimReply {
			r, err := s.Claim(ctx, id, claimRequest{Fingerprint: fp, Attempt: newAttemptID(), Lease: lease, Keep: time.Minute})
			require.NoError(t, err)
			require.Equal(t, statusClaimed, r.Status)
			return r
		}
		lapsed := single(ids[0], "")
		require.NoError(t, s.Checkpoint(ctx, claimFence{ID: ids[0], Token: lapsed.Token}, "step", []byte("one"), time.Minute))
		released := single(ids[1], "")
		require.NoError(t, s.Release(ctx, ids[1], released.Token, time.Minute))
		single(ids[3], "other")
		b.Advance(lease + 50*time.Millisecond)
		single(ids[2], "")

		req := v3Request(ids, lease, time.Minute)
		req.Fingerprints = []string{"", "", "", "", ""}
		out := s.ClaimBatch(ctx, req)
		for i := range out {
			require.NoError(t, out[i].Err, "id %d", i)
		}
		r := out[0].Reply
		assert.Equal(t, statusClaimed, r.Status, "the lapsed record is taken over")
		assert.True(t, r.Recovered)
		assert.Equal(t, 2, r.Attempt)
		assert.Greater(t, r.Token, lapsed.Token)
		assert.Zero(t, r.Ref, "held in its record")
		assert.Equal(t, []recoveryPoint{{Name: "step", Value: []byte("one")}}, r.Checkpoints)
		r = out[1].Reply
		assert.Equal(t, statusClaimed, r.Status, "the released record is claimed again")
		assert.False(t, r.Recovered)
		assert.Equal(t, 2, r.Attempt)
		assert.Greater(t, r.Token, released.Token)
		assert.Zero(t, r.Ref)
		assert.Equal(t, statusInProgress, out[2].Reply.Status, "a live record is busy")
		assert.Greater(t, out[2].Reply.LeaseLeft, time.Duration(0))
		assert.LessOrEqual(t, out[2].Reply.LeaseLeft, lease)
		assert.Equal(t, statusMismatch, out[3].Reply.Status, "another fingerprint")
		assert.Equal(t, statusClaimed, out[4].Reply.Status)
		assert.Positive(t, out[4].Reply.Ref, "a new id is claimed in the index")

		// The old holder is fenced off; the new one completes in the record.
		_, err := s.Complete(ctx, ids[0], lapsed.Token, []byte("old"), time.Minute)
		assert.ErrorIs(t, err, ErrLeaseLost)
		_, err = s.Complete(ctx, ids[0], out[0].Reply.Token, []byte("new"), time.Minute)
		require.NoError(t, err)
		again := s.ClaimBatch(ctx, v3Request(ids[:1], lease, time.Minute))
		require.NoError(t, again[0].Err)
		assert.Equal(t, statusCompleted, again[0].Reply.Status)
	})
}

// TestV3CheckpointMovesTheClaim: a checkpoint of a v3 claim moves it to a
// pending record of its own (its token, attempt, lease end and
// fingerprint), where later checkpoints, renewals and completions go; its
// place in the call record says moved. A moved claim whose lease ran out is
// taken over with its checkpoints, and its old holder fenced off.
func TestV3CheckpointMovesTheClaim(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s := v3Store(t, b)
		const lease = 300 * time.Millisecond
		ids := v3IDs("cp", 2)
		req := v3Request(ids, lease, time.Minute)
		req.Fingerprints = []string{"fa", "fb"}
		first := claimAll(t, s.ClaimBatch(ctx, req), ids)
		for _, f := range first {
			require.NoError(t, s.Checkpoint(ctx, f, "step", []byte("1"), time.Minute))
			require.NoError(t, s.Checkpoint(ctx, f, "next", []byte("2"), time.Minute), "a second checkpoint, in the record")
		}
		rec, err := b.Client.Get(ctx, s.key(ids[0])).Result()
		require.NoError(t, err)
		assert.Contains(t, rec, fmt.Sprintf("i1P%d:1:0:", first[0].Token), "a pending record of the claim's token, attempt 1")
		assert.Contains(t, rec, ":fa:", "with its fingerprint")
		cr, err := b.Client.Get(ctx, v3CallKey(s.v3.calls, first[0].Token)).Result()
		require.NoError(t, err)
		assert.Equal(t, "MM", cr[v3CallHeadSize:v3CallHeadSize+2], "both places moved")

		// Renewed and completed where they live now: the first.
		for _, err := range s.ExtendBatch(ctx, first, lease, time.Minute) {
			require.NoError(t, err)
		}
		done, _ := s.SettleBatch(ctx, markersOf(t, b, first[:1], time.Minute, 2*time.Minute), nil, lease)
		require.Equal(t, []error{nil}, done)

		b.Advance(lease + 50*time.Millisecond)
		req = v3Request(ids, lease, time.Minute)
		req.Fingerprints = []string{"fa", "fb"}
		out := s.ClaimBatch(ctx, req)
		require.NoError(t, out[0].Err)
		assert.Equal(t, statusCompleted, out[0].Reply.Status, "completed in its record")
		require.NoError(t, out[1].Err)
		r := out[1].Reply
		assert.Equal(t, statusClaimed, r.Status, "the second's lease ran out: taken over")
		assert.True(t, r.Recovered)
		assert.Equal(t, 2, r.Attempt)
		assert.Equal(t, []recoveryPoint{{Name: "step", Value: []byte("1")}, {Name: "next", Value: []byte("2")}}, r.Checkpoints)
		done, _ = s.SettleBatch(ctx, markersOf(t, b, first[1:], time.Minute, 2*time.Minute), nil, lease)
		assert.ErrorIs(t, done[0], ErrLeaseLost, "the old holder is fenced off")
		assert.ErrorIs(t, s.Checkpoint(ctx, first[1], "late", nil, time.Minute), ErrLeaseLost)
	})
}

// TestV3SingleClaimsFindTheIndex: Claim (Do and Begin) of an id the v3
// index holds answers from it: a completed claim as a marker (expired past
// its retention), a live one in progress, one of another fingerprint a
// mismatch; one whose lease ran out, or released, is taken over by a
// record of its own at the next attempt, and its old holder's settle is
// refused.
func TestV3SingleClaimsFindTheIndex(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		s := v3Store(t, b)
		const lease, retention = 300 * time.Millisecond, time.Second
		ids := v3IDs("single", 5)
		req := v3Request(ids, lease, retention)
		req.Fingerprints = []string{"f", "f", "f", "f", "f"}
		first := claimAll(t, s.ClaimBatch(ctx, req), ids)
		done, given := s.SettleBatch(ctx, markersOf(t, b, first[:1], retention, 2*retention), first[1:2], lease)
		require.Equal(t, []error{nil}, done)
		require.Equal(t, []error{nil}, given)
		single := func(id, fp string) (claimReply, error) {
			return s.Claim(ctx, id, claimRequest{Fingerprint: fp, Attempt: newAttemptID(), Lease: lease, Keep: time.Minute,
				Retention: retention, MarkerRetention: 2 * retention})
		}

		r, err := single(ids[0], "f")
		require.NoError(t, err)
		assert.Equal(t, statusCompleted, r.Status, "a marker")
		assert.True(t, r.Marker)
		r, err = single(ids[0], "g")
		require.NoError(t, err)
		assert.Equal(t, statusMismatch, r.Status)
		r, err = single(ids[2], "f")
		require.NoError(t, err)
		assert.Equal(t, statusInProgress, r.Status, "a live claim")
		assert.Greater(t, r.LeaseLeft, time.Duration(0))

		r, err = single(ids[1], "f")
		require.NoError(t, err)
		assert.Equal(t, statusClaimed, r.Status, "a released claim is claimed again")
		assert.Equal(t, 2, r.Attempt)
		assert.False(t, r.Recovered)
		assert.Greater(t, r.Token, first[1].Token)

		b.Advance(lease + 50*time.Millisecond)
		r, err = single(ids[2], "f")
		require.NoError(t, err)
		assert.Equal(t, statusClaimed, r.Status, "a lapsed claim is taken over")
		assert.Equal(t, 2, r.Attempt)
		assert.True(t, r.Recovered)
		assert.Greater(t, r.Token, first[2].Token)
		assert.Zero(t, r.Ref)
		done, _ = s.SettleBatch(ctx, markersOf(t, b, first[2:3], retention, 2*retention), nil, lease)
		assert.ErrorIs(t, done[0], ErrLeaseLost, "the old holder is fenced off")
		// The next batch claim finds the record of its own.
		req = v3Request(ids[2:3], lease, retention)
		req.Fingerprints = []string{"f"}
		out := s.ClaimBatch(ctx, req)
		require.NoError(t, out[0].Err)
		assert.Equal(t, statusInProgress, out[0].Reply.Status)

		b.Advance(retention + 100*time.Millisecond)
		r, err = single(ids[0], "f")
		require.NoError(t, err)
		assert.Equal(t, statusResultExpired, r.Status, "past the retention")
	})
}

// TestV3OnAClusterAndARing: the v3 layout serves a Cluster, with an index
// key and call records in each slot its records are in, a batch of one
// slot claimed in one call; and a Ring, whose shards each keep their own
// index under the store's names, every call sent where its record is.
// Consume runs each message once, a redelivery answers from the markers,
// a lease that ran out is taken over, and no key of the v2 layout is made.
func TestV3OnAClusterAndARing(t *testing.T) {
	ctx := context.Background()
	run := func(t *testing.T, client redis.UniversalClient, opts []Option, each func(func(*redis.Client) error) error) {
		k, err := NewRedis(client, append([]Option{WithLease(time.Minute)}, opts...)...)
		require.NoError(t, err)
		s := k.store.(*redisStore)
		require.NotNil(t, s.v3)
		runs := map[string]int{}
		handle := func(_ context.Context, m string) error { runs[m]++; return nil }
		id := func(m string) string { return m }
		msgs := make([]string, 40)
		for i := range msgs {
			msgs[i] = fmt.Sprint("m", i)
		}
		for round := 0; round < 2; round++ {
			res, err := Consume(ctx, k, "s", msgs, id, handle)
			require.NoError(t, err)
			for i, r := range res {
				want := MessageHandled
				if round > 0 {
					want = MessageReplayed
				}
				require.Equal(t, want, r.Status, "round %d, %s: %v", round, msgs[i], r.Err)
			}
		}
		for _, m := range msgs {
			require.Equal(t, 1, runs[m], m)
		}

		// A claim whose lease ran out is taken over, recovered.
		rs, err := k.batchBegin(ctx, "s", []string{"x0", "x1", "x2", "x3"}, withCompactClaims())
		require.NoError(t, err)
		for _, r := range rs {
			require.NoError(t, r.Err)
			require.NotNil(t, r.Outcome.Claim)
		}
		expireLeaseOf(t, s, k.RecordID("s", "x2"))
		again, err := k.batchBegin(ctx, "s", []string{"x2"}, withCompactClaims())
		require.NoError(t, err)
		require.NotNil(t, again[0].Outcome.Claim)
		assert.True(t, again[0].Outcome.Claim.Recovered())
		assert.ErrorIs(t, rs[2].Outcome.Claim.Complete(ctx, nil, 0), ErrLeaseLost)
		require.NoError(t, again[0].Outcome.Claim.Complete(ctx, nil, 0))

		// Every index key is v3's, in its records' slot on a Cluster.
		var index, v2 []string
		var mu sync.Mutex // each runs on the nodes side by side
		require.NoError(t, each(func(c *redis.Client) error {
			keys, err := c.Keys(ctx, DefaultPrefix+"*").Result()
			mu.Lock()
			defer mu.Unlock()
			for _, key := range keys {
				// name is the key past the prefix and a slot's hash tag:
				// a v3 call record's name ends in its token, 6 bytes
				// that may spell anything.
				name := strings.TrimPrefix(key, DefaultPrefix)
				if tag, rest, ok := strings.Cut(name, "}"); ok && strings.HasPrefix(tag, "{") {
					name = rest
				}
				switch {
				case strings.HasPrefix(name, "c3:"):
				case name == "i3":
					index = append(index, key)
				case name == "i" || strings.HasPrefix(name, "i:") || strings.HasPrefix(name, "c:"):
					v2 = append(v2, key)
				}
			}
			return err
		}))
		assert.NotEmpty(t, index)
		assert.Empty(t, v2, "keys of the v2 layout")
		for _, m := range append(msgs, "x0") {
			rec := s.key(k.RecordID("s", m))
			want, _ := s.v3Names(rec)
			assert.Contains(t, index, want, m)
			if s.compact.cluster {
				assert.Equal(t, keySlot(rec), keySlot(want), m)
			}
		}
	}

	t.Run("cluster", func(t *testing.T) {
		cl := redistest.StartCluster(t, 2, 0)
		cc := cl.Client(t, nil)
		run(t, cc, []Option{WithScopeShards(2)}, func(f func(*redis.Client) error) error {
			return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return f(c) })
		})
	})
	t.Run("ring", func(t *testing.T) {
		a, b := redistest.Start(t), redistest.Start(t)
		ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": a.Addr, "b": b.Addr}})
		t.Cleanup(func() { ring.Close() })
		run(t, ring, nil, func(f func(*redis.Client) error) error {
			return ring.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error { return f(c) })
		})
	})
}

// TestPrefixOfTheOtherLayoutIsRefused: a store never writes under a prefix
// of another layout. The prefix's record says v3 once a store wrote under
// it; one that says v2 (written by a build before v3), or a v2 index with
// no record beside it, makes a store refuse with ErrInvalidConfig before it
// writes anything or runs a handler.
func TestPrefixOfTheOtherLayoutIsRefused(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		msgs := []string{"a", "b", "c", "d"}
		refused := func(t *testing.T) {
			t.Helper()
			k, err := NewRedis(b.Client)
			require.NoError(t, err)
			before, err := b.Client.Keys(ctx, "*").Result()
			require.NoError(t, err)
			consumeRefused(t, k, msgs)
			_, err = Do(ctx, k, "s", "e", func(context.Context) (int, error) { return 1, nil })
			assert.ErrorIs(t, err, ErrInvalidConfig)
			after, err := b.Client.Keys(ctx, "*").Result()
			require.NoError(t, err)
			assert.ElementsMatch(t, before, after, "written under a prefix of the other layout")
		}
		t.Run("v3 written", func(t *testing.T) {
			require.NoError(t, b.Client.FlushAll(ctx).Err())
			k, err := NewRedis(b.Client)
			require.NoError(t, err)
			res, err := Consume(ctx, k, "s", msgs, func(m string) string { return m }, func(context.Context, string) error { return nil })
			require.NoError(t, err)
			for _, r := range res {
				require.Equal(t, MessageHandled, r.Status)
			}
			rec, err := b.Client.Get(ctx, prefixRecordKey(DefaultPrefix)).Result()
			require.NoError(t, err)
			assert.Equal(t, "v3 shards=0", rec)
		})
		t.Run("v2 recorded", func(t *testing.T) {
			require.NoError(t, b.Client.FlushAll(ctx).Err())
			require.NoError(t, b.Client.Set(ctx, prefixRecordKey(DefaultPrefix), "v2 shards=0", 0).Err())
			refused(t)
		})
		t.Run("v2 index without a record", func(t *testing.T) {
			require.NoError(t, b.Client.FlushAll(ctx).Err())
			require.NoError(t, b.Client.HSet(ctx, DefaultPrefix+"i:0", "", "v2 2 1 10").Err())
			refused(t)
		})
	})
}
