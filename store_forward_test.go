package idem

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// forwardStore is a store that only forwards each call to the store it
// holds, and counts the calls by method. It embeds nothing, so a Keeper on
// it reaches the redisStore behind it through the store interface only.
type forwardStore struct {
	s     recordStore
	mu    sync.Mutex
	calls map[string]int
	// compact counts the calls that named a compact claim (claimFence.Ref > 0)
	// or asked for compact claims, by method.
	compact map[string]int
}

var _ recordStore = (*forwardStore)(nil)

func newForwardStore(s recordStore) *forwardStore {
	return &forwardStore{s: s, calls: map[string]int{}, compact: map[string]int{}}
}

func (f *forwardStore) count(method string, compact bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls[method]++
	if compact {
		f.compact[method]++
	}
}

// anyCompact reports whether a fence of fs names a compact claim.
func anyCompact(fs []claimFence) bool {
	for _, f := range fs {
		if f.Ref > 0 {
			return true
		}
	}
	return false
}

func (f *forwardStore) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	f.count("Claim", false)
	return f.s.Claim(ctx, id, req)
}

func (f *forwardStore) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (bool, error) {
	f.count("Complete", false)
	return f.s.Complete(ctx, id, token, value, keep)
}

func (f *forwardStore) Release(ctx context.Context, id string, token int64, keep time.Duration) error {
	f.count("Release", false)
	return f.s.Release(ctx, id, token, keep)
}

func (f *forwardStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	f.count("Extend", false)
	return f.s.Extend(ctx, id, token, lease, keep)
}

func (f *forwardStore) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	f.count("ClaimBatch", req.Compact)
	return f.s.ClaimBatch(ctx, req)
}

func (f *forwardStore) SettleBatch(ctx context.Context, items []batchCompletion, release []claimFence, keep time.Duration) (done, given []error) {
	fences := make([]claimFence, 0, len(items)+len(release))
	for _, it := range items {
		fences = append(fences, it.claimFence)
	}
	f.count("SettleBatch", anyCompact(append(fences, release...)))
	return f.s.SettleBatch(ctx, items, release, keep)
}

func (f *forwardStore) ExtendBatch(ctx context.Context, claims []claimFence, lease, keep time.Duration) []error {
	f.count("ExtendBatch", anyCompact(claims))
	return f.s.ExtendBatch(ctx, claims, lease, keep)
}

func (f *forwardStore) Checkpoint(ctx context.Context, claim claimFence, name string, value []byte, keep time.Duration) error {
	f.count("Checkpoint", claim.Ref > 0)
	return f.s.Checkpoint(ctx, claim, name, value, keep)
}

func (f *forwardStore) Inspect(ctx context.Context, id string) (Record, error) {
	f.count("Inspect", false)
	return f.s.Inspect(ctx, id)
}

func (f *forwardStore) Forget(ctx context.Context, id string, token int64, force bool) (Record, error) {
	f.count("Forget", false)
	return f.s.Forget(ctx, id, token, force)
}

func (f *forwardStore) Abandon(ctx context.Context, id string, token int64) (Record, error) {
	f.count("Abandon", false)
	return f.s.Abandon(ctx, id, token)
}

// TestStoreInterfaceIsTheOnlyWayIn: a Keeper on a store that only forwards
// each call to a redisStore answers Do, Consume (compact claims, their
// checkpoints and markers included), BeginBatch, the batch steps, Inspect,
// Forget and Abandon exactly as a Keeper on the redisStore itself does.
func TestStoreInterfaceIsTheOnlyWayIn(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		direct, err := openRedisStore(b.Client, WithPrefix("direct:"))
		require.NoError(t, err)
		opts := []Option{WithLease(time.Minute), WithReplayCache(100, 1<<20, time.Hour)}
		kd, err := keeperOn(direct, opts...)
		require.NoError(t, err)

		behind, err := openRedisStore(b.Client, WithPrefix("forward:"))
		require.NoError(t, err)
		fwd := newForwardStore(behind)
		kf, err := keeperOn(fwd, opts...)
		require.NoError(t, err)

		want := storeTranscript(t, kd)
		for _, line := range []string{
			`do: "result" err=<nil> runs=1 cache hits=1`,
			`consume [m1 m2 m1 bad]: [handled ack=true handled ack=true duplicate ack=true retry ack=false]`,
			`handle bad: attempt=2 recovered=false checkpoints=1`,
			`consume [m1 m2 bad]: [replayed ack=true replayed ack=true handled ack=true]`,
			`inspect m1: state=completed attempt=1 recovered=false compact=true stored=bytes size=0 checkpoints=[] err=<nil>`,
			`inspect b2: state=released attempt=1 recovered=false compact=true stored=none size=0 checkpoints=[] err=<nil>`,
			`begin held again: attempt=2 recovered=true checkpoints=[{step [51 51 51]}]`,
			`inspect held: state=absent attempt=0 recovered=false compact=false stored=none size=0 checkpoints=[] err=<nil>`,
		} {
			require.Contains(t, want, line, "the RedisStore's own answers")
		}
		got := storeTranscript(t, kf)
		assert.Equal(t, want, got, "the same answers through the interface")

		for _, m := range []string{"Claim", "Complete", "ClaimBatch", "SettleBatch", "ExtendBatch", "Checkpoint", "Inspect", "Forget", "Abandon"} {
			assert.Positive(t, fwd.calls[m], "%s went through the forwarding Store", m)
		}
		for _, m := range []string{"ClaimBatch", "SettleBatch", "ExtendBatch", "Checkpoint"} {
			assert.Positive(t, fwd.compact[m], "%s of a compact claim went through the forwarding Store", m)
		}
	})
}

