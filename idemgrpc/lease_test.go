package idemgrpc_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// stall holds up a Keeper's calls to Redis: its lease renewals (extend.lua)
// hang, whatever their context says (as go-redis does without
// ContextTimeoutEnabled, waiting out its own timeouts), until release is
// closed, and then fail unsent as a read timeout would; they are counted in
// hung. Its claims (claim.lua) are answered lag late.
type stall struct {
	release chan struct{}
	hung    atomic.Int32
	lag     time.Duration
}

// on is the stall's redistest.ScriptHook.On.
func (s *stall) on(ctx context.Context, name string, _ redis.Cmder, send func() error) error {
	switch name {
	case "extend":
		s.hung.Add(1)
		<-s.release
		return errors.New("read tcp 127.0.0.1: i/o timeout")
	case "claim":
		err := send()
		if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			return err // sent again at once by EVAL, which is answered late
		}
		time.Sleep(s.lag)
		return err
	}
	return send()
}

// stallKeeper returns a Keeper with lease on a miniredis whose calls go
// through a stall, and the stall; its release is closed when the test ends.
func stallKeeper(t *testing.T, lease, lag time.Duration) (*idem.Keeper, *stall) {
	t.Helper()
	m := miniredis.RunT(t)
	c := redistest.NewClient(t, m.Addr())
	s := &stall{release: make(chan struct{}), lag: lag}
	t.Cleanup(func() { close(s.release) })
	c.AddHook(redistest.ScriptHook{On: s.on})
	k, err := idem.NewRedis(c, idem.WithLease(lease), idem.WithRetention(time.Minute))
	require.NoError(t, err)
	return k, s
}

// TestHandlerCancelledWhenTheLeaseRunsOutDuringAHungRenewal: the handler's
// context ends with idem.ErrLeaseLost when its lease runs out while the
// renewal hangs, and the call returns then, without waiting for the
// renewal.
func TestHandlerCancelledWhenTheLeaseRunsOutDuringAHungRenewal(t *testing.T) {
	k, s := stallKeeper(t, 300*time.Millisecond, 0)
	guard, err := idemgrpc.UnaryServerInterceptor(k)
	require.NoError(t, err)
	var cause error
	handler := func(ctx context.Context, req any) (any, error) {
		<-ctx.Done()
		cause = context.Cause(ctx)
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	info := &grpc.UnaryServerInfo{FullMethod: chargeMethod}
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(idemgrpc.DefaultKeyMetadata, "k"))
	done := make(chan error, 1)
	go func() {
		_, err := guard(ctx, wrapperspb.String("x"), info, handler)
		done <- err
	}()
	select {
	case <-done:
		assert.ErrorIs(t, cause, idem.ErrLeaseLost)
		assert.Positive(t, s.hung.Load(), "the renewal was under way, and still is")
	case <-time.After(20 * time.Second): // the renewal hangs until the test ends
		assert.Fail(t, "the handler's context was not cancelled when its lease ran out")
	}
}

// TestClaimAnsweredAfterItsLeaseDoesNotRunTheHandler: a claim answered
// after its lease ran out by this process's clock does not run the handler:
// the call is answered Aborted, as for a call in progress.
func TestClaimAnsweredAfterItsLeaseDoesNotRunTheHandler(t *testing.T) {
	const lease = 50 * time.Millisecond
	k, _ := stallKeeper(t, lease, lease+20*time.Millisecond)
	guard, err := idemgrpc.UnaryServerInterceptor(k)
	require.NoError(t, err)
	ran := false
	handler := func(ctx context.Context, req any) (any, error) {
		ran = true
		return wrapperspb.String("ok"), nil
	}
	info := &grpc.UnaryServerInfo{FullMethod: chargeMethod}
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(idemgrpc.DefaultKeyMetadata, "k"))
	_, err = guard(ctx, wrapperspb.String("x"), info, handler)
	assert.Equal(t, codes.Aborted, status.Code(err), "%v", err)
	assert.False(t, ran, "the handler ran on a claim whose lease had run out")
}
