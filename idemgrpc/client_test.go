package idemgrpc_test

import (
	"context"
	"encoding/hex"
	"errors"
	"io"
	"sync"
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

// sleeps records the delays the client interceptor waits, without waiting.
type sleeps struct {
	mu     sync.Mutex
	delays []time.Duration
	// then, when set, runs at each wait and says whether to go on.
	then func(ctx context.Context) bool
}

func (s *sleeps) option() idemgrpc.Option {
	return idemgrpc.WithSleep(func(ctx context.Context, d time.Duration) bool {
		s.mu.Lock()
		s.delays = append(s.delays, d)
		s.mu.Unlock()
		if s.then != nil {
			return s.then(ctx)
		}
		return ctx.Err() == nil
	})
}

func (s *sleeps) all() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Duration(nil), s.delays...)
}

// failing answers each call with the next of errs (nil: a success) and
// records the key each call carried.
type failing struct {
	mu   sync.Mutex
	errs []error
	keys []string
}

func (f *failing) handle(ctx context.Context, _ string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.keys = append(f.keys, md.Get(idemgrpc.DefaultKeyMetadata)...)
	var err error
	if len(f.errs) > 0 {
		err, f.errs = f.errs[0], f.errs[1:]
	}
	if err != nil {
		return nil, err
	}
	return wrapperspb.String("ok " + req.GetValue()), nil
}

func (f *failing) allKeys() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.keys...)
}

// always returns n copies of err.
func always(err error, n int) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}

// withRetryInfo returns a status error of code with a RetryInfo of d.
func withRetryInfo(t *testing.T, code codes.Code, d time.Duration) error {
	st, err := status.New(code, "later").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(d)})
	require.NoError(t, err)
	return st.Err()
}

// Every attempt of a call carries the same key: a random one of 128 bits
// unless the caller gave one. Backoff between attempts grows, jittered.
func TestClientKeepsOneKeyAcrossRetries(t *testing.T) {
	srv := &failing{errs: always(status.Error(codes.Unavailable, "down"), 3)}
	var waits sleeps
	conn := dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{waits.option()})

	var info idemgrpc.CallInfo
	got := call(t.Context(), conn, chargeMethod, "x", idemgrpc.Info(&info))
	require.NoError(t, got.err)
	assert.Equal(t, "ok x", got.resp.GetValue())

	keys := srv.allKeys()
	require.Len(t, keys, 4)
	for _, k := range keys {
		assert.Equal(t, keys[0], k)
	}
	raw, err := hex.DecodeString(keys[0])
	require.NoError(t, err)
	assert.Len(t, raw, 16, "128 random bits")
	assert.Equal(t, idemgrpc.CallInfo{Key: keys[0], Attempts: 4, Replayed: false}, info)

	delays := waits.all()
	require.Len(t, delays, 3)
	for i, d := range delays {
		ceiling := idemgrpc.DefaultBackoffBase << i
		assert.GreaterOrEqual(t, d, ceiling/2, "retry %d", i+1)
		assert.LessOrEqual(t, d, ceiling, "retry %d", i+1)
	}

	require.NoError(t, call(t.Context(), conn, chargeMethod, "y").err)
	assert.NotEqual(t, keys[0], srv.allKeys()[4], "a new call, a new key")
}

// The caller's key is used: from ContextWithKey, or the one already in the
// outgoing metadata, which wins.
func TestClientUsesTheCallersKey(t *testing.T) {
	srv := &failing{}
	conn := dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{})

	require.NoError(t, call(idemgrpc.ContextWithKey(t.Context(), "k1"), conn, chargeMethod, "x").err)
	require.NoError(t, call(withKey(t.Context(), "k2"), conn, chargeMethod, "x").err)
	require.NoError(t, call(idemgrpc.ContextWithKey(withKey(t.Context(), "k3"), "other"), conn, chargeMethod, "x").err)
	assert.Equal(t, []string{"k1", "k2", "k3"}, srv.allKeys())
}

// An unusable key is refused before anything is sent.
func TestClientRefusesAnUnusableKey(t *testing.T) {
	srv := &failing{}
	conn := dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{})
	for name, ctx := range map[string]context.Context{
		"empty":   idemgrpc.ContextWithKey(t.Context(), ""),
		"control": idemgrpc.ContextWithKey(t.Context(), "a\nb"),
		"twice":   metadata.AppendToOutgoingContext(withKey(t.Context(), "a"), idemgrpc.DefaultKeyMetadata, "b"),
		"bad md":  withKey(t.Context(), "a\x7f"),
	} {
		info := idemgrpc.CallInfo{Attempts: -1}
		got := call(ctx, conn, chargeMethod, "x", idemgrpc.Info(&info))
		assert.Equal(t, codes.InvalidArgument, status.Code(got.err), name)
		assert.Equal(t, idemgrpc.ReasonKeyInvalid, reason(got.err), name)
		assert.Equal(t, idemgrpc.CallInfo{}, info, name)
	}
	assert.Empty(t, srv.allKeys(), "nothing sent")
}

