package idemgrpc

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/integration"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// UnaryServerInterceptor returns a unary server interceptor that runs each
// guarded call once per key, on k, and answers every retry with the first
// answer. It returns an error wrapping idem.ErrInvalidConfig for a nil
// Keeper or an option that cannot work.
//
// Calls to methods that are not guarded (WithMethods) pass straight
// through. For a guarded call:
//
//   - The key is the "idempotency-key" metadata (WithKeyMetadata). A call
//     without it passes through unguarded, or, with WithKeyRequired(true),
//     answers InvalidArgument. A key that is empty, longer than
//     idem.MaxKeyLen bytes, holds control characters or comes twice answers
//     InvalidArgument.
//   - A record is named by the full method, the tenant (WithTenant; its
//     error refuses the call) and the key: the same key on two methods or
//     under two tenants is two records.
//   - The request is fingerprinted by its type and its deterministic proto
//     encoding; the same key with another request answers
//     FailedPrecondition, never a replay. (Deterministic encoding is stable
//     within one build; a server whose proto changed between the two calls
//     may see a retry as another request.)
//
// Then one round trip to Redis decides:
//
//   - First call with the key: the handler runs. Its context carries the
//     Claim (idem.ClaimFromContext: fencing token, attempt, recovered) and is
//     cancelled, with a cause wrapping idem.ErrLeaseLost, if the lease is
//     lost, or when the lease runs out by this process's clock (a renewal
//     that hangs does not hold that back); the lease is renewed until the
//     handler returns, whatever happens to the client. A claim answered after
//     its lease ran out does not run the handler: Aborted, as for a call in
//     progress. The answer goes to the client as the handler gave it.
//   - The handler returned: an answer whose code the store policy accepts
//     (WithStorePolicy; default DefaultStorePolicy) is stored, the response
//     message (as a google.protobuf.Any) or the status with its code,
//     message and details, for the Keeper's retention, or its error
//     retention (idem.WithErrorRetention) for an error. Any other code
//     releases the key, so a retry runs the handler again; so does a panic
//     (released, then the panic goes on) and a handler that returns an
//     error after its client went away. A response that is not a proto
//     message is stored as Internal. If the lease was lost, nothing is
//     stored or released.
//   - The call repeats a finished one: the stored answer, exactly (the
//     message, or the code, message and details), with header metadata
//     "idempotent-replayed: true". Metadata the handler set (grpc.SetHeader,
//     SetTrailer) is not stored: capturing it would need a wrapped
//     transport stream, which grpc.SetSendCompressor refuses. The response
//     type must be in the global registry (generated code registers it).
//   - Another call with the key is running: Aborted, with a RetryInfo whose
//     delay is the retry hint (WithRetryHint; default 1s, DefaultRetryHint),
//     never more than the lease left; or, with WithWait, the call waits for
//     the answer.
//   - The store is unreachable: Unavailable with a RetryInfo of the retry
//     hint; the handler does not run.
//   - The caller's context ended before the key was checked: Canceled (or
//     DeadlineExceeded); the handler does not run.
//   - The record cannot be read: Internal; nothing is overwritten.
//
// The interceptor's own answers but Canceled, DeadlineExceeded and the
// tenant function's carry an ErrorInfo detail of domain ErrorDomain and one
// of the Reason constants.
//
// The interceptor reports to the Keeper's Observer (idem.WithObserver): the
// Keeper's own steps as they happen, then one idem.StepRequest per guarded
// call, whose Result is its outcome (ResultDone, ResultReleased,
// ResultReplayed, ResultInProgress, ResultMismatch, ResultLeaseLost,
// ResultUnavailable, ResultInvalid, ResultCorrupt, ResultCanceled,
// ResultRefused), Status the gRPC code answered, Took the whole call and
// Held how long the handler ran.
func UnaryServerInterceptor(k *idem.Keeper, opts ...Option) (grpc.UnaryServerInterceptor, error) {
	if k == nil {
		return nil, invalid("nil Keeper")
	}
	s := &server{
		k:         k,
		header:    DefaultKeyMetadata,
		tenant:    func(context.Context) (string, error) { return "", nil },
		store:     DefaultStorePolicy,
		retryHint: DefaultRetryHint,
	}
	if err := applyServer(s, opts); err != nil {
		return nil, err
	}
	if err := s.validate(); err != nil {
		return nil, err
	}
	return s.intercept, nil
}

