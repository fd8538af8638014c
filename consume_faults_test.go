package idem

// Consume and the batch calls keep every per-key promise in the failure
// modes a consumer meets: a claim answered after its lease ran out, a key
// repeated in a batch with another body, a Redis that refuses writes, a
// renewal that never returns.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lateClaims is a RedisStore whose claim answers come back only after late
// has run: a reply held up (a slow network, a resend after a lost reply, a
// paused process) while the lease goes on running in Redis.
type lateClaims struct {
	*RedisStore
	late func()
}

func (s *lateClaims) Claim(ctx context.Context, id string, req ClaimRequest) (ClaimReply, error) {
	r, err := s.RedisStore.Claim(ctx, id, req)
	s.late()
	return r, err
}

func (s *lateClaims) ClaimBatch(ctx context.Context, req BatchClaimRequest) []BatchClaimReply {
	r := s.RedisStore.ClaimBatch(ctx, req)
	s.late()
	return r
}

func lateKeeper(t *testing.T, b *redistest.Backend, key string) (*Keeper, **Claim) {
	rs, err := NewRedisStore(b.Client)
	require.NoError(t, err)
	var other *Claim
	s := &lateClaims{RedisStore: rs, late: func() { other = takeOver(t, b, "s", key) }}
	k, err := New(s, WithLease(300*time.Millisecond), WithRetention(time.Minute))
	require.NoError(t, err)
	return k, &other
}

// TestDoDoesNotRunALateClaimTakenOver: the reference, single key.
func TestDoDoesNotRunALateClaimTakenOver(t *testing.T) {
	b := redistest.Real(t)
	k, other := lateKeeper(t, b, "single")
	var ran atomic.Bool
	_, err := Do(context.Background(), k, "s", "single", func(ctx context.Context) (int, error) { ran.Store(true); return 1, nil })
	assert.ErrorIs(t, err, ErrLeaseLost)
	assert.False(t, ran.Load(), "Do ran a function whose claim was taken over before its answer came")
	require.NotNil(t, *other)
}

// TestConsumeDoesNotRunALateClaimTakenOver: a batch claim answered after its
// lease ran out, whose key another consumer took over meanwhile, is answered
// MessageRetry and its handler never starts.
func TestConsumeDoesNotRunALateClaimTakenOver(t *testing.T) {
	b := redistest.Real(t)
	k, other := lateKeeper(t, b, "m1")
	var ran atomic.Bool
	res, err := Consume(context.Background(), k, "s", msgs("m1"), msgID, func(ctx context.Context, m msg) error {
		ran.Store(true)
		return nil
	})
	require.NoError(t, err)
	require.NotNil(t, *other, "another consumer holds the key")
	assert.False(t, ran.Load(), "Consume ran a handler while another consumer held its key (token %d)", (*other).Token())
	assert.Equal(t, MessageRetry, res[0].Status)
}

// TestConsumeRepeatedKeyWithOtherFingerprintIsRejected: two messages with
// one key and different bodies (fingerprints) in one batch. The first is
// handled; the second is another request under a used key, which the README
// answers MessageRejected ("used with another fingerprint (WithFingerprints)
// ... MessageRejected, false") and which Consume does answer so when it comes
// in the next batch. In the same batch it is acknowledged as a duplicate:
// its content is dropped without running and without being dead-lettered.
func TestConsumeRepeatedKeyWithOtherFingerprintIsRejected(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		var mu sync.Mutex
		handled := map[string]int{}
		handle := func(ctx context.Context, m msg) error {
			mu.Lock()
			handled[m.Body]++
			mu.Unlock()
			return nil
		}
		batch := []msg{{ID: "order-1", Body: "charge 10"}, {ID: "order-1", Body: "charge 99"}}
		fps := [][]byte{[]byte(batch[0].Body), []byte(batch[1].Body)}
		res, err := Consume(ctx, k, "orders", batch, msgID, handle, WithFingerprints(fps))
		require.NoError(t, err)
		require.Equal(t, MessageHandled, res[0].Status)
		assert.Equal(t, 1, handled["charge 10"])
		assert.Equal(t, 0, handled["charge 99"], "the other body never ran")

		// The same second message, in the next batch: rejected.
		again, err := Consume(ctx, k, "orders", batch[1:], msgID, handle, WithFingerprints(fps[1:]))
		require.NoError(t, err)
		require.Equal(t, MessageRejected, again[0].Status, "next batch: another fingerprint is rejected")
		assert.ErrorIs(t, again[0].Err, ErrMismatch)
		assert.False(t, again[0].Ack)

		// In the first batch it must not be acknowledged either.
		assert.False(t, res[1].Ack, "a message with another fingerprint was acknowledged without running (status %s, err %v)", res[1].Status, res[1].Err)
		assert.NotEqual(t, MessageDuplicate, res[1].Status, "another fingerprint is no duplicate")
	})
}

