package idem

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Defaults of the HTTP middleware.
const (
	// DefaultKeyHeader is the request header that carries the key.
	DefaultKeyHeader = "Idempotency-Key"
	// DefaultBodyLimit is how many bytes of a request body are read to
	// fingerprint it; a larger body is refused with 413.
	DefaultBodyLimit = 1 << 20
	// DefaultResponseLimit is how many bytes of a response body are kept for
	// replays; the body of a larger response is not kept.
	DefaultResponseLimit = 1 << 20
	// ReplayedHeader is set to "true" on every replayed response.
	ReplayedHeader = "Idempotent-Replayed"
)

// StatusClientClosedRequest is the status the middleware answers (and reports
// in its Event) for a request whose client went away before its key could be
// checked: 499, as nginx logs it. No standard status says "the client left".
const StatusClientClosedRequest = 499

// unavailableRetryAfter is the Retry-After of a 503, in seconds.
const unavailableRetryAfter = "1"

// NewMiddleware returns net/http middleware that makes unsafe requests
// idempotent with the Idempotency-Key header, as Stripe's API and the IETF
// draft draft-ietf-httpapi-idempotency-key-header describe it. It returns an
// error wrapping ErrInvalidConfig for a nil Keeper or an option that cannot
// work; the middleware itself never panics on its own account.
//
// Requests whose method is not guarded (WithMethods; default POST and PATCH)
// pass straight through. For a guarded request:
//
//   - The key is the header's value (WithKeyHeader); a quoted string
//     (`"abc"`, the draft's Structured Field form) means its content. No
//     header while the key is required (WithKeyRequired; default) answers
//     400; with an optional key, the request passes through unguarded. A key
//     that is empty, longer than MaxKeyLen bytes, holds control characters,
//     or comes in more than one header answers 400.
//   - The body is read, up to a limit (WithBodyLimit; default 1 MiB, above it
//     413), and given back to the handler unchanged.
//   - A record is named by the tenant (WithScope; default none) and the
//     key, as Stripe names them: the same key under two tenants is two
//     records, and one key names one request of a tenant, whatever endpoint
//     or router it reaches.
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
//     cancelled, with a cause wrapping ErrLeaseLost, if the lease is lost;
//     the lease is renewed while the handler runs. The response goes to the
//     client as it is written; a copy is kept.
//   - The handler finished: a stored status (WithStorePolicy; default
//     DefaultStorePolicy: 2xx, 3xx, and 4xx except 408, 409, 425, 429) is
//     stored with its headers and body, for the Keeper's retention, or its
//     ErrorRetention for 4xx. Any other status releases the key, so a retry
//     runs the handler again. So does a panic (the key is released, then the
//     panic goes on) and a handler that returns after the client went away
//     (its request context is done) without having written a 2xx or 3xx
//     status: a success written after the client left is stored, because its
//     side effect happened.
//   - A response body larger than WithResponseLimit (default 1 MiB), or one
//     the handler flushed while writing it: the status and headers are
//     stored, the body is not; the key is not released for that reason.
//     Replays answer the stored status and headers with an
//     application/problem+json body of type ProblemBodyNotKept in place of
//     the body.
//   - The request repeats a finished one: the stored response is replayed:
//     status, every header value in order, body, plus "Idempotent-Replayed:
//     true" and a fresh Date. Set-Cookie, Authorization, WWW-Authenticate,
//     Proxy-Authenticate, hop-by-hop headers and trailers are never stored
//     nor replayed; nor are headers that middleware outside this one set
//     before the handler ran and the handler left as they were (a request
//     id): that middleware sets them afresh on the replay.
//   - Another request with the key is in progress: 409 with Retry-After, the
//     seconds left on its lease rounded up; or, with WithWait, the request
//     waits up to that long for the result and replays it.
//   - The store is unreachable: 503 with "Retry-After: 1", and the handler
//     does not run; with WithFailOpen, the handler runs unguarded instead.
//   - The record cannot be read (ErrCorrupt): 500; nothing is overwritten.
//
// Every answer of the middleware's own is an RFC 9457 application/problem+json
// body with type (the Problem constants), title, status and detail. WithHook
// reports each outcome.
//
// The capture given to the handler supports http.ResponseController through
// Unwrap, http.Flusher and io.ReaderFrom. A hijacked connection bypasses it:
// do not guard endpoints that hijack.
func NewMiddleware(k *Keeper, opts ...MiddlewareOption) (func(http.Handler) http.Handler, error) {
	if k == nil {
		return nil, fmt.Errorf("%w: nil Keeper", ErrInvalidConfig)
	}
	m := &middleware{
		k:             k,
		methods:       []string{http.MethodPost, http.MethodPatch},
		header:        DefaultKeyHeader,
		required:      true,
		scope:         func(*http.Request) string { return "" },
		fingerprint:   defaultFingerprint,
		bodyLimit:     DefaultBodyLimit,
		responseLimit: DefaultResponseLimit,
		store:         DefaultStorePolicy,
	}
	for _, o := range opts {
		o(m)
	}
	if err := m.validate(); err != nil {
		return nil, err
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			m.serve(next, w, r)
		})
	}, nil
}

