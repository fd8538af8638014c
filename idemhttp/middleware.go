package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/integration"
)

// StatusClientClosedRequest is the status the middleware answers (and reports
// as the Status of its idem.StepRequest) for a request whose client went away before its key could be
// checked: 499, as nginx logs it. No standard status says "the client left".
const StatusClientClosedRequest = 499

// unavailableRetryAfter is the Retry-After of a 503, in seconds.
const unavailableRetryAfter = "1"

// New returns net/http middleware that makes unsafe requests
// idempotent with the Idempotency-Key header, as Stripe's API and the IETF
// draft draft-ietf-httpapi-idempotency-key-header describe it. It returns an
// error wrapping ErrInvalidConfig for a nil Keeper or an option that cannot
// work; the middleware itself never panics on its own account.
//
// Requests whose method is not guarded (WithMethods; default POST and PATCH)
// pass straight through, and a key they carry is ignored (a DELETE's, say:
// see WithMethods). For a guarded request:
//
//   - The key is the header's value (WithKeyHeader); a quoted string
//     (`"abc"`, the draft's Structured Field form) means its content. No
//     header while the key is required (WithKeyRequired; default) answers
//     400; with an optional key, the request passes through unguarded. A key
//     that is empty, longer than MaxKeyLen bytes, holds control characters,
//     or comes in more than one header answers 400.
//   - The body is read, up to a limit (WithBodyLimit; default 1 MiB,
//     DefaultBodyLimit, above it 413), and given back to the handler
//     unchanged.
//   - With WithKeyFunc, the key is what the key function reads from the
//     request and its body (a webhook's event id), after the body is read;
//     the function may refuse the request (ResultRefused, the status its
//     error names, default 400).
//   - A record is named by the tenant (WithScope; default none) and the
//     key, as Stripe names them: the same key under two tenants is two
//     records, and one key names one request of a tenant, whatever endpoint
//     or router it reaches. A scope function that cannot place the request
//     refuses it (the status its error names, default 400): it never falls
//     back to a shared key space.
//   - The request is fingerprinted: the method and the concrete path, always,
//     then the fingerprint function's digest (WithFingerprint; default
//     SHA-256 over the method, the path and query, and the body). The same
//     key with another fingerprint answers 422, never a replay; so a key
//     reused on another endpoint or resource answers 422, identically under
//     ServeMux, chi, gorilla or any router. For a key space per endpoint,
//     put the route in the scope (see WithScope).
//
// Then one round trip to Redis decides:
//
//   - First request with the key: the handler runs. Its context carries the
//     Claim (ClaimFromContext: fencing token, attempt, recovered flag) and is
//     cancelled, with a cause wrapping ErrLeaseLost, if the lease is lost,
//     or when it runs out by this process's clock (a renewal that hangs does
//     not hold that back); the lease is renewed while the handler runs. The
//     response goes to the client as it is written; a copy is kept.
//   - The handler finished: a stored status (WithStorePolicy; default
//     DefaultStorePolicy: 2xx, 3xx, and 4xx except 401, 403, 407, 408, 409,
//     425, 429) is stored with its headers and body, for the Keeper's
//     retention, or its ErrorRetention for 4xx. Any other status releases
//     the key, so a retry runs the handler again: a 401, 403 or 407 says the
//     request failed authentication, which is not the operation's answer. So
//     does a panic (the key is released, then the panic goes on) and a
//     handler that returns after the client went away (its request context
//     is done) without having written a 2xx or 3xx status: a success written
//     after the client left is stored, because its side effect happened.
//   - The handler called ExecutionBegan (its side effect happened or is
//     about to): its response is stored whatever its status and the store
//     policy, a 5xx included, and so is one written after the client went
//     away. A panic after it stores a 500 of the middleware's own
//     (ProblemExecutionFailed, through the error writer) in place of the
//     response, then goes on; so does, without the panic, a handler that
//     returns without having written a status after its client went
//     away. Retries get the stored answer; the handler does not run again.
//   - A response body larger than WithResponseLimit (default 1 MiB,
//     DefaultResponseLimit), or one the handler flushed while writing it: the
//     status and headers are stored, the body is not; the key is not released
//     for that reason. Replays answer the stored status and headers with an
//     application/problem+json body of type ProblemBodyNotKept in place of
//     the body (with WithErrorWriter, the writer's body).
//   - The request repeats a finished one: the stored response is replayed:
//     status, every header value in order, body, plus "Idempotent-Replayed:
//     true" and a fresh Date. Set-Cookie, Authorization, WWW-Authenticate,
//     Proxy-Authenticate, hop-by-hop headers and trailers are never stored
//     nor replayed; nor are headers that middleware outside this one set
//     before the handler ran and the handler left as they were (a request
//     id): that middleware sets them afresh on the replay.
//   - Another request with the key is in progress: 409 with Retry-After, a
//     hint of when to ask again (WithRetryAfter; default 1 s,
//     DefaultRetryAfter, never more than the lease left, in whole seconds
//     rounded up); or, with WithWait, the request first waits up to that long
//     for the result and replays it.
//   - The store is unreachable: 503 with "Retry-After: 1", and the handler
//     does not run; with WithFailOpen, the handler runs unguarded instead.
//   - The record cannot be read (ErrCorrupt): 500; nothing is overwritten.
//   - A request with the key completed and its response is no longer kept
//     (idem.ErrResultExpired: a marker, see idem.WithMarkerRetention): 410,
//     ProblemResultExpired; the handler does not run again.
//
// Every answer of the middleware's own is an RFC 9457 application/problem+json
// body with type (the Problem constants), title, status and detail; with
// WithErrorWriter, the API renders them in its own error shape instead.
//
// The middleware reports to the Keeper's Observer (idem.WithObserver), so
// that one Observer sees every step of every request: the Keeper's own
// steps as they happen (the claim, the completion or release, renewals, a
// lease lost), then, once per guarded request, an idem.StepRequest whose
// Result is the request's outcome, Status the status answered (the
// handler's when it ran; 0 when it panicked before ExecutionBegan, or ran
// fail-open; the stored 500 when it failed after ExecutionBegan), Took the
// whole request, and Held how long the handler ran:
//
//	ResultDone         the handler ran; its response was stored (after
//	                   ExecutionBegan, a failure's 500: Err says so)
//	ResultReleased     the handler ran; the key was released (store policy,
//	                   a client gone without a success, a panic: Err says so)
//	ResultReplayed     a stored response was replayed
//	ResultInProgress   409: another request holds the key (LeaseLeft is set)
//	ResultMismatch     422: the key was used with another request
//	ResultLeaseLost    the claim was lost: before the handler (409), or
//	                   after it, when its response could not be stored
//	ResultUnavailable  503 before the handler; after it, the response
//	                   could not be stored nor released
//	ResultFailOpen     the store failed and the handler runs unguarded
//	                   (reported before it runs)
//	ResultInvalid      400: no key, an unusable key, an unreadable body
//	ResultTooLarge     413: the body is over the limit
//	ResultCorrupt      500: the record could not be read
//	ResultCanceled     499: the client went away before the key was checked
//	ResultRefused      the scope or key function refused the request
//
// A request that passes through unguarded reports nothing. The Observer is
// given the request's context, and the event carries the scope and the
// record's id (Keeper.RecordID), never the client's key.
//
// In the handler, idem.ClaimFromContext gives the claim and RequestKey the
// tenant and the key the request is guarded under.
//
// The capture given to the handler supports http.ResponseController through
// Unwrap, http.Flusher and io.ReaderFrom. A hijacked connection bypasses it:
// do not guard endpoints that hijack.
func New(k *idem.Keeper, opts ...Option) (func(http.Handler) http.Handler, error) {
	if k == nil {
		return nil, fmt.Errorf("%w: nil Keeper", idem.ErrInvalidConfig)
	}
	m := &middleware{
		k:             k,
		methods:       []string{http.MethodPost, http.MethodPatch},
		header:        DefaultKeyHeader,
		required:      true,
		scope:         func(*http.Request) (string, error) { return "", nil },
		fingerprint:   defaultFingerprint,
		bodyLimit:     DefaultBodyLimit,
		responseLimit: DefaultResponseLimit,
		store:         DefaultStorePolicy,
		retryAfter:    DefaultRetryAfter,
		writeError:    WriteProblem,
	}
	for _, o := range opts {
		o(m)
	}
	if err := m.validate(); err != nil {
		return nil, err
	}
	m.waitOption = idem.WithWait(m.wait)
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			m.serve(next, w, r)
		})
	}, nil
}

