package idemgrpc_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The first call runs the handler; a retry with the key gets the same
// message, marked as replayed, without running it.
func TestFirstCallRunsThenReplays(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var runs ledger
		conn := dial(t, serve(t, newKeeper(t, b.Client), runs.handle), nil, nil)
		ctx := withKey(t.Context(), "order-42")

		first := call(ctx, conn, chargeMethod, "10 EUR")
		require.NoError(t, first.err)
		assert.False(t, first.replayed())
		again := call(ctx, conn, chargeMethod, "10 EUR")
		require.NoError(t, again.err)
		assert.True(t, again.replayed())

		assert.True(t, proto.Equal(first.resp, again.resp), "%v != %v", first.resp, again.resp)
		assert.Equal(t, "10 EUR #1", again.resp.GetValue())
		assert.Equal(t, 1, runs.count())
	})
}

// An error the store policy keeps is replayed exactly: code, message and
// every detail.
func TestErrorStatusReplaysWithDetails(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var runs atomic.Int64
		declined, err := status.New(codes.FailedPrecondition, "card declined: insufficient funds").WithDetails(
			&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example.com", Metadata: map[string]string{"decline_code": "insufficient_funds"}},
			&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: "amount", Description: "over the balance"}}},
		)
		require.NoError(t, err)
		h := func(context.Context, string, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			runs.Add(1)
			return nil, declined.Err()
		}
		conn := dial(t, serve(t, newKeeper(t, b.Client), h), nil, nil)
		ctx := withKey(t.Context(), "order-43")

		first := call(ctx, conn, chargeMethod, "10 EUR")
		again := call(ctx, conn, chargeMethod, "10 EUR")

		assert.True(t, proto.Equal(declined.Proto(), status.Convert(first.err).Proto()), "the first answer is the handler's")
		assert.True(t, proto.Equal(declined.Proto(), status.Convert(again.err).Proto()),
			"replayed %v, want %v", status.Convert(again.err).Proto(), declined.Proto())
		assert.False(t, first.replayed())
		assert.True(t, again.replayed())
		assert.EqualValues(t, 1, runs.Load())
	})
}

// A handler that refuses the caller's credentials (Unauthenticated,
// PermissionDenied) gives the key back: the refusal is not the operation's
// answer, and the call with valid credentials that follows runs.
func TestAuthenticationFailureReleasesTheKey(t *testing.T) {
	for _, refusal := range []codes.Code{codes.Unauthenticated, codes.PermissionDenied} {
		t.Run(refusal.String(), func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				var runs atomic.Int64
				h := func(ctx context.Context, _ string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
					runs.Add(1)
					if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("auth")) == 0 {
						return nil, status.Error(refusal, "not signed")
					}
					return wrapperspb.String("charged " + req.GetValue()), nil
				}
				conn := dial(t, serve(t, newKeeper(t, b.Client), h), nil, nil)
				ctx := withKey(t.Context(), "order-45")

				assert.Equal(t, refusal, status.Code(call(ctx, conn, chargeMethod, "10 EUR").err))
				signed := metadata.AppendToOutgoingContext(ctx, "auth", "acme")
				second := call(signed, conn, chargeMethod, "10 EUR")
				require.NoError(t, second.err, "the signed call runs")
				assert.False(t, second.replayed())
				third := call(signed, conn, chargeMethod, "10 EUR")
				require.NoError(t, third.err)
				assert.True(t, third.replayed())
				assert.EqualValues(t, 2, runs.Load())
			})
		})
	}
}

