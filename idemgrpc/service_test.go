package idemgrpc_test

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The test services: unary methods whose request and response are
// wrapperspb.StringValue, registered with a hand-written grpc.ServiceDesc
// (no protoc).
const (
	paymentsService = "idemgrpc.test.Payments"
	chargeMethod    = "/" + paymentsService + "/Charge"
	refundMethod    = "/" + paymentsService + "/Refund"
	// ledgerService's methods are declared in a registered proto file
	// (methods_test.go): Get without side effects, Put idempotent, Post
	// neither.
	ledgerService = "idemgrpc.test.Ledger"
)

// handlerFunc answers every method of the test services.
type handlerFunc func(ctx context.Context, method string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error)

// registerService registers on srv a service of the named unary methods,
// each answered by h.
func registerService(srv *grpc.Server, service string, h handlerFunc, methods ...string) {
	desc := grpc.ServiceDesc{ServiceName: service, HandlerType: (*any)(nil)}
	for _, name := range methods {
		full := "/" + service + "/" + name
		desc.Methods = append(desc.Methods, grpc.MethodDesc{
			MethodName: name,
			Handler: func(_ any, ctx context.Context, dec func(any) error, intercept grpc.UnaryServerInterceptor) (any, error) {
				in := new(wrapperspb.StringValue)
				if err := dec(in); err != nil {
					return nil, err
				}
				run := func(ctx context.Context, req any) (any, error) { return h(ctx, full, req.(*wrapperspb.StringValue)) }
				if intercept == nil {
					return run(ctx, in)
				}
				return intercept(ctx, in, &grpc.UnaryServerInfo{FullMethod: full}, run)
			},
		})
	}
	srv.RegisterService(&desc, struct{}{})
}

// serve starts a gRPC server on an in-memory listener, guarded by the
// server interceptor on k with opts (unguarded when k is nil), answering
// every method with h; it is stopped with the test.
func serve(t testing.TB, k *idem.Keeper, h handlerFunc, opts ...idemgrpc.Option) *bufconn.Listener {
	t.Helper()
	var sopts []grpc.ServerOption
	if k != nil {
		guard, err := idemgrpc.UnaryServerInterceptor(k, opts...)
		require.NoError(t, err)
		sopts = append(sopts, grpc.UnaryInterceptor(guard))
	}
	srv := grpc.NewServer(sopts...)
	registerService(srv, paymentsService, h, "Charge", "Refund")
	registerService(srv, ledgerService, h, "Get", "Put", "Post")
	lis := bufconn.Listen(1 << 20)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis
}

// dial connects to lis through the client interceptor with opts (none when
// opts is nil), each connection passed through link when it is not nil;
// the connection is closed with the test. Interceptors in the
// extra dial options come after it (an interceptor there sees each attempt).
func dial(t testing.TB, lis *bufconn.Listener, link func(net.Conn) net.Conn, opts []idemgrpc.Option, extra ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	dopts := []grpc.DialOption{
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			c, err := lis.DialContext(ctx)
			if err != nil || link == nil {
				return c, err
			}
			return link(c), nil
		}),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// Reconnect at once after a cut, rather than after gRPC's 1s.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 5 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 50 * time.Millisecond},
			MinConnectTimeout: 5 * time.Second,
		}),
	}
	if opts != nil {
		retry, err := idemgrpc.UnaryClientInterceptor(opts...)
		require.NoError(t, err)
		dopts = append(dopts, grpc.WithUnaryInterceptor(retry))
	}
	conn, err := grpc.NewClient("passthrough:///bufnet", append(dopts, extra...)...)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

// answer is what a client got for one call.
type answer struct {
	resp   *wrapperspb.StringValue
	err    error
	header metadata.MD
}

func (a answer) replayed() bool {
	return len(a.header.Get(idemgrpc.ReplayedMetadata)) == 1 && a.header.Get(idemgrpc.ReplayedMetadata)[0] == "true"
}

// call sends req to method on conn, within a generous bound.
func call(ctx context.Context, conn *grpc.ClientConn, method, req string, opts ...grpc.CallOption) answer {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var a answer
	out := new(wrapperspb.StringValue)
	a.err = conn.Invoke(ctx, method, wrapperspb.String(req), out, append(opts, grpc.Header(&a.header))...)
	if a.err == nil {
		a.resp = out
	}
	return a
}

// withKey returns ctx whose outgoing metadata carries key.
func withKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, idemgrpc.DefaultKeyMetadata, key)
}

// ledger is a handler that records each execution, and answers with the
// request and its execution's number, so that a second execution of a
// request would answer differently from the first.
type ledger struct {
	mu   sync.Mutex
	runs []string // "method request", in order
	keys []string // the key metadata of each run, "" for none
}

func (l *ledger) handle(ctx context.Context, method string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.runs = append(l.runs, method+" "+req.GetValue())
	l.keys = append(l.keys, strings.Join(md.Get(idemgrpc.DefaultKeyMetadata), ","))
	return wrapperspb.String(fmt.Sprintf("%s #%d", req.GetValue(), len(l.runs))), nil
}

// count returns how many times the handler ran.
func (l *ledger) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.runs)
}

// all returns the runs so far.
func (l *ledger) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.runs)
}

// allKeys returns the key of each run so far.
func (l *ledger) allKeys() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.keys)
}

func itoa(n int) string { return strconv.Itoa(n) }

// errorInfo returns the ErrorInfo detail of err's status, or nil.
func errorInfo(err error) *errdetails.ErrorInfo {
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei
		}
	}
	return nil
}

// reason returns the ErrorInfo reason of err's status, or "".
func reason(err error) string {
	if ei := errorInfo(err); ei != nil {
		return ei.GetReason()
	}
	return ""
}

// retryDelay returns the RetryInfo delay of err's status, and whether it
// has one.
func retryDelay(err error) (time.Duration, bool) {
	for _, d := range status.Convert(err).Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}