// server holds the settings of UnaryServerInterceptor; it is read-only once
// made.
type server struct {
	k         *idem.Keeper
	methods   methods
	header    string
	required  bool
	tenant    func(context.Context) (string, error)
	store     func(codes.Code) bool
	retryHint time.Duration
	// wait is given to every claim when waitSet; otherwise the Keeper's
	// own default applies.
	wait    time.Duration
	waitSet bool
}

func (s *server) validate() error {
	var err error
	if s.header, err = checkKeyMetadata(s.header); err != nil {
		return err
	}
	switch {
	case s.tenant == nil:
		return invalid("nil tenant function")
	case s.store == nil:
		return invalid("nil store policy")
	case s.retryHint <= 0:
		return invalid("retry hint %s is not positive", s.retryHint)
	case s.wait < 0:
		return invalid("wait %s is negative", s.wait)
	}
	return nil
}

// intercept handles one call: it passes through what it does not guard,
// refuses a call it cannot guard, then claims the key and answers what the
// claim says (refuse, replay, or run). It reports the call's outcome to the
// Keeper's Observer.
func (s *server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if !s.methods.guards(info.FullMethod) {
		return handler(ctx, req)
	}
	key, present, err := incomingKey(ctx, s.header)
	if !present && !s.required {
		return handler(ctx, req)
	}
	rep := integration.StartRequest(ctx, s.k)
	if !present || err != nil {
		return nil, reply(&rep, idem.ResultInvalid, err, s.keyAnswer(present, err))
	}
	out, result, cause, err := s.begin(ctx, &rep, info.FullMethod, key, req)
	switch {
	case err != nil:
		return nil, reply(&rep, result, cause, err)
	case out.Replayed:
		rep.Event.Token, rep.Event.Attempt = out.Token, out.Attempt()
		resp, result, err := replay(ctx, out)
		return resp, reply(&rep, result, nil, err)
	}
	return s.run(ctx, &rep, req, handler, out.Claim)
}

// begin names the call's record, fingerprints its request and claims the
// key. On an error it returns the call's outcome, its cause, and the answer.
func (s *server) begin(ctx context.Context, rep *integration.Request, fullMethod, key string, req any) (idem.Outcome, idem.Result, error, error) {
	tenant, err := s.tenant(ctx)
	if err != nil {
		return idem.Outcome{}, idem.ResultRefused, err, tenantAnswer(err)
	}
	fp, err := fingerprint(req)
	if err != nil {
		return idem.Outcome{}, idem.ResultInvalid, err, answer(codes.Internal, ReasonNotFingerprintable, err.Error(), 0)
	}
	opts := []idem.Option{idem.WithFingerprint(fp)}
	if s.waitSet {
		opts = append(opts, idem.WithWait(s.wait))
	}
	// A full method holds no space, so the first space ends it.
	scope := fullMethod + " " + tenant
	if rep.Observed() {
		rep.Event.Scope, rep.Event.ID = scope, s.k.RecordID(scope, key)
	}
	out, err := s.k.Begin(rep.Context(), scope, key, opts...)
	if err != nil {
		return out, idem.ResultOf(err), err, s.beginError(err)
	}
	return out, 0, nil, nil
}

// fingerprint is the request's full message name, its length first, then
// its deterministic proto encoding.
func fingerprint(req any) ([]byte, error) {
	msg, ok := req.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("idemgrpc: the request, a %T, is not a proto message, so it cannot be fingerprinted", req)
	}
	name := string(msg.ProtoReflect().Descriptor().FullName())
	fp := binary.BigEndian.AppendUint64(nil, uint64(len(name)))
	fp = append(fp, name...)
	fp, err := proto.MarshalOptions{Deterministic: true}.MarshalAppend(fp, msg)
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: the request cannot be fingerprinted: %w", err)
	}
	return fp, nil
}

// replay answers the stored record, marked as replayed, and says whether it
// was one (ResultReplayed) or could not be read (ResultCorrupt).
func replay(ctx context.Context, out idem.Outcome) (any, idem.Result, error) {
	if out.Err != nil { // a final error stored by idem.Do, not a record of ours
		return nil, idem.ResultCorrupt, corruptAnswer()
	}
	r, err := unmarshalRecord(out.Value)
	if err != nil {
		return nil, idem.ResultCorrupt, corruptAnswer()
	}
	resp, err := r.answer()
	if errors.Is(err, idem.ErrCorrupt) {
		return nil, idem.ResultCorrupt, corruptAnswer()
	}
	_ = grpc.SetHeader(ctx, metadata.Pairs(ReplayedMetadata, "true")) // fails only outside a gRPC server
	return resp, idem.ResultReplayed, err
}

