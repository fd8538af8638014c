package idemgrpc

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/idemkit/idem"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// UnaryClientInterceptor returns a unary client interceptor that gives each
// guarded call an idempotency key and retries it safely. It returns an error
// wrapping idem.ErrInvalidConfig for an option that cannot work.
//
// Calls to methods that are not guarded (WithMethods) pass straight
// through, are sent once and never retried. A guarded call:
//
//   - carries a key in its "idempotency-key" metadata (WithKeyMetadata):
//     the one already in the outgoing metadata, else the one of
//     ContextWithKey, else 128 random bits in hex. Every attempt carries the
//     same key. A key that is empty, longer than idem.MaxKeyLen bytes, holds
//     control characters or comes twice is refused with InvalidArgument
//     before anything is sent.
//   - is retried, up to WithMaxAttempts sends in all (default 5,
//     DefaultMaxAttempts), when it answers Unavailable (the network or the
//     store failed: the server replays or runs it, never twice), Aborted (in
//     progress elsewhere) or ResourceExhausted, or when the connection broke
//     while it was sent (gRPC-Go's Invoke returns a bare io.EOF then); never
//     on any other code.
//   - waits between attempts for the delay of the answer's RetryInfo, plus
//     up to a fifth more at random, or without one for a jittered
//     exponential backoff (WithBackoff). A RetryInfo delay longer than the
//     backoff's ceiling, or one that would end past the call's deadline,
//     ends the retries, and so does the end of the call's context: the call
//     returns the last answer.
//
// Retrying is safe because the server runs a call once per key: guard the
// same methods on the server (UnaryServerInterceptor, or any server that
// honours the key metadata). Pass Info(&info) as a call option to learn the
// key, how many attempts were sent, and whether the answer was a replay.
func UnaryClientInterceptor(opts ...Option) (grpc.UnaryClientInterceptor, error) {
	c := &client{
		header:      DefaultKeyMetadata,
		maxAttempts: DefaultMaxAttempts,
		base:        DefaultBackoffBase,
		ceiling:     DefaultBackoffMax,
		sleep:       sleep,
	}
	if err := applyClient(c, opts); err != nil {
		return nil, err
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	return c.intercept, nil
}

// CallInfo says what the client interceptor did for one call.
type CallInfo struct {
	// Key is the idempotency key every attempt carried; empty when the
	// method is not guarded or the key was refused.
	Key string
	// Attempts is how many times the call was sent: at least 1, except 0
	// when its key was refused before sending.
	Attempts int
	// Replayed is true when the answer is the stored answer of an earlier
	// call with the key: the last attempt's header metadata said
	// "idempotent-replayed: true".
	Replayed bool
}

// Info returns a call option that fills *dst with what the client
// interceptor did, once the call returns. Without the interceptor, *dst is
// left as it is.
func Info(dst *CallInfo) grpc.CallOption { return infoOption{dst: dst} }

// infoOption is the call option of Info; gRPC itself ignores it.
type infoOption struct {
	grpc.EmptyCallOption
	dst *CallInfo
}

// client holds the settings of UnaryClientInterceptor; it is read-only once
// made.
type client struct {
	methods     methods
	header      string
	maxAttempts int
	base        time.Duration
	ceiling     time.Duration
	// sleep waits d, or reports false when ctx ends first; tests replace it.
	sleep func(ctx context.Context, d time.Duration) bool
}

func (c *client) validate() error {
	var err error
	if c.header, err = checkKeyMetadata(c.header); err != nil {
		return err
	}
	switch {
	case c.maxAttempts < 1:
		return invalid("max attempts %d is less than 1", c.maxAttempts)
	case c.base <= 0:
		return invalid("backoff base %s is not positive", c.base)
	case c.ceiling < c.base:
		return invalid("backoff ceiling %s is shorter than its base %s", c.ceiling, c.base)
	case c.ceiling > idem.MaxDuration:
		return invalid("backoff ceiling %s is longer than idem.MaxDuration", c.ceiling)
	}
	return nil
}

// intercept sends one call: once if its method is not guarded, else with a
// key, as many times as the retry rules allow.
func (c *client) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	var info CallInfo
	defer tellInfo(opts, &info)
	if !c.methods.guards(method) {
		info.Attempts = 1
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	ctx, key, err := callKey(ctx, c.header)
	if err != nil {
		return answer(codes.InvalidArgument, ReasonKeyInvalid, "idemgrpc: "+err.Error(), 0)
	}
	info.Key = key
	var header metadata.MD
	opts = append(slices.Clip(opts), grpc.Header(&header))
	for attempt := 1; ; attempt++ {
		header = nil
		err = invoker(ctx, method, req, reply, cc, opts...)
		info.Attempts, info.Replayed = attempt, replayed(header)
		if err == nil || attempt == c.maxAttempts {
			return err
		}
		delay, ok := c.retryDelay(err, attempt)
		if !ok || !c.wait(ctx, delay) {
			return err
		}
	}
}

// tellInfo copies info to every Info option of the call.
func tellInfo(opts []grpc.CallOption, info *CallInfo) {
	for _, o := range opts {
		if opt, ok := o.(infoOption); ok && opt.dst != nil {
			*opt.dst = *info
		}
	}
}

func replayed(header metadata.MD) bool {
	vs := header.Get(ReplayedMetadata)
	return len(vs) == 1 && vs[0] == "true"
}

// retryDelay returns how long to wait before retrying after err, the
// answer of the attempt-th send, and false when err must not be retried.
func (c *client) retryDelay(err error, attempt int) (time.Duration, bool) {
	if !retryable(err) {
		return 0, false
	}
	if hint, ok := retryInfo(status.Convert(err)); ok {
		if hint > c.ceiling {
			return 0, false
		}
		return hint + jitter(hint/5), true
	}
	b := c.base
	for i := 1; i < attempt && b < c.ceiling; i++ {
		b *= 2 // no overflow: b < ceiling <= idem.MaxDuration
	}
	b = min(b, c.ceiling)
	return b/2 + jitter(b-b/2), true
}

// retryable reports whether err says the call may be sent again: the
// server was unreachable, busy with the key, or out of resources, or the
// connection broke under the call.
func retryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.Aborted, codes.ResourceExhausted:
		return true
	}
	return brokenTransport(err)
}

// brokenTransport reports whether err is the bare io.EOF (or
// io.ErrUnexpectedEOF) that gRPC-Go's Invoke returns when the connection
// breaks while the request is sent: whether the server got it is unknown,
// as with Unavailable.
func brokenTransport(err error) bool {
	if _, ok := status.FromError(err); ok {
		return false
	}
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// retryInfo returns the delay of st's RetryInfo detail, if it has a valid
// one.
func retryInfo(st *status.Status) (time.Duration, bool) {
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay().IsValid() {
			return max(ri.GetRetryDelay().AsDuration(), 0), true
		}
	}
	return 0, false
}

// jitter returns a random duration in [0, d].
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return rand.N(d + 1)
}

// wait waits d before the next attempt, and reports false when the call's
// context ends first or its deadline comes before d has passed.
func (c *client) wait(ctx context.Context, d time.Duration) bool {
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= d {
		return false
	}
	return c.sleep(ctx, d)
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