// serve handles one request: it passes through what it does not guard,
// refuses a request it cannot guard or place in a scope, then claims the key
// and answers what the claim says (fail, replay, or run).
func (m *middleware) serve(next http.Handler, w http.ResponseWriter, r *http.Request) {
	if !slices.Contains(m.methods, r.Method) {
		next.ServeHTTP(w, r)
		return
	}
	rep := integration.StartRequest(r.Context(), m.k)
	key, body, v := m.identify(r)
	switch {
	case v.pass:
		next.ServeHTTP(w, r)
		return
	case v.kind != 0:
		m.refuse(w, r, &rep, v.kind, v.err, v.problem)
		return
	}
	scope, err := m.scope(r)
	if err != nil {
		m.refuse(w, r, &rep, idem.ResultRefused, err, refusedProblem(err, ProblemScopeRefused,
			"This request could not be tied to a tenant or account, so it was not run."))
		return
	}
	if rep.Observed() {
		rep.Event.Scope, rep.Event.ID = scope, m.k.RecordID(scope, key)
	}
	out, err := m.begin(rep.Context(), r, scope, key, body)
	switch {
	case err != nil:
		m.fail(next, w, r, &rep, scope, key, err)
	case out.Replayed:
		m.replay(w, r, &rep, out)
	default:
		m.run(next, w, r, &rep, out.Claim)
	}
}