// markerModes runs f with markers on (the default) and WithoutMarkers: the
// batch scripts of both.
func markerModes(t *testing.T, f func(t *testing.T, opts ...Option)) {
	t.Run("markers", func(t *testing.T) { f(t) })
	t.Run("records", func(t *testing.T) { f(t, WithoutMarkers()) })
}

// TestBatchClaimOnReadOnlyReplicaIsUnavailable: a Redis that is READONLY
// answers ErrUnavailable, never anything else, for a batch as for one key
// (TestReadOnlyReplicaIsUnavailable): BeginBatch answers each key
// ErrUnavailable, Consume MessageRetry.
func TestBatchClaimOnReadOnlyReplicaIsUnavailable(t *testing.T) {
	markerModes(t, batchClaimOnReadOnlyReplica)
}

func batchClaimOnReadOnlyReplica(t *testing.T, opts ...Option) {
	master := redistest.Real(t)
	replica := redistest.Real(t)
	ctx := context.Background()
	addr := strings.Split(master.Client.Options().Addr, ":")
	require.NoError(t, replica.Client.SlaveOf(ctx, addr[0], addr[1]).Err())
	k := newKeeper(t, replica, opts...)

	_, err := k.Begin(ctx, "s", "single")
	require.ErrorIs(t, err, ErrUnavailable, "a single claim on the replica: unavailable")

	res, err := k.BeginBatch(ctx, "s", []string{"b1", "b2"})
	require.NoError(t, err)
	for i, r := range res {
		assert.ErrorIs(t, r.Err, ErrUnavailable, "key %d: a batch claim on the replica must be unavailable, got %v", i, r.Err)
		assert.NotErrorIs(t, r.Err, ErrCorrupt, "key %d: nothing is corrupt", i)
	}

	ran := 0
	out, err := Consume(ctx, k, "s", msgs("m1"), msgID, func(context.Context, msg) error { ran++; return nil })
	require.ErrorIs(t, err, ErrUnavailable, "no claim of the batch was taken: the loop backs off")
	assert.Equal(t, 0, ran)
	assert.Equal(t, MessageRetry, out[0].Status, "a read-only replica is a retry, not a poison message: %v", out[0].Err)
}

// TestBatchClaimUnderOOMIsUnavailable: under maxmemory-policy noeviction a
// full Redis refuses writes: a claim then fails with ErrUnavailable (wrapping
// OOM) and completed keys are still replayed, in a batch as for one key.
func TestBatchClaimUnderOOMIsUnavailable(t *testing.T) {
	markerModes(t, batchClaimUnderOOM)
}

