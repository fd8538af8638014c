package idem

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestObserverSeesOperators: Inspect, Forget and Abandon are each reported
// once, with the record they found and what they came to: a Forget refused
// by a live lease is in progress, one refused by checkpoints is refused.
func TestObserverSeesOperators(t *testing.T) {
	b := redistest.Miniredis(t)
	ctx := context.Background()
	rec := &recorder{}
	k := newKeeper(t, b, WithObserver(rec), WithLease(time.Minute))
	last := func(step Step) Event {
		t.Helper()
		evs := rec.take()
		require.NotEmpty(t, evs)
		ev := evs[len(evs)-1]
		require.Equal(t, step, ev.Step)
		return ev
	}

	out, err := k.Begin(ctx, "s", "op")
	require.NoError(t, err)
	c := out.Claim
	require.NoError(t, c.Checkpoint(ctx, "charged", []byte("ch_1")))
	rec.take()

	r, err := k.Inspect(ctx, "s", "op")
	require.NoError(t, err)
	ev := last(StepInspect)
	assert.Equal(t, ResultDone, ev.Result)
	assert.Equal(t, r.ID, ev.ID)
	assert.Equal(t, c.Token(), ev.Token)

	_, err = k.Forget(ctx, "s", "op", false)
	require.Error(t, err)
	ev = last(StepForget)
	assert.Equal(t, ResultInProgress, ev.Result, "a live lease")
	assert.Positive(t, ev.LeaseLeft)

	_, err = k.Abandon(ctx, "s", "op", c.Token())
	require.NoError(t, err)
	ev = last(StepAbandon)
	assert.Equal(t, ResultDone, ev.Result)
	assert.Equal(t, c.Token(), ev.Token)
	assert.Equal(t, "abandon", ev.Step.String())

	_, err = k.Forget(ctx, "s", "op", false)
	var refused *ForgetRefusedError
	require.ErrorAs(t, err, &refused)
	assert.Zero(t, refused.LeaseLeft, "the lease was abandoned")
	ev = last(StepForget)
	assert.Equal(t, ResultRefused, ev.Result, "checkpoints refuse a forget")

	_, err = k.Forget(ctx, "s", "op", true)
	require.NoError(t, err)
	ev = last(StepForget)
	assert.Equal(t, ResultDone, ev.Result)

	_, err = k.Abandon(ctx, "s", "op", 0)
	require.ErrorIs(t, err, ErrInvalidConfig)
	assert.Equal(t, ResultInvalid, last(StepAbandon).Result)
}