// MiddlewareOption configures NewMiddleware.
type MiddlewareOption func(*middleware)

// WithMethods sets the methods the middleware guards; other requests pass
// straight through. Default: POST and PATCH. PUT and DELETE are idempotent by
// definition in HTTP, but may be listed. At least one method is required.
func WithMethods(methods ...string) MiddlewareOption {
	return func(m *middleware) { m.methods = slices.Clone(methods) }
}

// WithKeyHeader sets the request header that carries the key. Default:
// "Idempotency-Key" (DefaultKeyHeader).
func WithKeyHeader(name string) MiddlewareOption {
	return func(m *middleware) { m.header = name }
}

// WithKeyRequired sets whether a guarded request must carry a key. When it
// must, a request without one answers 400; when it need not, such a request
// passes through to the handler unguarded. Default: true.
func WithKeyRequired(required bool) MiddlewareOption {
	return func(m *middleware) { m.required = required }
}

// WithScope sets the function that names the tenant or principal a request
// acts for, such as an account id taken from its authentication. A record is
// named by the scope and the key, so one tenant can never replay another's
// response nor block another's key. It must not return an error's text for a
// request it cannot place: authenticate before this middleware runs.
// Default: every request belongs to one tenant, "".
//
// By default a key names one request of a tenant across every endpoint, and
// reusing it on another endpoint answers 422. To give each endpoint its own
// key space, put the route into the scope, for example
// tenant(r)+" "+r.Pattern inside a ServeMux (chi:
// chi.RouteContext(r.Context()).RoutePattern(), which is known only once
// chi has routed the request: install the middleware on the route).
func WithScope(tenant func(r *http.Request) string) MiddlewareOption {
	return func(m *middleware) { m.scope = tenant }
}

// WithFingerprint sets the function that digests a request; a later request
// with the same key and another digest answers 422. body is the whole
// request body (at most the body limit); the handler gets it whole whatever
// the function does with r.Body. The method and the concrete path are
// always fingerprinted besides the digest, so a function that reads only the
// body (the IETF draft's payload fingerprint) still tells two resources
// apart; a nil digest leaves only them. Default: SHA-256 over the method,
// the path and query (r.URL.RequestURI()), and the body.
func WithFingerprint(digest func(r *http.Request, body []byte) []byte) MiddlewareOption {
	return func(m *middleware) { m.fingerprint = digest }
}

// WithBodyLimit sets how many bytes of a request body are read and
// fingerprinted; a larger body answers 413 and the handler does not run.
// Default: 1 MiB (DefaultBodyLimit). It must be positive.
func WithBodyLimit(n int64) MiddlewareOption {
	return func(m *middleware) { m.bodyLimit = n }
}

// WithResponseLimit sets how many bytes of a response body are kept for
// replays. A larger response still reaches the first client whole and is
// still stored (status and headers); replays say that its body was not
// kept. Default: 1 MiB (DefaultResponseLimit). It must be positive.
func WithResponseLimit(n int64) MiddlewareOption {
	return func(m *middleware) { m.responseLimit = n }
}