// Codes that say "try again" release the key: the retry runs the handler
// again, and its success is then stored.
func TestRetryableErrorReleasesTheKey(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var runs atomic.Int64
		h := func(_ context.Context, _ string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			if runs.Add(1) == 1 {
				return nil, status.Error(codes.Unavailable, "the bank is down")
			}
			return wrapperspb.String("charged " + req.GetValue()), nil
		}
		conn := dial(t, serve(t, newKeeper(t, b.Client), h), nil, nil)
		ctx := withKey(t.Context(), "order-44")

		assert.Equal(t, codes.Unavailable, status.Code(call(ctx, conn, chargeMethod, "10 EUR").err))
		second := call(ctx, conn, chargeMethod, "10 EUR")
		require.NoError(t, second.err)
		assert.False(t, second.replayed())
		third := call(ctx, conn, chargeMethod, "10 EUR")
		require.NoError(t, third.err)
		assert.True(t, third.replayed())
		assert.EqualValues(t, 2, runs.Load())
	})
}

func TestDefaultStorePolicy(t *testing.T) {
	stored := []codes.Code{codes.OK, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists,
		codes.FailedPrecondition, codes.OutOfRange, codes.Unimplemented}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		want := false
		for _, s := range stored {
			want = want || s == c
		}
		assert.Equal(t, want, idemgrpc.DefaultStorePolicy(c), "%s", c)
	}
}

// A retry while the first call runs gets Aborted with a RetryInfo of the
// hint (1s by default), never more than the lease left; once the first
// call ends, the retry gets its answer.
func TestInProgressAnswersAbortedWithRetryInfo(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		for _, tc := range []struct {
			name  string
			lease time.Duration
			opts  []idemgrpc.Option
			want  time.Duration // the delay
			// leaseLeft: the delay is the lease left, at most want
			leaseLeft bool
		}{
			{name: "default hint", lease: idem.DefaultLease, want: time.Second},
			{name: "hint set", lease: idem.DefaultLease, opts: []idemgrpc.Option{idemgrpc.WithRetryHint(250 * time.Millisecond)}, want: 250 * time.Millisecond},
			{name: "lease shorter than the hint", lease: 2 * time.Second, opts: []idemgrpc.Option{idemgrpc.WithRetryHint(time.Hour)}, want: 2 * time.Second, leaseLeft: true},
		} {
			t.Run(tc.name, func(t *testing.T) {
				entered, release := make(chan struct{}), make(chan struct{})
				var runs atomic.Int64
				h := func(context.Context, string, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
					runs.Add(1)
					close(entered)
					<-release
					return wrapperspb.String("done"), nil
				}
				conn := dial(t, serve(t, newKeeper(t, b.Client, idem.WithLease(tc.lease)), h, tc.opts...), nil, nil)
				ctx := withKey(t.Context(), "slow-"+tc.name)

				firstDone := make(chan answer, 1)
				go func() { firstDone <- call(ctx, conn, chargeMethod, "x") }()
				<-entered
				busy := call(ctx, conn, chargeMethod, "x")
				assert.Equal(t, codes.Aborted, status.Code(busy.err), "%v", busy.err)
				assert.Equal(t, idemgrpc.ReasonInProgress, reason(busy.err))
				assert.Equal(t, idemgrpc.ErrorDomain, errorInfo(busy.err).GetDomain())
				delay, ok := retryDelay(busy.err)
				require.True(t, ok, "a RetryInfo detail")
				if tc.leaseLeft {
					assert.Greater(t, delay, time.Duration(0))
					assert.LessOrEqual(t, delay, tc.want, "never more than the lease left")
				} else {
					assert.Equal(t, tc.want, delay)
				}

				close(release)
				require.NoError(t, (<-firstDone).err)
				after := call(ctx, conn, chargeMethod, "x")
				require.NoError(t, after.err)
				assert.True(t, after.replayed())
				assert.EqualValues(t, 1, runs.Load())
			})
		}
	})
}

