package integration

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// recorder is an Observer that keeps what it is told.
type recorder struct {
	mu  sync.Mutex
	evs []idem.Event
}

func (r *recorder) Observe(_ context.Context, ev idem.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.evs = append(r.evs, ev)
}

// take returns the events told since the last take.
func (r *recorder) take() []idem.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	evs := r.evs
	r.evs = nil
	return evs
}

// The hooks answer what the Keeper was made with.
func TestKeeperSettings(t *testing.T) {
	b := redistest.Miniredis(t)
	rec := &recorder{}
	k, err := idem.NewRedis(b.Client, idem.WithLease(time.Minute), idem.WithRetention(time.Hour),
		idem.WithErrorRetention(10*time.Minute), idem.WithObserver(rec))
	require.NoError(t, err)
	assert.Equal(t, time.Minute, Lease(k))
	assert.Equal(t, time.Hour, Retention(k))
	assert.Equal(t, 10*time.Minute, ErrorRetention(k))
	assert.Equal(t, idem.Observer(rec), Observer(k))

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
	rec := &recorder{}
	base := time.Now()
	var elapsed atomic.Int64
	clock := func() time.Time { return base.Add(time.Duration(elapsed.Load())) }
	k, err := idem.NewRedis(b.Client, idem.WithObserver(rec), idem.WithClock(clock))
	require.NoError(t, err)

	req := StartRequest(k, context.Background())
	require.True(t, req.Observed())
	elapsed.Add(int64(time.Second))
	out, err := k.Begin(req.Context(), "s", "key")
	require.NoError(t, err)
	evs := rec.take()
	require.Len(t, evs, 1)
	assert.Equal(t, idem.StepClaim, evs[0].Step)
	assert.True(t, evs[0].InRequest, "an observed request's claim is marked")

	req.Event.Scope, req.Event.Token = "s", out.Claim.Token()
	req.Running()
	elapsed.Add(int64(2 * time.Second))
	req.End(idem.ResultDone, 201, nil)
	evs = rec.take()
	require.Len(t, evs, 1)
	assert.Equal(t, idem.Event{Step: idem.StepRequest, Result: idem.ResultDone, Scope: "s",
		Token: out.Claim.Token(), Status: 201, Took: 3 * time.Second, Held: 2 * time.Second}, evs[0])

	quiet, err := idem.NewRedis(b.Client)
	require.NoError(t, err)
	ctx := context.Background()
	req = StartRequest(quiet, ctx)
	assert.False(t, req.Observed())
	req.Running()
	req.End(idem.ResultDone, 201, nil) // nothing to tell, nothing measured
	assert.Equal(t, Request{ctx: ctx}, req)
	assert.Equal(t, ctx, req.Context(), "without an Observer, the context is the request's own")
}
