package idemgrpc_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// benchKeys makes keys that no earlier run of a benchmark used.
var benchKeys atomic.Int64

func benchKey(prefix string) string {
	return prefix + "-" + strconv.FormatInt(benchKeys.Add(1), 10)
}

// The server interceptor called directly, on a redis-server started for the
// benchmark: what it adds to a call, without gRPC's transport.
func BenchmarkServerInterceptor(b *testing.B) {
	k := newKeeper(b, redistest.Real(b).Client)
	guard, err := idemgrpc.UnaryServerInterceptor(k)
	require.NoError(b, err)
	info := &grpc.UnaryServerInfo{FullMethod: chargeMethod}
	req := wrapperspb.String("10 EUR")
	handler := func(context.Context, any) (any, error) { return wrapperspb.String("charged"), nil }
	withKey := func(key string) context.Context {
		return metadata.NewIncomingContext(context.Background(), metadata.Pairs(idemgrpc.DefaultKeyMetadata, key))
	}
	run := func(b *testing.B, ctx func() context.Context) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := guard(ctx(), req, info, handler); err != nil {
				b.Fatal(err)
			}
		}
	}

	b.Run("no key", func(b *testing.B) {
		ctx := metadata.NewIncomingContext(context.Background(), metadata.MD{})
		run(b, func() context.Context { return ctx })
	})
	b.Run("first call", func(b *testing.B) {
		run(b, func() context.Context { return withKey(benchKey("first")) })
	})
	b.Run("replay", func(b *testing.B) {
		ctx := withKey(benchKey("replay"))
		run(b, func() context.Context { return ctx })
	})
}

// Calls over an in-memory connection, through both interceptors, on a
// redis-server started for the benchmark, against the same call unguarded.
func BenchmarkPair(b *testing.B) {
	k := newKeeper(b, redistest.Real(b).Client)
	h := func(_ context.Context, _ string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		return wrapperspb.String("charged " + req.GetValue()), nil
	}
	guarded := dial(b, serve(b, k, h), nil, []idemgrpc.Option{})
	plain := dial(b, serve(b, nil, h), nil, nil)
	run := func(b *testing.B, conn *grpc.ClientConn, ctx func() context.Context) {
		b.ReportAllocs()
		out := new(wrapperspb.StringValue)
		for b.Loop() {
			if err := conn.Invoke(ctx(), chargeMethod, wrapperspb.String("10 EUR"), out); err != nil {
				b.Fatal(err)
			}
		}
	}

	b.Run("unguarded", func(b *testing.B) {
		run(b, plain, context.Background)
	})
	b.Run("first call", func(b *testing.B) {
		run(b, guarded, context.Background) // a random key per call
	})
	b.Run("replay", func(b *testing.B) {
		ctx := idemgrpc.ContextWithKey(context.Background(), benchKey("pair"))
		run(b, guarded, func() context.Context { return ctx })
	})
}