// WithStorePolicy sets which statuses are stored and replayed; for the
// others the key is released, so that a retry runs the handler again.
// Default: DefaultStorePolicy.
func WithStorePolicy(store func(status int) bool) MiddlewareOption {
	return func(m *middleware) { m.store = store }
}

// DefaultStorePolicy stores 2xx, 3xx, and 4xx except 408 Request Timeout,
// 409 Conflict, 425 Too Early and 429 Too Many Requests, which say "try
// again"; it releases 1xx and 5xx.
func DefaultStorePolicy(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status >= 200 && status < 500
}

// WithWait makes a request that finds its key in progress wait up to d (and
// within its context) for the first request's response, and replay it,
// instead of answering 409 at once. If the first request's key is released
// meanwhile, the waiting request runs the handler itself. Default: 0, answer
// 409 at once. It must not be negative.
func WithWait(d time.Duration) MiddlewareOption {
	return func(m *middleware) { m.wait = d }
}

// WithFailOpen makes the middleware run the handler unguarded (no Claim in
// its context, nothing stored) when the store is unreachable, instead of
// answering 503. Retries may then run the handler more than once. Default:
// false.
func WithFailOpen(open bool) MiddlewareOption {
	return func(m *middleware) { m.failOpen = open }
}

// WithHook sets a function called with every outcome, for logs and metrics.
// It is called synchronously on the request's goroutine, so it must be quick
// and safe for concurrent use. Default: none.
func WithHook(hook func(Event)) MiddlewareOption {
	return func(m *middleware) { m.hook = hook }
}

// EventKind is the outcome an Event reports.
type EventKind uint8

// The outcomes of a guarded request. A request that runs the handler reports
// EventClaimed, then one of EventStored, EventReleased, EventLeaseLost or
// EventUnavailable; every other request reports one event.
const (
	// EventClaimed: the key was claimed; the handler runs now.
	EventClaimed EventKind = iota + 1
	// EventStored: the handler's response was stored for replays.
	EventStored
	// EventReleased: the key was released after the handler, so a retry
	// runs it again: the store policy said so, the client went away, or the
	// handler panicked (Err says so).
	EventReleased
	// EventReplayed: a stored response was replayed.
	EventReplayed
	// EventConflict: another request with the key was in progress; answered
	// 409 (after waiting, with WithWait).
	EventConflict
	// EventMismatch: the key was used with another request; answered 422.
	EventMismatch
	// EventLeaseLost: the handler's claim was taken over or expired before
	// its response could be stored; the response reached the client but was
	// not stored.
	EventLeaseLost
	// EventUnavailable: the store could not be reached. Before the handler:
	// answered 503. After it: the response reached the client but could not
	// be stored or released, and the key stays in progress until its lease
	// runs out.
	EventUnavailable
	// EventFailOpen: the store could not be reached and the handler ran
	// unguarded (WithFailOpen).
	EventFailOpen
	// EventInvalid: the key was missing or malformed, or the body could not
	// be read; answered 400.
	EventInvalid
	// EventTooLarge: the request body was above the body limit; answered 413.
	EventTooLarge
	// EventCorrupt: the record could not be read; answered 500.
	EventCorrupt
	// EventCanceled: the request's context ended (the client went away)
	// before the key could be checked; the handler did not run, even with
	// WithFailOpen, and the answer is StatusClientClosedRequest, which the
	// client most likely never reads.
	EventCanceled
)

var eventNames = [...]string{
	EventClaimed: "claimed", EventStored: "stored", EventReleased: "released",
	EventReplayed: "replayed", EventConflict: "conflict", EventMismatch: "mismatch",
	EventLeaseLost: "lease lost", EventUnavailable: "unavailable", EventFailOpen: "fail open",
	EventInvalid: "invalid", EventTooLarge: "too large", EventCorrupt: "corrupt",
	EventCanceled: "canceled",
}

// String returns the outcome's name, such as "replayed".
func (k EventKind) String() string {
	if int(k) < len(eventNames) && eventNames[k] != "" {
		return eventNames[k]
	}
	return "EventKind(" + strconv.Itoa(int(k)) + ")"
}