// Only Unavailable, Aborted and ResourceExhausted are retried, up to the
// attempts allowed.
func TestClientRetriesOnlyRetryableCodes(t *testing.T) {
	for code := codes.Canceled; code <= codes.Unauthenticated; code++ {
		srv := &failing{errs: always(status.Error(code, "no"), 10)}
		var waits sleeps
		conn := dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{waits.option(), idemgrpc.WithMaxAttempts(3)})
		var info idemgrpc.CallInfo
		got := call(t.Context(), conn, chargeMethod, "x", idemgrpc.Info(&info))
		assert.Equal(t, code, status.Code(got.err))
		want := 1
		if code == codes.Unavailable || code == codes.Aborted || code == codes.ResourceExhausted {
			want = 3
		}
		assert.Equal(t, want, info.Attempts, "%s", code)
		assert.Len(t, srv.allKeys(), want, "%s", code)
	}
}

// A connection that breaks while the request is sent makes gRPC-Go's
// Invoke return a bare io.EOF: the outcome is unknown, so it is retried
// like Unavailable.
func TestClientRetriesABrokenTransport(t *testing.T) {
	srv := &failing{}
	var waits sleeps
	var sent atomic.Int64
	breakFirst := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoke grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if sent.Add(1) == 1 {
			return io.EOF
		}
		return invoke(ctx, method, req, reply, cc, opts...)
	}
	conn := dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{waits.option()}, grpc.WithChainUnaryInterceptor(breakFirst))
	var info idemgrpc.CallInfo
	require.NoError(t, call(t.Context(), conn, chargeMethod, "x", idemgrpc.Info(&info)).err)
	assert.Equal(t, 2, info.Attempts)

	other := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoke grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		return errors.New("not a transport failure")
	}
	conn = dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{waits.option()}, grpc.WithChainUnaryInterceptor(other))
	require.Error(t, call(t.Context(), conn, chargeMethod, "x", idemgrpc.Info(&info)).err)
	assert.Equal(t, 1, info.Attempts, "another error that is not a status is not retried")
}

// A RetryInfo delay is waited, with up to a fifth more; one longer than
// the backoff's ceiling ends the retries.
func TestClientHonoursRetryInfo(t *testing.T) {
	t.Run("waited", func(t *testing.T) {
		srv := &failing{errs: always(withRetryInfo(t, codes.ResourceExhausted, 7*time.Second), 2)}
		var waits sleeps
		conn := dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{waits.option(), idemgrpc.WithBackoff(time.Millisecond, 10*time.Second)})
		var info idemgrpc.CallInfo
		require.NoError(t, call(t.Context(), conn, chargeMethod, "x", idemgrpc.Info(&info)).err)
		assert.Equal(t, 3, info.Attempts)
		delays := waits.all()
		require.Len(t, delays, 2)
		for _, d := range delays {
			assert.GreaterOrEqual(t, d, 7*time.Second)
			assert.LessOrEqual(t, d, 7*time.Second+7*time.Second/5)
		}
	})
	t.Run("longer than the ceiling", func(t *testing.T) {
		srv := &failing{errs: always(withRetryInfo(t, codes.Unavailable, time.Hour), 2)}
		var waits sleeps
		conn := dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{waits.option()})
		var info idemgrpc.CallInfo
		got := call(t.Context(), conn, chargeMethod, "x", idemgrpc.Info(&info))
		assert.Equal(t, codes.Unavailable, status.Code(got.err))
		assert.Equal(t, 1, info.Attempts)
		assert.Empty(t, waits.all())
	})
	t.Run("past the deadline", func(t *testing.T) {
		srv := &failing{errs: always(withRetryInfo(t, codes.Aborted, 2*time.Second), 2)}
		var waits sleeps
		conn := dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{waits.option()})
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		var info idemgrpc.CallInfo
		got := call(ctx, conn, chargeMethod, "x", idemgrpc.Info(&info))
		assert.Equal(t, codes.Aborted, status.Code(got.err))
		assert.Equal(t, 1, info.Attempts)
		assert.Empty(t, waits.all())
	})
}