// With WithWait, a retry that arrives while the first call runs waits for
// its answer and replays it, instead of answering Aborted; the Keeper's own
// WithWait applies unless the interceptor's replaces it.
func TestWaitReplaysTheAnswer(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		for _, tc := range []struct {
			name   string
			keeper []idem.Option
			server []idemgrpc.Option
			waits  bool
		}{
			{name: "interceptor's", server: []idemgrpc.Option{idemgrpc.WithWait(time.Minute)}, waits: true},
			{name: "Keeper's", keeper: []idem.Option{idem.WithWait(time.Minute)}, waits: true},
			{name: "Keeper's replaced", keeper: []idem.Option{idem.WithWait(time.Minute)}, server: []idemgrpc.Option{idemgrpc.WithWait(0)}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				entered, release := make(chan struct{}), make(chan struct{})
				var runs atomic.Int64
				h := func(context.Context, string, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
					runs.Add(1)
					close(entered)
					<-release
					return wrapperspb.String("done"), nil
				}
				commands := countCommands(b.Client)
				conn := dial(t, serve(t, newKeeper(t, b.Client, tc.keeper...), h, tc.server...), nil, nil)
				ctx := withKey(t.Context(), "waited-"+tc.name)

				firstDone := make(chan answer, 1)
				go func() { firstDone <- call(ctx, conn, chargeMethod, "x") }()
				<-entered
				if !tc.waits {
					busy := call(ctx, conn, chargeMethod, "x")
					assert.Equal(t, codes.Aborted, status.Code(busy.err))
					close(release)
					require.NoError(t, (<-firstDone).err)
					return
				}
				before := commands.Commands()
				secondDone := make(chan answer, 1)
				go func() { secondDone <- call(ctx, conn, chargeMethod, "x") }()
				require.Eventually(t, func() bool { return commands.Commands() >= before+3 }, 20*time.Second, time.Millisecond,
					"the second call asks again and again while it waits")
				close(release)

				first, second := <-firstDone, <-secondDone
				require.NoError(t, first.err)
				require.NoError(t, second.err)
				assert.True(t, second.replayed())
				assert.True(t, proto.Equal(first.resp, second.resp))
				assert.EqualValues(t, 1, runs.Load())
			})
		}
	})
}

// The same key with another request message is refused, never replayed.
func TestKeyReusedWithAnotherRequest(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var runs ledger
		conn := dial(t, serve(t, newKeeper(t, b.Client), runs.handle), nil, nil)
		ctx := withKey(t.Context(), "order-45")

		require.NoError(t, call(ctx, conn, chargeMethod, "10 EUR").err)
		other := call(ctx, conn, chargeMethod, "99 EUR")
		assert.Equal(t, codes.FailedPrecondition, status.Code(other.err))
		assert.Equal(t, idemgrpc.ReasonKeyReused, reason(other.err))
		assert.Equal(t, 1, runs.count())
	})
}

// A record is named by the full method, the tenant and the key: the same
// key on another method or under another tenant runs again.
func TestRecordPerMethodAndTenant(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var runs ledger
		tenant := idemgrpc.WithTenant(func(ctx context.Context) (string, error) {
			md, _ := metadata.FromIncomingContext(ctx)
			return strings.Join(md.Get("tenant"), ","), nil
		})
		conn := dial(t, serve(t, newKeeper(t, b.Client), runs.handle, tenant), nil, nil)
		acme := metadata.AppendToOutgoingContext(withKey(t.Context(), "k"), "tenant", "acme")
		globex := metadata.AppendToOutgoingContext(withKey(t.Context(), "k"), "tenant", "globex")

		for range 2 {
			require.NoError(t, call(acme, conn, chargeMethod, "x").err)
			require.NoError(t, call(acme, conn, refundMethod, "x").err)
			require.NoError(t, call(globex, conn, chargeMethod, "x").err)
		}
		assert.Equal(t, []string{chargeMethod + " x", refundMethod + " x", chargeMethod + " x"}, runs.all())
	})
}