// Event is one outcome of a guarded request, given to the WithHook function.
type Event struct {
	Kind EventKind
	// Request is the request as the middleware received it.
	Request *http.Request
	// Key is the client's key; empty when there was none.
	Key string
	// Status is the status answered (refusals, replays) or the handler's
	// status (EventStored, EventReleased, EventLeaseLost and EventUnavailable
	// after the handler); zero for EventClaimed, EventFailOpen, and a panic.
	Status int
	// Token is the fencing token of the claim, or of the claim whose response
	// was replayed; zero when there is none.
	Token int64
	// Attempt and Recovered describe the claim (see Claim); zero and false
	// when there is none.
	Attempt   int
	Recovered bool
	// RetryAfter is the time left on the other request's lease
	// (EventConflict); zero otherwise.
	RetryAfter time.Duration
	// Err is the error behind the outcome, if any: the store's error, the
	// lease loss, the invalid key, or a note that the handler panicked.
	Err error
}

// errPanicked is the Err of the EventReleased of a panicking handler.
var errPanicked = errors.New("idem: the handler panicked; the key was released")

// middleware holds the settings of NewMiddleware; it is read-only once made.
type middleware struct {
	k             *Keeper
	methods       []string
	header        string
	required      bool
	scope         func(*http.Request) string
	fingerprint   func(*http.Request, []byte) []byte
	bodyLimit     int64
	responseLimit int64
	store         func(int) bool
	wait          time.Duration
	failOpen      bool
	hook          func(Event)
}

func (m *middleware) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: middleware: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if len(m.methods) == 0 {
		return bad("no method to guard")
	}
	for _, meth := range m.methods {
		if !isToken(meth) {
			return bad("method %q is not an HTTP token", meth)
		}
	}
	if !isToken(m.header) {
		return bad("key header %q is not an HTTP token", m.header)
	}
	m.header = http.CanonicalHeaderKey(m.header)
	switch {
	case m.scope == nil:
		return bad("nil scope function")
	case m.fingerprint == nil:
		return bad("nil fingerprint function")
	case m.store == nil:
		return bad("nil store policy")
	case m.bodyLimit <= 0:
		return bad("body limit %d is not positive", m.bodyLimit)
	case m.responseLimit <= 0:
		return bad("response limit %d is not positive", m.responseLimit)
	case m.wait < 0:
		return bad("wait %s is negative", m.wait)
	}
	return nil
}

// serve handles one request.
func (m *middleware) serve(next http.Handler, w http.ResponseWriter, r *http.Request) {
	if !slices.Contains(m.methods, r.Method) {
		next.ServeHTTP(w, r)
		return
	}
	ev := Event{Request: r}
	key, present, err := m.requestKey(r)
	ev.Key = key
	switch {
	case !present && !m.required:
		next.ServeHTTP(w, r)
		return
	case !present:
		m.refuse(w, ev, EventInvalid, nil, problem{
			Type: ProblemKeyMissing, Title: "Idempotency key missing", Status: http.StatusBadRequest,
			Detail: "This request must carry an " + m.header + " header: a unique value, such as a UUID, that the client sends again when it retries the request.",
		})
		return
	case err != nil:
		m.refuse(w, ev, EventInvalid, err, problem{
			Type: ProblemKeyInvalid, Title: "Idempotency key invalid", Status: http.StatusBadRequest,
			Detail: "The " + m.header + " header must appear once and hold 1 to " + strconv.Itoa(MaxKeyLen) +
				" bytes without control characters: " + strings.TrimPrefix(err.Error(), ErrInvalidKey.Error()+": ") + ".",
		})
		return
	}

	body, err := m.readBody(r)
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) || errors.Is(err, errBodyTooLarge) {
			m.refuse(w, ev, EventTooLarge, err, problem{
				Type: ProblemBodyTooLarge, Title: "Request body too large", Status: http.StatusRequestEntityTooLarge,
				Detail: "A request with an " + m.header + " may have a body of at most " + strconv.FormatInt(m.bodyLimit, 10) + " bytes.",
			})
			return
		}
		m.refuse(w, ev, EventInvalid, err, problem{
			Type: ProblemBodyUnreadable, Title: "Request body unreadable", Status: http.StatusBadRequest,
			Detail: "The request body could not be read: " + err.Error() + ".",
		})
		return
	}

	fp := requestFingerprint(r, m.fingerprint(r, body))
	if r.Body != nil && r.Body != http.NoBody {
		r.Body = io.NopCloser(bytes.NewReader(body)) // for the handler, whole again
	}
	out, err := m.k.Begin(r.Context(), m.scope(r), key, Fingerprint(fp), Wait(m.wait))
	switch {
	case err != nil:
		m.fail(next, w, r, ev, err)
	case out.Replayed:
		m.replay(w, ev, out)
	default:
		m.run(next, w, r, ev, out.Claim)
	}
}