// begin claims the request's key in its scope with ctx (the request's
// integration.Request.Context), fingerprinted with its body, and gives the
// handler the whole body again.
func (m *middleware) begin(ctx context.Context, r *http.Request, scope, key string, body []byte) (idem.Outcome, error) {
	d := getDigester() // the fingerprint is d's: Begin reads it, keeps none of it
	defer digesters.Put(d)
	fp := m.fingerprintOf(d, r, body)
	restoreBody(r, body)
	return m.k.Begin(ctx, scope, key, idem.WithFingerprint(fp), m.waitOption)
}

// keyName names the key in the middleware's answers: the key header, or
// "idempotency key" when a key function reads it.
func (m *middleware) keyName() string {
	if m.keyFunc != nil {
		return "idempotency key"
	}
	return m.header
}

// keyProblem is the answer to a request whose key is missing (present
// false) or unusable (err).
func (m *middleware) keyProblem(present bool, err error) problem {
	if !present {
		return m.keyMissing()
	}
	p := problem{Type: ProblemKeyInvalid, Title: "Idempotency key invalid", Status: http.StatusBadRequest}
	reason := strings.TrimPrefix(err.Error(), idem.ErrInvalidKey.Error()+": ")
	if m.keyFunc != nil {
		p.Detail = "The idempotency key of this request must hold 1 to " + strconv.Itoa(idem.MaxKeyLen) +
			" bytes without control characters: " + reason + "."
		return p
	}
	p.Detail = "The " + m.header + " header must appear once and hold 1 to " + strconv.Itoa(idem.MaxKeyLen) +
		" bytes without control characters: " + reason + "."
	return p
}