// A tenant function that refuses a call answers its error's status, or
// InvalidArgument; the handler does not run.
func TestTenantRefusal(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var runs ledger
	tenant := idemgrpc.WithTenant(func(ctx context.Context) (string, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		switch md.Get("auth") {
		case nil:
			return "", status.Error(codes.Unauthenticated, "no credentials")
		}
		if md.Get("auth")[0] == "" {
			return "", errors.New("no tenant in the credentials")
		}
		return md.Get("auth")[0], nil
	})
	conn := dial(t, serve(t, k, runs.handle, tenant), nil, nil)
	ctx := withKey(t.Context(), "k")

	noAuth := call(ctx, conn, chargeMethod, "x")
	assert.Equal(t, codes.Unauthenticated, status.Code(noAuth.err))
	assert.Equal(t, "no credentials", status.Convert(noAuth.err).Message())
	noTenant := call(metadata.AppendToOutgoingContext(ctx, "auth", ""), conn, chargeMethod, "x")
	assert.Equal(t, codes.InvalidArgument, status.Code(noTenant.err))
	assert.Equal(t, "no tenant in the credentials", status.Convert(noTenant.err).Message())
	assert.Equal(t, 0, runs.count())

	require.NoError(t, call(metadata.AppendToOutgoingContext(ctx, "auth", "acme"), conn, chargeMethod, "x").err)
	assert.Equal(t, 1, runs.count())
}

// A call without a key passes through, or is refused when the key is
// required; an unusable key is refused.
func TestKeyMissingOrInvalid(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var runs ledger
	optional := dial(t, serve(t, k, runs.handle), nil, nil)
	required := dial(t, serve(t, k, runs.handle, idemgrpc.WithKeyRequired(true)), nil, nil)

	for range 2 {
		require.NoError(t, call(t.Context(), optional, chargeMethod, "no key").err)
	}
	assert.Equal(t, 2, runs.count(), "without a key the call is not guarded")

	missing := call(t.Context(), required, chargeMethod, "x")
	assert.Equal(t, codes.InvalidArgument, status.Code(missing.err))
	assert.Equal(t, idemgrpc.ReasonKeyMissing, reason(missing.err))

	twice := metadata.AppendToOutgoingContext(withKey(t.Context(), "a"), idemgrpc.DefaultKeyMetadata, "b")
	for name, ctx := range map[string]context.Context{
		"too long": withKey(t.Context(), strings.Repeat("k", idem.MaxKeyLen+1)),
		"twice":    twice,
	} {
		for _, conn := range []*grpc.ClientConn{optional, required} {
			got := call(ctx, conn, chargeMethod, "x")
			assert.Equal(t, codes.InvalidArgument, status.Code(got.err), name)
			assert.Equal(t, idemgrpc.ReasonKeyInvalid, reason(got.err), name)
		}
	}
	assert.Equal(t, 2, runs.count())

	// gRPC's client refuses to send a control character in metadata; a
	// server reached otherwise still refuses it.
	guard, err := idemgrpc.UnaryServerInterceptor(k)
	require.NoError(t, err)
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(idemgrpc.DefaultKeyMetadata, "k\x01"))
	_, err = guard(ctx, wrapperspb.String("x"), &grpc.UnaryServerInfo{FullMethod: chargeMethod}, nil)
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	assert.Equal(t, idemgrpc.ReasonKeyInvalid, reason(err))
}

// When the store cannot be reached, the call answers Unavailable with a
// RetryInfo, and the handler does not run.
func TestStoreDownAnswersUnavailable(t *testing.T) {
	check := func(t *testing.T, conn *grpc.ClientConn, runs *ledger) {
		got := call(withKey(t.Context(), "k"), conn, chargeMethod, "x")
		assert.Equal(t, codes.Unavailable, status.Code(got.err), "%v", got.err)
		assert.Equal(t, idemgrpc.ReasonStoreUnavailable, reason(got.err))
		delay, ok := retryDelay(got.err)
		assert.True(t, ok)
		assert.Equal(t, idemgrpc.DefaultRetryHint, delay)
		assert.Equal(t, 0, runs.count())
	}
	t.Run("miniredis LOADING", func(t *testing.T) {
		k, m := newMiniKeeper(t)
		var runs ledger
		conn := dial(t, serve(t, k, runs.handle), nil, nil)
		m.SetError("LOADING Redis is loading the dataset in memory")
		check(t, conn, &runs)
		m.SetError("")
		require.NoError(t, call(withKey(t.Context(), "k"), conn, chargeMethod, "x").err)
	})
	t.Run("nothing listening", func(t *testing.T) {
		c := redistest.NewClient(t, "127.0.0.1:"+itoa(redistest.FreePort(t)))
		var runs ledger
		check(t, dial(t, serve(t, newKeeper(t, c), runs.handle), nil, nil), &runs)
	})
	t.Run("redis-server stopped", func(t *testing.T) {
		b := redistest.Real(t)
		var runs ledger
		conn := dial(t, serve(t, newKeeper(t, b.Client), runs.handle), nil, nil)
		require.NoError(t, call(withKey(t.Context(), "before"), conn, chargeMethod, "x").err)
		_ = b.Client.Shutdown(t.Context()).Err() // no reply: the server exits
		runs = ledger{}
		check(t, conn, &runs)
	})
}

