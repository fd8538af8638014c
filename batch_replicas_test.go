package idem

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestBatchWithReplicas: with WithReplicas, a batch's claims, completions,
// renewals and checkpoints are acknowledged only once the replicas have
// them; each record the replicas did not acknowledge gets its own
// *ReplicationError, and Consume runs no handler for a claim that was not
// replicated.
func TestBatchWithReplicas(t *testing.T) {
	master := redistest.Start(t)
	replica := redistest.StartReplica(t, master.Addr)
	mc, rc := master.Client(t), replica.Client(t)
	ctx := context.Background()
	for name, client := range map[string]func() redis.Scripter{
		"client": func() redis.Scripter { return mc },
		"conn":   func() redis.Scripter { c := mc.Conn(); t.Cleanup(func() { c.Close() }); return c },
	} {
		t.Run(name, func(t *testing.T) {
			k := replicatedKeeper(t, client(), WithReplicas(1, time.Second))
			keys := make([]string, 450) // three chunks
			for i := range keys {
				keys[i] = fmt.Sprint(name, "-", i)
			}
			res, err := k.batchBegin(ctx, "s", keys)
			require.NoError(t, err)
			var items []completion
			var claims []*Claim
			for _, r := range res {
				require.NoError(t, r.Err)
				claims = append(claims, r.Outcome.Claim)
				items = append(items, completion{Claim: r.Outcome.Claim, Value: []byte("v")})
			}
			require.NoError(t, claims[0].Checkpoint(ctx, "step", nil))
			for _, err := range k.extendClaims(ctx, claims) {
				require.NoError(t, err)
			}
			for _, err := range k.completeClaims(ctx, items) {
				require.NoError(t, err)
			}
			v, err := rc.Get(ctx, k.store.(*redisStore).RecordKey("s", keys[len(keys)-1])).Result()
			require.NoError(t, err, "the replica has the completion")
			assert.Contains(t, v, "i1C")
		})
	}

	two := replicatedKeeper(t, mc, WithReplicas(2, 300*time.Millisecond))
	ran := 0
	res, err := Consume(ctx, two, "s", []string{"two-a", "two-b"}, func(s string) string { return s }, func(context.Context, string) error {
		ran++
		return nil
	})
	require.NoError(t, err)
	assert.Zero(t, ran, "no handler runs on a claim the replicas did not acknowledge")
	for _, r := range res {
		var re *ReplicationError
		require.ErrorAs(t, r.Err, &re)
		assert.Equal(t, "claim", re.Op)
		assert.Equal(t, 1, re.Acked)
		assert.Equal(t, MessageRetry, r.Status)
	}

	one := replicatedKeeper(t, mc, WithReplicas(1, 300*time.Millisecond))
	got, err := one.batchBegin(ctx, "s", []string{"late-a", "late-b"})
	require.NoError(t, err)
	replica.Pause(t)
	errs := one.completeClaims(ctx, []completion{{Claim: got[0].Outcome.Claim}, {Claim: got[1].Outcome.Claim}})
	replica.Resume(t)
	for _, err := range errs {
		var re *ReplicationError
		require.ErrorAs(t, err, &re)
		assert.Equal(t, "complete", re.Op)
		assert.ErrorIs(t, err, ErrUnavailable)
	}
	out, err := one.Begin(ctx, "s", "late-a")
	require.NoError(t, err)
	assert.True(t, out.Replayed, "the completion is on the master")
}

// replicatedKeeper is a Keeper on a redisStore of c with ropts.
func replicatedKeeper(t *testing.T, c redis.Scripter, ropts ...Option) *Keeper {
	t.Helper()
	s, err := openRedisStore(c, ropts...)
	require.NoError(t, err)
	k, err := keeperOn(s)
	require.NoError(t, err)
	return k
}