// keyMissing is the answer to a request without a key.
func (m *middleware) keyMissing() problem {
	p := problem{Type: ProblemKeyMissing, Title: "Idempotency key missing", Status: http.StatusBadRequest}
	if m.keyFunc != nil {
		p.Detail = "No idempotency key (an event or message id) could be found in this request, so it was not run."
		return p
	}
	p.Detail = "This request must carry an " + m.header + " header: a unique value, such as a UUID, that the client sends again when it retries the request."
	return p
}

// bodyProblem refuses a request whose body could not be read: a client that
// went away while sending it is cancelled, not a bad request.
func (m *middleware) bodyProblem(r *http.Request, err error) verdict {
	if r.Context().Err() != nil {
		return verdict{kind: idem.ResultCanceled, err: err, problem: m.canceledProblem()}
	}
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) || errors.Is(err, errBodyTooLarge) {
		return verdict{kind: idem.ResultTooLarge, err: err, problem: problem{
			Type: ProblemBodyTooLarge, Title: "Request body too large", Status: http.StatusRequestEntityTooLarge,
			Detail: "A request with an " + m.keyName() + " may have a body of at most " + strconv.FormatInt(m.bodyLimit, 10) + " bytes.",
		}}
	}
	return verdict{kind: idem.ResultInvalid, err: err, problem: problem{
		Type: ProblemBodyUnreadable, Title: "Request body unreadable", Status: http.StatusBadRequest,
		Detail: "The request body could not be read: " + err.Error() + ".",
	}}
}

// fail answers an error of Begin for the request of tenant and key.
func (m *middleware) fail(next http.Handler, w http.ResponseWriter, r *http.Request, rep *integration.Request, tenant, key string, err error) {
	var busy *idem.InProgressError
	switch {
	case errors.Is(err, idem.ErrMismatch):
		m.refuse(w, r, rep, idem.ResultMismatch, err, problem{
			Type: ProblemMismatch, Title: "Idempotency key reused", Status: http.StatusUnprocessableEntity,
			Detail: "This " + m.keyName() + " was first used with another request (another method, path or body). Send a new key for a new request.",
		})
	case errors.As(err, &busy):
		rep.Event.LeaseLeft = busy.RetryAfter
		w.Header().Set("Retry-After", strconv.FormatInt(m.retryAfterSeconds(busy.RetryAfter), 10))
		m.refuse(w, r, rep, idem.ResultInProgress, err, problem{
			Type: ProblemInProgress, Title: "Request in progress", Status: http.StatusConflict,
			Detail: "A request with this " + m.keyName() + " is still being handled. Retry later to get its response.",
		})
	case errors.Is(err, idem.ErrInvalidKey):
		m.refuse(w, r, rep, idem.ResultInvalid, err, problem{
			Type: ProblemKeyInvalid, Title: "Idempotency key invalid", Status: http.StatusBadRequest,
			Detail: err.Error(),
		})
	case errors.Is(err, idem.ErrResultExpired):
		m.expired(w, r, rep, err)
	case errors.Is(err, idem.ErrCorrupt):
		m.corrupt(w, r, rep, err)
	case r.Context().Err() != nil:
		// The client is gone: whether the request ran before cannot matter
		// to it, and running it unguarded (fail-open) would let its retry
		// run it again.
		m.canceled(w, r, rep, err)
	case m.failOpen:
		rep.End(idem.ResultFailOpen, 0, err) // before the handler, which may panic
		next.ServeHTTP(w, withRequestKey(r, tenant, key))
	default:
		w.Header().Set("Retry-After", unavailableRetryAfter)
		m.refuse(w, r, rep, idem.ResultUnavailable, err, problem{
			Type: ProblemUnavailable, Title: "Idempotency store unavailable", Status: http.StatusServiceUnavailable,
			Detail: "Whether this request already ran cannot be checked now, so it was not run. Retry it with the same " + m.keyName() + ".",
		})
	}
}