func batchClaimUnderOOM(t *testing.T, opts ...Option) {
	srv := redistest.Start(t, "--maxmemory", "16mb", "--maxmemory-policy", "noeviction")
	client := redistest.NewClient(t, srv.Addr)
	k, err := NewRedis(client, append(opts, WithLease(time.Hour))...)
	require.NoError(t, err)
	ctx := context.Background()

	// A completed key, before Redis is full.
	out, err := k.Begin(ctx, "s", "done")
	require.NoError(t, err)
	require.NoError(t, out.Claim.Complete(ctx, []byte("result"), 0))

	// Fill Redis, then lower maxmemory below what it uses: every write is
	// refused from then on (OOM), reads are not.
	filler := strings.Repeat("x", 4096)
	for i := 0; i < 300; i++ {
		require.NoError(t, client.Set(ctx, fmt.Sprintf("filler-%d", i), filler, 0).Err())
	}
	require.NoError(t, client.ConfigSet(ctx, "maxmemory", "1mb").Err())
	require.ErrorContains(t, client.Set(ctx, "probe", "x", 0).Err(), "OOM")

	_, err = k.Begin(ctx, "s", "new-single")
	require.ErrorIs(t, err, ErrUnavailable, "a single claim: unavailable (OOM)")
	single, err := k.Begin(ctx, "s", "done")
	require.NoError(t, err, "a single claim of a completed key is still replayed")
	require.True(t, single.Replayed)

	res, err := k.BeginBatch(ctx, "s", []string{"new-batch", "done"})
	require.NoError(t, err)
	assert.ErrorIs(t, res[0].Err, ErrUnavailable, "new key in a batch under OOM: want unavailable, got %v", res[0].Err)
	assert.NotErrorIs(t, res[0].Err, ErrCorrupt)
	if assert.NoError(t, res[1].Err, "completed key in a batch under OOM: still replayed") {
		assert.True(t, res[1].Outcome.Replayed)
	}

	ran := 0
	cons, err := Consume(ctx, k, "s", msgs("new-msg", "done"), msgID, func(context.Context, msg) error { ran++; return nil })
	require.NoError(t, err)
	assert.Equal(t, 0, ran)
	assert.Equal(t, MessageRetry, cons[0].Status, "a full Redis is a retry, not a poison message: %v", cons[0].Err)
	assert.Equal(t, MessageReplayed, cons[1].Status, "a completed key is replayed: %v", cons[1].Err)
}

// TestConsumeCancelsWhenTheLeaseRunsOutDuringAHungRenewal: the same for
// Consume, whose handlers' contexts are cancelled "if the renewals find its
// lease lost": a hung ExtendBatch finds nothing, and the redelivery runs the
// message beside the live handler.
func TestConsumeCancelsWhenTheLeaseRunsOutDuringAHungRenewal(t *testing.T) {
	b := redistest.Real(t)
	h := newHangingStore(t, b)
	const lease = 600 * time.Millisecond
	k, err := New(h, WithLease(lease), WithRetention(time.Minute))
	require.NoError(t, err)
	h.setHang(true)

	started := make(chan context.Context, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		_, _ = Consume(context.Background(), k, "s", msgs("m1"), msgID, func(ctx context.Context, m msg) error {
			started <- ctx
			select {
			case <-ctx.Done():
			case <-time.After(30 * time.Second):
			}
			return nil
		})
	}()
	opCtx := <-started
	<-h.entered

	second := takeOver(t, b, "s", "m1")
	t.Logf("redelivery took the message over with token %d while the first handler runs", second.Token())
	select {
	case <-opCtx.Done():
		assert.ErrorIs(t, context.Cause(opCtx), ErrLeaseLost)
	case <-time.After(3 * time.Second):
		assert.Fail(t, "the first handler's context is still live after its lease ran out and a redelivery took the message over")
	}
	h.unblock()
	<-finished
}

// unreachableAnswer reports whether Consume's error err is its answer to a
// batch none of whose claims reached the store: wrapping ErrUnavailable,
// every message answered, none acknowledged.
func unreachableAnswer(res []MessageResult, err error) bool {
	if !errors.Is(err, ErrUnavailable) || res == nil {
		return false
	}
	for _, r := range res {
		if r.Ack || r.Ran {
			return false
		}
	}
	return true
}