// requestFingerprint is the fingerprint of a request's record: SHA-256 over
// its method and its concrete path, then the digest of the fingerprint
// function (WithFingerprint; nil: nothing more). The method and the path are
// always part of it, so that a key reused on another endpoint or another
// resource answers 422 whatever the fingerprint function reads, and a
// record never replays to a request for another resource.
func requestFingerprint(r *http.Request, digest []byte) []byte {
	h := sha256.New()
	writeField(h, r.Method)
	writeField(h, requestPath(r))
	h.Write(digest)
	return h.Sum(nil)
}

// requestPath is the path the client asked for: the request target as
// received (before any router or http.StripPrefix rewrote r.URL) up to its
// query, or r.URL's escaped path for a request made in process.
func requestPath(r *http.Request) string {
	if r.RequestURI != "" {
		path, _, _ := strings.Cut(r.RequestURI, "?")
		return path
	}
	return r.URL.EscapedPath()
}

// writeField writes s to h, its length first, so that no field can end where
// another goes on.
func writeField(h io.Writer, s string) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(s)))
	h.Write(n[:])
	io.WriteString(h, s)
}

// requestKey returns the request's key, whether it has the header, and an
// error wrapping ErrInvalidKey if the key cannot be used.
func (m *middleware) requestKey(r *http.Request) (key string, present bool, err error) {
	vs := r.Header.Values(m.header)
	switch len(vs) {
	case 0:
		return "", false, nil
	case 1:
	default:
		return "", true, fmt.Errorf("%w: %d %s headers", ErrInvalidKey, len(vs), m.header)
	}
	key, err = unquoteKey(vs[0])
	if err != nil {
		return "", true, err
	}
	return key, true, ValidateKey(key)
}

// unquoteKey returns the content of v if it is a Structured Field string
// ("..." with \" and \\ escapes, RFC 8941), else v.
func unquoteKey(v string) (string, error) {
	if v == "" || v[0] != '"' {
		return v, nil
	}
	if len(v) < 2 || v[len(v)-1] != '"' {
		return "", fmt.Errorf("%w: unterminated quoted string", ErrInvalidKey)
	}
	inner := v[1 : len(v)-1]
	if !strings.ContainsAny(inner, `\"`) {
		return inner, nil
	}
	var b strings.Builder
	for i := 0; i < len(inner); i++ {
		switch c := inner[i]; c {
		case '\\':
			i++
			if i == len(inner) || (inner[i] != '"' && inner[i] != '\\') {
				return "", fmt.Errorf("%w: bad escape in quoted string", ErrInvalidKey)
			}
			b.WriteByte(inner[i])
		case '"':
			return "", fmt.Errorf("%w: unescaped quote in quoted string", ErrInvalidKey)
		default:
			b.WriteByte(c)
		}
	}
	return b.String(), nil
}

var errBodyTooLarge = errors.New("idem: request body too large")