// expired answers a key whose request completed and whose response is not
// kept (ErrResultExpired, or a completion with nothing to replay).
func (m *middleware) expired(w http.ResponseWriter, r *http.Request, rep *integration.Request, err error) {
	m.refuse(w, r, rep, idem.ResultExpired, err, problem{
		Type: ProblemResultExpired, Title: "Response no longer kept", Status: http.StatusGone,
		Detail: "A request with this " + m.keyName() + " ran and completed; its response is no longer kept, and it was not run again. Send a new key for a new request.",
	})
}

// retryAfterSeconds is the Retry-After of a 409 while the other request's
// lease has leaseLeft: the hint, or leaseLeft if shorter, in whole seconds
// rounded up, at least 1.
func (m *middleware) retryAfterSeconds(leaseLeft time.Duration) int64 {
	d := min(m.retryAfter, leaseLeft)
	return max(1, int64((d+time.Second-1)/time.Second))
}

// canceled answers a request whose client went away before its key could be
// checked: nothing ran.
func (m *middleware) canceled(w http.ResponseWriter, r *http.Request, rep *integration.Request, err error) {
	m.refuse(w, r, rep, idem.ResultCanceled, err, m.canceledProblem())
}

func (m *middleware) canceledProblem() problem {
	return problem{
		Type: ProblemCanceled, Title: "Request cancelled", Status: StatusClientClosedRequest,
		Detail: "The request was cancelled before its " + m.keyName() + " could be checked, so it was not run. Retry it with the same " + m.keyName() + ".",
	}
}

// corrupt answers a record that cannot be read.
func (m *middleware) corrupt(w http.ResponseWriter, r *http.Request, rep *integration.Request, err error) {
	m.refuse(w, r, rep, idem.ResultCorrupt, err, problem{
		Type: ProblemCorrupt, Title: "Idempotency record unreadable", Status: http.StatusInternalServerError,
		Detail: "The stored record of this " + m.keyName() + " cannot be read, so the request was not run.",
	})
}

// refuse answers p, with the error writer, and reports it: the status the
// middleware chose, whatever the writer answers.
func (m *middleware) refuse(w http.ResponseWriter, r *http.Request, rep *integration.Request, result idem.Result, err error, p problem) {
	defer rep.End(result, p.Status, err) // also when the user's writer panics
	m.answer(w, r, Refusal{Status: p.Status, Type: p.Type, Title: p.Title, Detail: p.Detail, Result: result, Err: err})
}

// answer writes ref with the error writer: WriteProblem, or the user's
// (WithErrorWriter), which finds nosniff with the answer's other headers on
// w, and which answers ref.Status unless it writes a status of its own.
func (m *middleware) answer(w http.ResponseWriter, r *http.Request, ref Refusal) {
	if !m.ownWriter {
		writeProblem(w, problem{Type: ref.Type, Title: ref.Title, Status: ref.Status, Detail: ref.Detail})
		return
	}
	w.Header().Set("X-Content-Type-Options", "nosniff")
	aw := &answerWriter{ResponseWriter: w, status: ref.Status}
	m.writeError(aw, r, ref)
	if !aw.wrote {
		aw.WriteHeader(ref.Status)
	}
}

// bodyHeaders describe a body; a replay whose body was not kept drops them.
var bodyHeaders = []string{
	"Content-Type", "Content-Encoding", "Content-Language", "Content-Location", "Content-Range",
	"Content-Disposition", "Content-Md5", "Content-Digest", "Repr-Digest", "Digest", "Etag", "Last-Modified",
}