// A record that cannot be read answers Internal, and is not overwritten.
func TestCorruptRecordAnswersInternal(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var runs ledger
		conn := dial(t, serve(t, newKeeper(t, b.Client), runs.handle), nil, nil)
		ctx := withKey(t.Context(), "k")
		require.NoError(t, call(ctx, conn, chargeMethod, "x").err)
		keys, err := b.Client.Keys(t.Context(), "idem:{*").Result() // the records, not idem:layout
		require.NoError(t, err)
		require.Len(t, keys, 1)
		require.NoError(t, b.Client.Set(t.Context(), keys[0], "not a record", 0).Err())

		got := call(ctx, conn, chargeMethod, "x")
		assert.Equal(t, codes.Internal, status.Code(got.err))
		assert.Equal(t, idemgrpc.ReasonRecordCorrupt, reason(got.err))
		v, err := b.Client.Get(t.Context(), keys[0]).Result()
		require.NoError(t, err)
		assert.Equal(t, "not a record", v)
		assert.Equal(t, 1, runs.count())
	})
}

// The handler's context carries the claim, and the lease is renewed while
// it runs.
func TestHandlerRunsUnderTheClaim(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		commands := countCommands(b.Client)
		var claimed atomic.Int64
		h := func(ctx context.Context, _ string, _ *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			cl, ok := idem.ClaimFromContext(ctx)
			if !ok {
				return nil, status.Error(codes.Internal, "no claim")
			}
			claimed.Store(commands.Commands())
			for deadline := time.Now().Add(20 * time.Second); commands.Commands() < claimed.Load()+2 && time.Now().Before(deadline); {
				time.Sleep(5 * time.Millisecond) // until two renewals went out
			}
			if ctx.Err() != nil {
				return nil, status.FromContextError(ctx.Err()).Err()
			}
			return wrapperspb.String("attempt " + itoa(cl.Attempt())), nil
		}
		conn := dial(t, serve(t, newKeeper(t, b.Client, idem.WithLease(1500*time.Millisecond)), h), nil, nil)
		got := call(withKey(t.Context(), "k"), conn, chargeMethod, "x")
		require.NoError(t, got.err)
		assert.Equal(t, "attempt 1", got.resp.GetValue())
		assert.GreaterOrEqual(t, commands.Commands(), claimed.Load()+3, "two renewals, then the completion")
	})
}

// A call whose context ended before its key was checked answers Canceled
// (or DeadlineExceeded), and the handler does not run.
func TestCallerCancellationBeforeTheClaim(t *testing.T) {
	k, _ := newMiniKeeper(t)
	guard, err := idemgrpc.UnaryServerInterceptor(k)
	require.NoError(t, err)
	var runs ledger
	info := &grpc.UnaryServerInfo{FullMethod: chargeMethod}
	handler := func(ctx context.Context, req any) (any, error) {
		return runs.handle(ctx, chargeMethod, req.(*wrapperspb.StringValue))
	}
	incoming := metadata.NewIncomingContext(t.Context(), metadata.Pairs(idemgrpc.DefaultKeyMetadata, "k"))

	canceled, cancel := context.WithCancel(incoming)
	cancel()
	_, err = guard(canceled, wrapperspb.String("x"), info, handler)
	assert.Equal(t, codes.Canceled, status.Code(err), "%v", err)

	expired, cancel := context.WithDeadline(incoming, time.Now().Add(-time.Second))
	defer cancel()
	_, err = guard(expired, wrapperspb.String("x"), info, handler)
	assert.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
	assert.Equal(t, 0, runs.count())
}

