package idem

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// resendScripts sends every pipeline that holds a script twice, as go-redis does
// when the reply of the first was lost: the first run's replies are dropped.
type resendScripts struct{ on atomic.Bool }

func (h *resendScripts) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *resendScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.on.Load() && (cmd.Name() == "evalsha" || cmd.Name() == "eval") {
			_ = next(ctx, cmd)
		}
		return next(ctx, cmd)
	}
}
func (h *resendScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.on.Load() && slices.ContainsFunc(cmds, func(c redis.Cmder) bool { return c.Name() == "evalsha" || c.Name() == "eval" }) {
			_ = next(ctx, cmds)
		}
		return next(ctx, cmds)
	}
}

// TestCompactClaimResentWaitsForReplicas: a claim answered by a resent script
// (its first reply lost) waits for the replicas as a new one does. With WithReplicas(1, ...) on a
// master that has no replica, no claim may be acknowledged (every one is a
// *ReplicationError, as TestBatchWithReplicas asserts on a clean line). When
// the claim's reply is lost and go-redis sends the script again (with its
// WAIT), a claim kept in a record is still refused (the second run answers
// code 1, "written"), but a compact claim is acknowledged: the second run
// answers code 10 ("claimed by an earlier run of this call"), which the
// claim step's wrote() does not count as a write, so WAIT's 0 is ignored.
func TestCompactClaimResentWaitsForReplicas(t *testing.T) {
	srv := redistest.Start(t) // a master with no replica: WAIT 1 answers 0
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { c.Close() })
	h := &resendScripts{}
	c.AddHook(h)
	k, err := NewRedis(c, WithReplicas(1, 50*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, k.store.(*RedisStore).LoadScripts(ctx))
	h.on.Store(true)

	for _, compact := range []bool{false, true} {
		t.Run(fmt.Sprintf("compact=%v", compact), func(t *testing.T) {
			keys := []string{fmt.Sprint("a", compact), fmt.Sprint("b", compact), fmt.Sprint("c", compact)}
			var opts []Option
			if compact {
				opts = append(opts, WithCompactClaims())
			}
			res, err := k.BeginBatch(ctx, "s", keys, opts...)
			require.NoError(t, err)
			for i, r := range res {
				var re *ReplicationError
				assert.True(t, errors.As(r.Err, &re), "%s: a claim no replica acknowledged was answered %v (claim %v)", keys[i], r.Err, r.Outcome.Claim != nil)
			}
		})
	}

	// Consume: the handler runs on a claim no replica has.
	h.on.Store(true)
	ran := 0
	_, err = Consume(ctx, k, "s", []string{"m1", "m2"}, func(m string) string { return m }, func(context.Context, string) error {
		ran++
		return nil
	})
	require.NoError(t, err)
	assert.Zero(t, ran, "handlers ran on claims that no replica acknowledged")
}