// replay answers the stored response.
func (m *middleware) replay(w http.ResponseWriter, r *http.Request, rep *integration.Request, out idem.Outcome) {
	rep.Event.Token, rep.Event.Attempt = out.Token, out.Attempt()
	if len(out.Value) == 0 {
		// Completed with nothing to replay: a marker (a consumer's
		// message under the same key), not a response of this middleware.
		m.expired(w, r, rep, nil)
		return
	}
	s, err := decodeResponse(out.Value)
	if err != nil {
		m.corrupt(w, r, rep, err)
		return
	}
	defer rep.End(idem.ResultReplayed, s.Status, nil) // also when the user's error writer panics
	h := w.Header()
	own := s.copyHeader(h, 3) // and room for the three headers of the replay's own
	h[ReplayedHeader] = own.one("true")
	h["Date"] = own.one(httpDate())
	switch s.Fate {
	case bodyKept:
		if bodyAllowed(s.Status) {
			h["Content-Length"] = own.one(strconv.Itoa(len(s.Body)))
		}
		w.WriteHeader(s.Status)
		_, _ = w.Write(s.Body)
	default:
		for _, name := range bodyHeaders {
			h.Del(name)
		}
		detail := "The first response to this " + m.keyName() + " had a body of " + strconv.FormatInt(s.Size, 10) +
			" bytes, more than is kept for replays. Its status and headers are replayed; its body is not."
		if s.Fate == bodyStreamed {
			detail = "The first response to this " + m.keyName() + " was streamed, so its body was not kept for replays. Its status and headers are replayed; its body is not."
		}
		m.answer(w, r, Refusal{Type: ProblemBodyNotKept, Title: "Response body not kept", Status: s.Status, Detail: detail, Result: idem.ResultReplayed})
	}
}

// httpDate is the time now in HTTP's format (http.TimeFormat), made once a
// second and shared until the next.
func httpDate() string {
	now := time.Now()
	if d := lastDate.Load(); d != nil && d.unix == now.Unix() {
		return d.text
	}
	d := &formattedDate{unix: now.Unix(), text: now.UTC().Format(http.TimeFormat)}
	lastDate.Store(d)
	return d.text
}

// formattedDate is a second in HTTP's format.
type formattedDate struct {
	unix int64
	text string
}

// lastDate is the second httpDate last formatted.
var lastDate atomic.Pointer[formattedDate]

// errPanicked is the Err of the ResultReleased of a panicking handler.
var errPanicked = errors.New("idem: the handler panicked; the key was released")

// run runs the handler under the claim, then stores its response or
// releases the key.
func (m *middleware) run(next http.Handler, w http.ResponseWriter, r *http.Request, rep *integration.Request, cl *idem.Claim) {
	rep.Event.Token, rep.Event.Attempt, rep.Event.Recovered = cl.Token(), cl.Attempt(), cl.Recovered()

	ctx, stop := cl.KeepAlive(r.Context()) // its context carries cl (ClaimFromContext)
	if errors.Is(context.Cause(ctx), idem.ErrLeaseLost) {
		// The claim came back too late to hold the key: another attempt
		// may hold it now, and the handler does not run.
		lost := stop()
		w.Header().Set("Retry-After", strconv.FormatInt(m.retryAfterSeconds(m.retryAfter), 10))
		m.refuse(w, r, rep, idem.ResultLeaseLost, lost, problem{
			Type: ProblemInProgress, Title: "Request in progress", Status: http.StatusConflict,
			Detail: "A request with this " + m.keyName() + " is being handled by another attempt. Retry later to get its response.",
		})
		return
	}
	c := &capture{w: w, limit: m.responseLimit, outer: cloneHeader(w.Header())}
	rep.Running()
	finished := false
	defer func() {
		if finished {
			return
		}
		// The handler panicked: give the key up, or, once its execution
		// began, store a failure in place of its response; then let the
		// panic go on.
		stop()
		cctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), cleanupTimeout)
		defer cancel()
		if c.ctx.began.Load() {
			status, stored := m.failure(r, errPanickedAfterBegan)
			m.settled(rep, idem.ResultDone, status, errPanickedAfterBegan, cl.Complete(cctx, stored, m.retention(status)))
			return
		}
		m.settled(rep, idem.ResultReleased, 0, errPanicked, cl.Release(cctx))
	}()
	c.ctx.Context = ctx
	next.ServeHTTP(c, r.WithContext(&c.ctx))
	finished = true

	lost := stop()
	began := c.ctx.began.Load()
	// A handler that returns after its client went away without a success
	// most likely gave up: let the retry run it again, unless its
	// execution began.
	gaveUp := r.Context().Err() != nil && !(c.status >= 200 && c.status < 400)
	var status int
	var stored []byte
	var note error
	if began && gaveUp && c.status == 0 {
		// It gave up without an answer: what it did is unknown, and a
		// 200 with nothing would say it succeeded.
		note = errGaveUpAfterBegan
		status, stored = m.failure(r, note)
	} else {
		status, stored = c.response()
	}
	if lost != nil {
		rep.End(idem.ResultLeaseLost, status, lost)
		return
	}
	m.settle(r, rep, cl, status, stored, !began && (gaveUp || !m.store(status)), note)
}