// The call's context ends the retries.
func TestClientStopsWhenTheContextEnds(t *testing.T) {
	srv := &failing{errs: always(status.Error(codes.Unavailable, "down"), 10)}
	ctx, cancel := context.WithCancel(t.Context())
	waits := sleeps{then: func(ctx context.Context) bool {
		cancel()
		return ctx.Err() == nil
	}}
	conn := dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{waits.option()})
	var info idemgrpc.CallInfo
	got := call(ctx, conn, chargeMethod, "x", idemgrpc.Info(&info))
	assert.Equal(t, codes.Unavailable, status.Code(got.err))
	assert.Equal(t, 1, info.Attempts)

	ended, stop := context.WithCancel(t.Context())
	stop()
	assert.False(t, idemgrpc.Sleep(ended, time.Hour), "the wait ends with the context")
	assert.True(t, idemgrpc.Sleep(t.Context(), time.Millisecond))
}

// A method that is not guarded gets no key and is sent once.
func TestClientUnguardedMethodIsSentOnce(t *testing.T) {
	srv := &failing{errs: always(status.Error(codes.Unavailable, "down"), 10)}
	var waits sleeps
	conn := dial(t, serve(t, nil, srv.handle), nil, []idemgrpc.Option{waits.option(), idemgrpc.WithMethods(refundMethod)})
	var info idemgrpc.CallInfo
	got := call(t.Context(), conn, chargeMethod, "x", idemgrpc.Info(&info))
	assert.Equal(t, codes.Unavailable, status.Code(got.err))
	assert.Equal(t, idemgrpc.CallInfo{Attempts: 1}, info)
	assert.Empty(t, srv.allKeys())
}

// With the server interceptor: a retry of a call in progress is answered
// Aborted, waits the hint, and gets the first call's answer as a replay.
func TestPairRetryWaitsForTheCallInProgress(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		entered, release := make(chan struct{}), make(chan struct{})
		var runs atomic.Int64
		h := func(context.Context, string, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			runs.Add(1)
			close(entered)
			<-release
			return wrapperspb.String("charged"), nil
		}
		lis := serve(t, newKeeper(t, b.Client), h, idemgrpc.WithRetryHint(300*time.Millisecond))
		firstDone := make(chan answer, 1)
		waits := sleeps{then: func(ctx context.Context) bool {
			close(release) // the first call ends while the retry waits
			<-firstDone
			return true
		}}
		conn := dial(t, lis, nil, []idemgrpc.Option{waits.option()})
		ctx := idemgrpc.ContextWithKey(t.Context(), "order-46")

		var firstInfo, info idemgrpc.CallInfo
		first := make(chan answer, 1)
		go func() {
			a := call(ctx, conn, chargeMethod, "x", idemgrpc.Info(&firstInfo))
			first <- a
			firstDone <- a
		}()
		<-entered
		retry := call(ctx, conn, chargeMethod, "x", idemgrpc.Info(&info))
		got := <-first

		require.NoError(t, got.err)
		require.NoError(t, retry.err)
		assert.True(t, proto.Equal(got.resp, retry.resp))
		assert.Equal(t, idemgrpc.CallInfo{Key: "order-46", Attempts: 1}, firstInfo)
		assert.Equal(t, idemgrpc.CallInfo{Key: "order-46", Attempts: 2, Replayed: true}, info)
		delays := waits.all()
		require.Len(t, delays, 1)
		assert.GreaterOrEqual(t, delays[0], 300*time.Millisecond, "the hint")
		assert.LessOrEqual(t, delays[0], 300*time.Millisecond+60*time.Millisecond, "the hint, plus at most a fifth")
		assert.EqualValues(t, 1, runs.Load())
	})
}

// Options that cannot work are refused when the interceptor is made.
func TestClientOptionsRefused(t *testing.T) {
	for name, opt := range map[string]idemgrpc.Option{
		"server option":     idemgrpc.WithKeyRequired(true),
		"zero attempts":     idemgrpc.WithMaxAttempts(0),
		"zero base":         idemgrpc.WithBackoff(0, time.Second),
		"ceiling below":     idemgrpc.WithBackoff(time.Second, time.Millisecond),
		"ceiling too long":  idemgrpc.WithBackoff(time.Second, idem.MaxDuration+1),
		"binary metadata":   idemgrpc.WithKeyMetadata("key-bin"),
		"other server-only": idemgrpc.WithTenant(func(context.Context) (string, error) { return "", nil }),
	} {
		_, err := idemgrpc.UnaryClientInterceptor(opt)
		assert.ErrorIs(t, err, idem.ErrInvalidConfig, name)
	}
	_, err := idemgrpc.UnaryClientInterceptor(idemgrpc.WithMaxAttempts(1), idemgrpc.WithBackoff(time.Second, time.Second))
	assert.NoError(t, err)
}