// reply tells the Keeper's Observer the call's outcome, result with the
// error behind it (cause) and the code of answer, the call's error; it
// returns answer.
func reply(rep *integration.Request, result idem.Result, cause, answer error) error {
	rep.End(result, int(status.Code(answer)), cause)
	return answer
}

// errPanicked is the Err of the ResultReleased of a panicking handler.
var errPanicked = errors.New("idemgrpc: the handler panicked; the key was released")

// run runs the handler under the claim, then stores its answer or releases
// the key, and gives the handler's answer to the client.
func (s *server) run(ctx context.Context, rep *integration.Request, req any, handler grpc.UnaryHandler, cl *idem.Claim) (any, error) {
	rep.Event.Token, rep.Event.Attempt, rep.Event.Recovered = cl.Token(), cl.Attempt(), cl.Recovered()
	hctx, stop := cl.KeepAlive(ctx) // its context carries cl (ClaimFromContext)
	if errors.Is(context.Cause(hctx), idem.ErrLeaseLost) {
		// The claim came back too late to hold the key: another call may
		// hold it now, and the handler does not run.
		lost := stop()
		return nil, reply(rep, idem.ResultLeaseLost, lost, answer(codes.Aborted, ReasonInProgress,
			"idemgrpc: a call with this idempotency key is being handled by another attempt; retry after the RetryInfo delay to get its answer",
			s.retryHint))
	}
	rep.Running()
	finished := false
	defer func() {
		if finished {
			return
		}
		// The handler panicked: give the key up, and let the panic go on.
		stop()
		cctx, cancel := cleanupContext(ctx)
		defer cancel()
		result, cause := settled(idem.ResultReleased, errPanicked, cl.Release(cctx))
		reply(rep, result, cause, nil)
	}()
	resp, err := handler(hctx, req)
	finished = true
	if lost := stop(); lost != nil {
		// Another attempt may hold the key: store nothing, release nothing.
		return resp, reply(rep, idem.ResultLeaseLost, lost, err)
	}
	result, cause := s.settle(ctx, cl, resp, err)
	return resp, reply(rep, result, cause, err)
}

// settle stores the handler's answer under the claim, or releases the key
// when the store policy says so or the handler gave up on a client that
// went away; it returns the call's outcome and its cause.
func (s *server) settle(ctx context.Context, cl *idem.Claim, resp any, err error) (idem.Result, error) {
	cctx, cancel := cleanupContext(ctx)
	defer cancel()
	code := statusOf(err).Code()
	gaveUp := ctx.Err() != nil && code != codes.OK
	if gaveUp || !s.store(code) {
		return settled(idem.ResultReleased, nil, cl.Release(cctx))
	}
	rec := answerRecord(resp, err)
	value, merr := rec.marshal()
	if merr != nil { // a status message that is not UTF-8, say
		value, _ = notStorable("idemgrpc: the answer of the first call could not be encoded and was not kept: " +
			strings.ToValidUTF8(merr.Error(), "?")).marshal()
	}
	var retention time.Duration // the Keeper's
	if code != codes.OK {
		retention = integration.ErrorRetention(s.k)
	}
	// The client gets the handler's answer either way.
	return settled(idem.ResultDone, nil, cl.Complete(cctx, value, retention))
}

// settled is result with note, or the lease loss or store failure (err)
// that prevented it.
func settled(result idem.Result, note, err error) (idem.Result, error) {
	switch {
	case errors.Is(err, idem.ErrLeaseLost):
		return idem.ResultLeaseLost, err
	case err != nil:
		return idem.ResultUnavailable, err
	}
	return result, note
}

// statusOf is the status gRPC answers for a handler's error: the status it
// carries, else Canceled or DeadlineExceeded for a context's error, else
// Unknown with its message.
func statusOf(err error) *status.Status {
	if st, ok := status.FromError(err); ok {
		return st
	}
	return status.FromContextError(err)
}

// cleanupContext is the context of the store calls after the handler
// returned: never cut short by the client's cancellation, since the side
// effect happened, and bounded by cleanupTimeout.
func cleanupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
}