// settle stores the handler's response (status, in its stored form) under
// the claim, or releases the key; then it reports what happened, with note.
func (m *middleware) settle(r *http.Request, rep *integration.Request, cl *idem.Claim, status int, stored []byte, release bool, note error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), cleanupTimeout)
	defer cancel()
	if release {
		m.settled(rep, idem.ResultReleased, status, note, cl.Release(ctx))
		return
	}
	m.settled(rep, idem.ResultDone, status, note, cl.Complete(ctx, stored, m.retention(status)))
}

// retention is how long a response with status is kept: the Keeper's
// error retention (WithErrorRetention) for a 4xx, its retention (0)
// otherwise, a stored 5xx included: its request began executing.
func (m *middleware) retention(status int) time.Duration {
	if status >= 400 && status < 500 {
		return integration.ErrorRetention(m.k)
	}
	return 0
}

// Errors of a handler that failed after ExecutionBegan, for the Observer
// (the Err of ResultDone) and the error writer (Refusal.Err).
var (
	errPanickedAfterBegan = errors.New("idem: the handler panicked after its execution began; a 500 was stored")
	errGaveUpAfterBegan   = errors.New("idem: the handler returned without an answer after its execution began and its client went away; a 500 was stored")
)

// failure returns the stored form of the answer kept for a request whose
// handler began executing and then failed without an answer (cause): a 500
// ProblemExecutionFailed, rendered by the error writer, and the status the
// writer answered.
func (m *middleware) failure(r *http.Request, cause error) (status int, stored []byte) {
	c := &capture{w: &headerOnly{h: http.Header{}}, limit: m.responseLimit}
	m.answer(c, r, Refusal{
		Type: ProblemExecutionFailed, Title: "Request failed", Status: http.StatusInternalServerError,
		Detail: "This request began executing and failed before it answered, so its outcome is not known; it will not be run again with this " +
			m.keyName() + ". Check the state of what it acts on before sending a new request with a new key.",
		Result: idem.ResultDone, Err: cause,
	})
	return c.response()
}

// headerOnly is a ResponseWriter that keeps its headers and drops the rest:
// under a capture, it renders an answer that is only stored.
type headerOnly struct{ h http.Header }

func (w *headerOnly) Header() http.Header         { return w.h }
func (w *headerOnly) Write(p []byte) (int, error) { return len(p), nil }
func (w *headerOnly) WriteHeader(int)             {}

// settled reports result, or the lease loss or store failure that
// prevented it, for a handler that answered status.
func (m *middleware) settled(rep *integration.Request, result idem.Result, status int, note, err error) {
	switch {
	case errors.Is(err, idem.ErrLeaseLost):
		result, note = idem.ResultLeaseLost, err
	case err != nil:
		result, note = idem.ResultUnavailable, err
	}
	rep.End(result, status, note)
}