// A handler that gives up because its client went away releases the key;
// one that succeeds after its client left is stored: its side effect
// happened.
func TestHandlerAfterTheClientLeft(t *testing.T) {
	k, _ := newMiniKeeper(t)
	guard, err := idemgrpc.UnaryServerInterceptor(k)
	require.NoError(t, err)
	info := &grpc.UnaryServerInfo{FullMethod: chargeMethod}
	var runs atomic.Int64
	for _, tc := range []struct {
		name     string
		answer   func(ctx context.Context) (any, error)
		wantRuns int64
	}{
		{"gave up", func(ctx context.Context) (any, error) { return nil, status.FromContextError(ctx.Err()).Err() }, 2},
		{"succeeded", func(ctx context.Context) (any, error) { return wrapperspb.String("done"), nil }, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runs.Store(0)
			incoming := metadata.NewIncomingContext(t.Context(), metadata.Pairs(idemgrpc.DefaultKeyMetadata, tc.name))
			ctx, cancel := context.WithCancel(incoming)
			_, _ = guard(ctx, wrapperspb.String("x"), info, func(ctx context.Context, _ any) (any, error) {
				runs.Add(1)
				cancel() // the client goes away while the handler runs
				return tc.answer(ctx)
			})
			_, _ = guard(incoming, wrapperspb.String("x"), info, func(ctx context.Context, _ any) (any, error) {
				runs.Add(1)
				return wrapperspb.String("retry"), nil
			})
			assert.Equal(t, tc.wantRuns, runs.Load())
		})
	}
}

// A panic in the handler releases the key and goes on.
func TestPanicReleasesTheKey(t *testing.T) {
	k, _ := newMiniKeeper(t)
	guard, err := idemgrpc.UnaryServerInterceptor(k)
	require.NoError(t, err)
	info := &grpc.UnaryServerInfo{FullMethod: chargeMethod}
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(idemgrpc.DefaultKeyMetadata, "k"))

	assert.PanicsWithValue(t, "boom", func() {
		_, _ = guard(ctx, wrapperspb.String("x"), info, func(context.Context, any) (any, error) { panic("boom") })
	})
	resp, err := guard(ctx, wrapperspb.String("x"), info, func(context.Context, any) (any, error) {
		return wrapperspb.String("ran again"), nil
	})
	require.NoError(t, err)
	assert.Equal(t, "ran again", resp.(*wrapperspb.StringValue).GetValue())
}

// A request that is not a proto message cannot be fingerprinted and is
// refused; a response that is not one reaches the first caller, and its
// replay answers Internal instead of running the handler again.
func TestNotProtoMessages(t *testing.T) {
	k, _ := newMiniKeeper(t)
	guard, err := idemgrpc.UnaryServerInterceptor(k)
	require.NoError(t, err)
	info := &grpc.UnaryServerInfo{FullMethod: chargeMethod}
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(idemgrpc.DefaultKeyMetadata, "k"))
	var runs atomic.Int64
	handler := func(context.Context, any) (any, error) {
		runs.Add(1)
		return "a string", nil
	}

	_, err = guard(ctx, "not a message", info, handler)
	assert.Equal(t, codes.Internal, status.Code(err))
	assert.Equal(t, idemgrpc.ReasonNotFingerprintable, reason(err))
	assert.EqualValues(t, 0, runs.Load())

	resp, err := guard(ctx, wrapperspb.String("x"), info, handler)
	require.NoError(t, err)
	assert.Equal(t, "a string", resp)
	_, err = guard(ctx, wrapperspb.String("x"), info, handler)
	assert.Equal(t, codes.Internal, status.Code(err))
	assert.Contains(t, status.Convert(err).Message(), "not a proto message")
	assert.EqualValues(t, 1, runs.Load())
}