// readBody reads the request body, up to the limit.
func (m *middleware) readBody(r *http.Request) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	if r.ContentLength > m.bodyLimit {
		return nil, errBodyTooLarge
	}
	// One byte past the limit tells a body at the limit from a larger one;
	// a limit of math.MaxInt64 has no byte past it.
	body, err := io.ReadAll(io.LimitReader(r.Body, saturatingAdd(m.bodyLimit, 1)))
	if err != nil {
		return nil, err
	}
	if int64(len(body)) > m.bodyLimit {
		return nil, errBodyTooLarge
	}
	return body, nil
}

// saturatingAdd returns a+b for b >= 0, or math.MaxInt64 where that
// overflows.
func saturatingAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// defaultFingerprint is SHA-256 over the method, the request target and the
// body, each but the last preceded by its length.
func defaultFingerprint(r *http.Request, body []byte) []byte {
	h := sha256.New()
	writeField(h, r.Method)
	writeField(h, r.URL.RequestURI())
	h.Write(body)
	return h.Sum(nil)
}

// fail answers an error of Begin.
func (m *middleware) fail(next http.Handler, w http.ResponseWriter, r *http.Request, ev Event, err error) {
	var busy *InProgressError
	switch {
	case errors.Is(err, ErrMismatch):
		m.refuse(w, ev, EventMismatch, err, problem{
			Type: ProblemMismatch, Title: "Idempotency key reused", Status: http.StatusUnprocessableEntity,
			Detail: "This " + m.header + " was first used with another request (another method, path or body). Send a new key for a new request.",
		})
	case errors.As(err, &busy):
		ev.RetryAfter = busy.RetryAfter
		secs := max(1, int64((busy.RetryAfter+time.Second-1)/time.Second))
		w.Header().Set("Retry-After", strconv.FormatInt(secs, 10))
		m.refuse(w, ev, EventConflict, err, problem{
			Type: ProblemInProgress, Title: "Request in progress", Status: http.StatusConflict,
			Detail: "A request with this " + m.header + " is still being handled. Retry later to get its response.",
		})
	case errors.Is(err, ErrInvalidKey):
		m.refuse(w, ev, EventInvalid, err, problem{
			Type: ProblemKeyInvalid, Title: "Idempotency key invalid", Status: http.StatusBadRequest,
			Detail: err.Error(),
		})
	case errors.Is(err, ErrCorrupt):
		m.corrupt(w, ev, err)
	case r.Context().Err() != nil:
		// The client is gone: whether the request ran before cannot matter
		// to it, and running it unguarded (fail-open) would let its retry
		// run it again.
		m.refuse(w, ev, EventCanceled, err, problem{
			Type: ProblemCanceled, Title: "Request cancelled", Status: StatusClientClosedRequest,
			Detail: "The request was cancelled before its " + m.header + " could be checked, so it was not run. Retry it with the same " + m.header + ".",
		})
	case m.failOpen:
		ev.Kind, ev.Err = EventFailOpen, err
		m.emit(ev)
		next.ServeHTTP(w, r)
	default:
		w.Header().Set("Retry-After", unavailableRetryAfter)
		m.refuse(w, ev, EventUnavailable, err, problem{
			Type: ProblemUnavailable, Title: "Idempotency store unavailable", Status: http.StatusServiceUnavailable,
			Detail: "Whether this request already ran cannot be checked now, so it was not run. Retry it with the same " + m.header + ".",
		})
	}
}

// corrupt answers a record that cannot be read.
func (m *middleware) corrupt(w http.ResponseWriter, ev Event, err error) {
	m.refuse(w, ev, EventCorrupt, err, problem{
		Type: ProblemCorrupt, Title: "Idempotency record unreadable", Status: http.StatusInternalServerError,
		Detail: "The stored record of this " + m.header + " cannot be read, so the request was not run.",
	})
}

// refuse answers p and reports it.
func (m *middleware) refuse(w http.ResponseWriter, ev Event, kind EventKind, err error, p problem) {
	ev.Kind, ev.Status, ev.Err = kind, p.Status, err
	writeProblem(w, p)
	m.emit(ev)
}

// bodyHeaders describe a body; a replay whose body was not kept drops them.
var bodyHeaders = []string{
	"Content-Type", "Content-Encoding", "Content-Language", "Content-Location", "Content-Range",
	"Content-Disposition", "Content-Md5", "Content-Digest", "Repr-Digest", "Digest", "Etag", "Last-Modified",
}