// storeTranscript takes k through every path that reaches its store and
// writes down what each answered, leaving out what differs from one run to
// the next (tokens, times).
func storeTranscript(t *testing.T, k *Keeper) []string {
	t.Helper()
	ctx := context.Background()
	var out []string
	note := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	record := func(what string, r Record, err error) {
		names := make([]string, len(r.Checkpoints))
		for i, c := range r.Checkpoints {
			names[i] = fmt.Sprintf("%s/%d", c.Name, c.Size)
		}
		note("%s: state=%v attempt=%d recovered=%v compact=%v stored=%v size=%d checkpoints=%v err=%v",
			what, r.State, r.Attempt, r.Recovered, r.Compact, r.Stored, r.Size, names, err)
	}

	// Do: a first run, then a replay, from the replay cache, which the
	// store's Complete filled (it said it stored the result).
	runs := 0
	do := func(context.Context) (string, error) { runs++; return "result", nil }
	for range 2 {
		v, err := Do(ctx, k, "s", "do", do)
		note("do: %q err=%v runs=%d cache hits=%d", v, err, runs, k.ReplayCacheStats().Hits)
	}

	// Consume: compact claims; one handler checkpoints then fails, so its
	// claim moves to a record of its own and is released with the
	// checkpoint; the next delivery is handed it.
	var mu sync.Mutex
	var handled []string // in the order of the batch, whatever the order of the handlers
	handle := func(ctx context.Context, m msg) error {
		c, _ := ClaimFromContext(ctx)
		mu.Lock()
		handled = append(handled, fmt.Sprintf("handle %s: attempt=%d recovered=%v checkpoints=%d", m.ID, c.Attempt(), c.Recovered(), len(c.allCheckpoints())))
		mu.Unlock()
		if m.ID == "bad" {
			if _, done := c.Checkpointed("step"); !done {
				if err := c.Checkpoint(ctx, "step", []byte("1")); err != nil {
					return err
				}
				return errors.New("failed after its first step")
			}
		}
		return nil
	}
	for _, batch := range [][]string{{"m1", "m2", "m1", "bad"}, {"m1", "m2", "bad"}} {
		handled = nil
		res, err := Consume(ctx, k, "s", msgs(batch...), msgID, handle)
		require.NoError(t, err)
		slices.Sort(handled)
		out = append(out, handled...)
		note("consume %v: %v", batch, statuses(res))
	}
	for _, key := range []string{"m1", "bad", "do"} {
		r, err := k.Inspect(ctx, "s", key)
		record("inspect "+key, r, err)
	}

	// BeginBatch with compact claims, and each batch step.
	got, err := k.batchBegin(ctx, "s", []string{"b1", "b2", "b3"}, withCompactClaims())
	require.NoError(t, err)
	claims := make([]*Claim, len(got))
	for i, r := range got {
		claims[i] = r.Outcome.Claim
		note("begin batch %d: claimed=%v err=%v", i, claims[i] != nil, r.Err)
	}
	note("extend batch: %v", k.extendClaims(ctx, claims))
	note("checkpoint b3: %v", claims[2].Checkpoint(ctx, "step", []byte("22")))
	note("release batch: %v", k.releaseClaims(ctx, claims[1:2]))
	note("complete batch: %v", k.completeClaims(ctx, []completion{{Claim: claims[0]}, {Claim: claims[2], Value: []byte("v3")}}))
	for _, key := range []string{"b1", "b2", "b3"} {
		r, err := k.Inspect(ctx, "s", key)
		record("inspect "+key, r, err)
	}

	// Abandon a live claim: the next claim takes it over, recovered, with
	// its checkpoint.
	held, err := k.Begin(ctx, "s", "held")
	require.NoError(t, err)
	require.NoError(t, held.Claim.Checkpoint(ctx, "step", []byte("333")))
	r, err := k.abandonKey(ctx, "s", "held", held.Claim.Token())
	record("abandon held", r, err)
	again, err := k.Begin(ctx, "s", "held")
	require.NoError(t, err)
	note("begin held again: attempt=%d recovered=%v checkpoints=%v", again.Claim.Attempt(), again.Claim.Recovered(), again.Claim.allCheckpoints())
	require.NoError(t, again.Claim.Complete(ctx, []byte("done"), 0))

	// Forget, without and with a token, then the keys are absent.
	r, err = k.Forget(ctx, "s", "do", false)
	record("forget do", r, err)
	r, err = k.forgetToken(ctx, "s", "held", again.Claim.Token(), false)
	record("forget held", r, err)
	for _, key := range []string{"do", "held"} {
		r, err := k.Inspect(ctx, "s", key)
		record("inspect "+key, r, err)
	}
	return out
}