// Options that cannot work are refused when the interceptor is made.
func TestServerOptionsRefused(t *testing.T) {
	k, _ := newMiniKeeper(t)
	_, err := idemgrpc.UnaryServerInterceptor(nil)
	assert.ErrorIs(t, err, idem.ErrInvalidConfig)
	for name, opt := range map[string]idemgrpc.Option{
		"client option":     idemgrpc.WithMaxAttempts(3),
		"binary metadata":   idemgrpc.WithKeyMetadata("key-bin"),
		"grpc metadata":     idemgrpc.WithKeyMetadata("grpc-key"),
		"empty metadata":    idemgrpc.WithKeyMetadata(""),
		"metadata space":    idemgrpc.WithKeyMetadata("my key"),
		"nil tenant":        idemgrpc.WithTenant(nil),
		"nil store policy":  idemgrpc.WithStorePolicy(nil),
		"zero retry hint":   idemgrpc.WithRetryHint(0),
		"negative wait":     idemgrpc.WithWait(-time.Second),
		"negative hint":     idemgrpc.WithRetryHint(-time.Second),
		"other client-only": idemgrpc.WithBackoff(time.Second, time.Minute),
	} {
		_, err := idemgrpc.UnaryServerInterceptor(k, opt)
		assert.ErrorIs(t, err, idem.ErrInvalidConfig, name)
	}
	_, err = idemgrpc.UnaryServerInterceptor(k, idemgrpc.Option{}, idemgrpc.WithKeyMetadata("X-Request-Key"))
	assert.NoError(t, err, "the zero Option is ignored; names are lower-cased")
}

// The key metadata can be renamed, at both ends.
func TestKeyMetadataRenamed(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var keys atomic.Value
	var runs atomic.Int64
	h := func(ctx context.Context, _ string, _ *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		keys.Store(md.Get("x-request-key"))
		runs.Add(1)
		return wrapperspb.String("ok"), nil
	}
	rename := idemgrpc.WithKeyMetadata("X-Request-Key")
	conn := dial(t, serve(t, k, h, rename, idemgrpc.WithKeyRequired(true)), nil, []idemgrpc.Option{rename})
	ctx := idemgrpc.ContextWithKey(t.Context(), "k")
	for range 2 {
		require.NoError(t, call(ctx, conn, chargeMethod, "x").err)
	}
	assert.EqualValues(t, 1, runs.Load())
	assert.Equal(t, []string{"k"}, keys.Load())
}

// errdetails and durationpb are what a client needs to read RetryInfo; this
// checks that the hint is a well-formed Duration.
func TestRetryInfoIsWellFormed(t *testing.T) {
	k, _ := newMiniKeeper(t)
	guard, err := idemgrpc.UnaryServerInterceptor(k, idemgrpc.WithRetryHint(1500*time.Millisecond))
	require.NoError(t, err)
	info := &grpc.UnaryServerInfo{FullMethod: chargeMethod}
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(idemgrpc.DefaultKeyMetadata, "k"))
	entered, release := make(chan struct{}), make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = guard(ctx, wrapperspb.String("x"), info, func(context.Context, any) (any, error) {
			close(entered)
			<-release
			return wrapperspb.String("ok"), nil
		})
	}()
	<-entered
	_, err = guard(ctx, wrapperspb.String("x"), info, nil)
	close(release)
	<-done
	var ri *errdetails.RetryInfo
	for _, d := range status.Convert(err).Details() {
		if r, ok := d.(*errdetails.RetryInfo); ok {
			ri = r
		}
	}
	require.NotNil(t, ri)
	assert.True(t, proto.Equal(durationpb.New(1500*time.Millisecond), ri.GetRetryDelay()))
}