// replay answers the stored response.
func (m *middleware) replay(w http.ResponseWriter, ev Event, out Outcome) {
	ev.Token = out.Token
	var s storedResponse
	if err := s.unmarshal(out.Value); err != nil {
		m.corrupt(w, ev, err)
		return
	}
	h := w.Header()
	for name, vs := range s.Header {
		h[name] = slices.Clone(vs)
	}
	h.Set(ReplayedHeader, "true")
	h.Set("Date", time.Now().UTC().Format(http.TimeFormat))
	ev.Kind, ev.Status = EventReplayed, s.Status
	switch s.Fate {
	case bodyKept:
		if bodyAllowed(s.Status) {
			h.Set("Content-Length", strconv.Itoa(len(s.Body)))
		}
		w.WriteHeader(s.Status)
		_, _ = w.Write(s.Body)
	default:
		for _, name := range bodyHeaders {
			h.Del(name)
		}
		detail := "The first response to this " + m.header + " had a body of " + strconv.FormatInt(s.Size, 10) +
			" bytes, more than is kept for replays. Its status and headers are replayed; its body is not."
		if s.Fate == bodyStreamed {
			detail = "The first response to this " + m.header + " was streamed, so its body was not kept for replays. Its status and headers are replayed; its body is not."
		}
		writeProblem(w, problem{Type: ProblemBodyNotKept, Title: "Response body not kept", Status: s.Status, Detail: detail})
	}
	m.emit(ev)
}

// run runs the handler under the claim, then stores its response or
// releases the key.
func (m *middleware) run(next http.Handler, w http.ResponseWriter, r *http.Request, ev Event, cl *Claim) {
	ev.Token, ev.Attempt, ev.Recovered = cl.Token(), cl.Attempt(), cl.Recovered()
	ev.Kind = EventClaimed
	m.emit(ev)

	ctx, stop := cl.KeepAlive(ContextWithClaim(r.Context(), cl))
	c := &capture{w: w, limit: m.responseLimit, outer: w.Header().Clone()}
	finished := false
	defer func() {
		if finished {
			return
		}
		// The handler panicked: give the key up, and let the panic go on.
		stop()
		cctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), cleanupTimeout)
		defer cancel()
		m.settled(ev, EventReleased, errPanicked, cl.Release(cctx))
	}()
	next.ServeHTTP(c, r.WithContext(ctx))
	finished = true

	lost := stop()
	resp := c.response()
	ev.Status = resp.Status
	if lost != nil {
		ev.Kind, ev.Err = EventLeaseLost, lost
		m.emit(ev)
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), cleanupTimeout)
	defer cancel()
	// A handler that returns after its client went away without a success
	// most likely gave up: let the retry run it again.
	gaveUp := r.Context().Err() != nil && !(c.status >= 200 && c.status < 400)
	if gaveUp || !m.store(resp.Status) {
		m.settled(ev, EventReleased, nil, cl.Release(cctx))
		return
	}
	value, err := resp.marshal()
	if err != nil {
		m.settled(ev, EventReleased, err, cl.Release(cctx))
		return
	}
	var retention time.Duration // the Keeper's
	if resp.Status >= 400 && resp.Status < 500 {
		retention = m.k.ErrorRetention()
	}
	m.settled(ev, EventStored, nil, cl.Complete(cctx, value, retention))
}

// settled reports kind, or the lease loss or store failure that prevented it.
func (m *middleware) settled(ev Event, kind EventKind, note, err error) {
	ev.Kind, ev.Err = kind, note
	switch {
	case errors.Is(err, ErrLeaseLost):
		ev.Kind, ev.Err = EventLeaseLost, err
	case err != nil:
		ev.Kind, ev.Err = EventUnavailable, err
	}
	m.emit(ev)
}

func (m *middleware) emit(ev Event) {
	if m.hook != nil {
		m.hook(ev)
	}
}

// isToken reports whether s is a non-empty HTTP token (RFC 9110, 5.6.2).
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}
