package idemgrpc_test

import (
	"context"
	"sync"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// requests is an Observer that keeps the request steps it is told.
type requests struct {
	mu  sync.Mutex
	evs []idem.Event
}

func (r *requests) Observe(_ context.Context, ev idem.Event) {
	if ev.Step != idem.StepRequest {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.evs = append(r.evs, ev)
}

// take returns the request steps told since the last take.
func (r *requests) take() []idem.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	evs := r.evs
	r.evs = nil
	return evs
}

// Every guarded call reaches the Keeper's Observer once, as a request step
// with its outcome and the code it was answered; the interceptor has no
// event model of its own.
func TestCallsReachTheObserver(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		obs := &requests{}
		k := newKeeper(t, b.Client, idem.WithObserver(obs))
		h := func(_ context.Context, _ string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			if req.GetValue() == "busy" {
				return nil, status.Error(codes.Unavailable, "try later")
			}
			return wrapperspb.String("ok"), nil
		}
		tenant := idemgrpc.WithTenant(func(ctx context.Context) (string, error) {
			if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("refuse")) > 0 {
				return "", status.Error(codes.PermissionDenied, "not yours")
			}
			return "acme", nil
		})
		conn := dial(t, serve(t, k, h, idemgrpc.WithKeyRequired(true), tenant), nil, nil)
		ctx := withKey(t.Context(), "order-1")
		scope := chargeMethod + " acme"

		for _, row := range []struct {
			name   string
			ctx    context.Context
			req    string
			result idem.Result
			code   codes.Code
		}{
			{"first call", ctx, "10 EUR", idem.ResultDone, codes.OK},
			{"retry", ctx, "10 EUR", idem.ResultReplayed, codes.OK},
			{"key reused", ctx, "20 EUR", idem.ResultMismatch, codes.FailedPrecondition},
			{"no key", t.Context(), "10 EUR", idem.ResultInvalid, codes.InvalidArgument},
			{"tenant refused", metadata.AppendToOutgoingContext(ctx, "refuse", "1"), "10 EUR", idem.ResultRefused, codes.PermissionDenied},
			{"released by the store policy", withKey(t.Context(), "order-2"), "busy", idem.ResultReleased, codes.Unavailable},
		} {
			a := call(row.ctx, conn, chargeMethod, row.req)
			assert.Equal(t, row.code, status.Code(a.err), row.name)
			evs := obs.take()
			require.Len(t, evs, 1, row.name)
			ev := evs[0]
			assert.Equal(t, row.result, ev.Result, "%s: %v", row.name, ev.Err)
			assert.Equal(t, int(row.code), ev.Status, row.name)
			assert.Positive(t, ev.Took, row.name)
			switch row.result {
			case idem.ResultDone, idem.ResultReplayed:
				assert.Equal(t, scope, ev.Scope, row.name)
				assert.Equal(t, k.RecordID(scope, "order-1"), ev.ID, row.name)
				assert.NotZero(t, ev.Token, row.name)
				assert.Equal(t, 1, ev.Attempt, "%s: the attempt that ran it", row.name)
			case idem.ResultInvalid, idem.ResultRefused:
				assert.Empty(t, ev.ID, "%s names no record", row.name)
			}
		}
	})
}
