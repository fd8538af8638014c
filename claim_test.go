package idem

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A claim says what it was asked for: the scope and the key, whichever way
// it was made.
func TestClaimScopeAndKey(t *testing.T) {
	k := newKeeper(t, redistest.Miniredis(t))
	ctx := context.Background()

	out, err := k.Begin(ctx, "acme", "order-1")
	require.NoError(t, err)
	require.NotNil(t, out.Claim)
	assert.Equal(t, "acme", out.Claim.Scope())
	assert.Equal(t, "order-1", out.Claim.Key())
	require.NoError(t, out.Claim.Release(ctx))

	var scope, key string
	_, err = Do(ctx, k, "globex", "order-2", func(ctx context.Context) (int, error) {
		c, ok := ClaimFromContext(ctx)
		require.True(t, ok)
		scope, key = c.Scope(), c.Key()
		return 1, nil
	})
	require.NoError(t, err)
	assert.Equal(t, "globex", scope)
	assert.Equal(t, "order-2", key)

	keys := []string{"m-1", "m-2", "m-1", "m-3"}
	res, err := k.batchBegin(ctx, "orders", keys)
	require.NoError(t, err)
	for i, r := range res {
		if i == 2 {
			assert.ErrorIs(t, r.Err, ErrDuplicate)
			continue
		}
		require.NoError(t, r.Err)
		assert.Equal(t, "orders", r.Outcome.Claim.Scope(), "place %d", i)
		assert.Equal(t, keys[i], r.Outcome.Claim.Key(), "place %d", i)
	}

	var mu sync.Mutex
	seen := map[string]string{}
	_, err = Consume(ctx, k, "inbox", []string{"a", "b"}, func(m string) string { return "msg-" + m },
		func(ctx context.Context, m string) error {
			c, _ := ClaimFromContext(ctx)
			mu.Lock()
			defer mu.Unlock()
			seen[m] = c.Scope() + "/" + c.Key()
			return nil
		})
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"a": "inbox/msg-a", "b": "inbox/msg-b"}, seen)
}

// A context without a claim gives none, and the nil claim answers zero
// values and ErrNoClaim instead of panicking.
func TestNilClaim(t *testing.T) {
	ctx := context.Background()
	for name, ctx := range map[string]context.Context{
		"no claim":  ctx,
		"nil claim": contextWithClaim(ctx, nil),
	} {
		c, ok := ClaimFromContext(ctx)
		assert.False(t, ok, name)
		assert.Nil(t, c, name)
	}

	var c *Claim
	assert.Zero(t, c.Token())
	assert.Zero(t, c.Attempt())
	assert.False(t, c.Recovered())
	assert.Empty(t, c.Scope())
	assert.Empty(t, c.Key())
	assert.Nil(t, c.allCheckpoints())
	v, done := c.Checkpointed("charged")
	assert.Nil(t, v)
	assert.False(t, done)
	for step, err := range map[string]error{
		"Complete":   c.Complete(ctx, []byte("x"), 0),
		"Release":    c.Release(ctx),
		"Extend":     c.Extend(ctx),
		"Checkpoint": c.Checkpoint(ctx, "charged", nil),
		"Held":       c.Held(0),
	} {
		assert.ErrorIs(t, err, ErrNoClaim, step)
		assert.NotErrorIs(t, err, ErrLeaseLost, step)
	}
	op, stop := c.KeepAlive(ctx)
	require.Error(t, op.Err(), "nothing to keep alive: cancelled before it starts")
	assert.ErrorIs(t, context.Cause(op), ErrNoClaim)
	assert.ErrorIs(t, stop(), ErrNoClaim)
}

// Held answers from the local lease end alone: nil while more than the
// margin is left, ErrLeaseLost once the lease, less the margin, has run out
// by the Keeper's clock (a process that was paused), and nil again once a
// renewal moved the lease end.
func TestClaimHeld(t *testing.T) {
	b := redistest.Miniredis(t)
	var mu sync.Mutex
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	k := newKeeper(t, b, WithLease(10*time.Second), WithClock(clock))
	ctx := context.Background()

	out, err := k.Begin(ctx, "acme", "order-1")
	require.NoError(t, err)
	c := out.Claim
	require.NoError(t, c.Held(0))
	require.NoError(t, c.Held(9*time.Second))
	assert.ErrorIs(t, c.Held(10*time.Second), ErrLeaseLost, "no more than the margin left")

	advance(8 * time.Second) // paused, by this process's clock
	require.NoError(t, c.Held(time.Second))
	err = c.Held(3 * time.Second)
	assert.ErrorIs(t, err, ErrLeaseLost)
	assert.Contains(t, err.Error(), "2s of the lease left")

	advance(3 * time.Second) // past the lease
	assert.ErrorIs(t, c.Held(0), ErrLeaseLost)

	// Redis's clock has not moved: the claim is still the holder there, and
	// a renewal from now moves the local lease end.
	require.NoError(t, c.Extend(ctx))
	require.NoError(t, c.Held(9*time.Second))
	require.NoError(t, c.Release(ctx))
}
