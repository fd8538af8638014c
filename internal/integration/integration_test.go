package integration

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// told returns an Observer that sends what it is told on the channel.
func told() (idem.Observer, chan idem.Event) {
	evs := make(chan idem.Event, 16)
	return idem.ObserverFunc(func(_ context.Context, ev idem.Event) { evs <- ev }), evs
}

// nobody is an Observer that ignores what it is told.
type nobody struct{}

func (*nobody) Observe(context.Context, idem.Event) {}

// The hooks answer what the Keeper was made with.
func TestKeeperSettings(t *testing.T) {
	b := redistest.Miniredis(t)
	obs := &nobody{}
	k, err := idem.NewRedis(b.Client, idem.WithLease(time.Minute), idem.WithRetention(time.Hour),
		idem.WithErrorRetention(10*time.Minute), idem.WithObserver(obs))
	require.NoError(t, err)
	assert.Equal(t, time.Minute, Lease(k))
	assert.Equal(t, time.Hour, Retention(k))
	assert.Equal(t, 10*time.Minute, ErrorRetention(k))
	assert.Same(t, obs, Observer(k))

	quiet, err := idem.NewRedis(b.Client)
	require.NoError(t, err)
	assert.Equal(t, idem.DefaultLease, Lease(quiet))
	assert.Equal(t, idem.DefaultRetention, Retention(quiet))
	assert.Equal(t, idem.DefaultRetention, ErrorRetention(quiet))
	assert.Nil(t, Observer(quiet))
}

// A Request is told to the Observer once, at End, with what the layer
// filled in, timed by the Keeper's clock; the claim made with its Context
// is told InRequest. Without an Observer it measures nothing.
func TestRequestEvent(t *testing.T) {
	b := redistest.Miniredis(t)
	obs, evs := told()
	base := time.Now()
	var elapsed atomic.Int64
	clock := func() time.Time { return base.Add(time.Duration(elapsed.Load())) }
	k, err := idem.NewRedis(b.Client, idem.WithObserver(obs), idem.WithClock(clock))
	require.NoError(t, err)

	req := StartRequest(context.Background(), k)
	require.True(t, req.Observed())
	elapsed.Add(int64(time.Second))
	out, err := k.Begin(req.Context(), "s", "key")
	require.NoError(t, err)
	require.Len(t, evs, 1)
	claim := <-evs
	assert.Equal(t, idem.StepClaim, claim.Step)
	assert.True(t, claim.InRequest, "an observed request's claim is marked")

	req.Event.Scope, req.Event.Token = "s", out.Claim.Token()
	req.Running()
	elapsed.Add(int64(2 * time.Second))
	req.End(idem.ResultDone, 201, nil)
	require.Len(t, evs, 1)
	assert.Equal(t, idem.Event{Step: idem.StepRequest, Result: idem.ResultDone, Scope: "s",
		Token: out.Claim.Token(), Status: 201, Took: 3 * time.Second, Held: 2 * time.Second}, <-evs)

	quiet, err := idem.NewRedis(b.Client)
	require.NoError(t, err)
	ctx := context.Background()
	req = StartRequest(ctx, quiet)
	assert.False(t, req.Observed())
	req.Running()
	req.End(idem.ResultDone, 201, nil) // nothing to tell, nothing measured
	assert.Equal(t, Request{ctx: ctx}, req)
	assert.Equal(t, ctx, req.Context(), "without an Observer, the context is the request's own")
}
