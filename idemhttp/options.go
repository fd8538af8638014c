package idemhttp

import (
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/idemkit/idem"
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
	// DefaultRetryAfter is the Retry-After of a 409 answered while another
	// request with the key is in progress, when the lease has longer left.
	DefaultRetryAfter = time.Second
)

// Defaults of Transport.
const (
	// DefaultMaxAttempts is how many times a Transport sends a request at
	// most, the first time included.
	DefaultMaxAttempts = 5
	// DefaultBackoff is the wait before the first retry that no Retry-After
	// sets; it doubles for each retry after.
	DefaultBackoff = 100 * time.Millisecond
	// DefaultMaxDelay is the longest wait between two attempts.
	DefaultMaxDelay = 10 * time.Second
	// AttemptsHeader is set by a Transport on each response it returns to the
	// number of attempts it made; read it with Attempts.
	AttemptsHeader = "Idem-Attempts"
)

// cleanupTimeout bounds how long the middleware spends storing or releasing
// a claim after the handler returned: the client may be gone, but the
// handler's outcome is still recorded.
const cleanupTimeout = 5 * time.Second

// Option configures New.
type Option func(*middleware)

// WithMethods sets the methods the middleware guards; other requests pass
// straight through. Default: POST and PATCH. At least one method is
// required; a method is matched exactly, as HTTP's methods are
// case-sensitive ("DELETE", not "delete").
//
// A request whose method is not guarded passes through as if the
// middleware were not there, whether it carries a key or not: its key is
// not read nor checked, nothing is claimed nor stored, and a retry runs the
// handler again and gets a fresh answer, never Idempotent-Replayed. That is
// what becomes of the Idempotency-Key that some SDKs send on DELETE
// (stripe-go does) under the default. PUT and DELETE are idempotent by
// definition in HTTP (their effect is the same however often they run), but
// not their answer: a DELETE run again may answer 404 where the first
// answered 200. List DELETE to replay the first answer instead, and to run
// a DELETE whose handler has effects beyond the deletion (an email, a
// refund) once per key:
//
//	idemhttp.New(keeper, idemhttp.WithMethods(http.MethodPost, http.MethodPatch, http.MethodDelete))
//
// A guarded DELETE is guarded as a POST is: its key is required
// (WithKeyRequired), its method and path are fingerprinted, so the same key
// on a POST or on another resource answers 422. For a key that is required
// on POST and optional on DELETE, put two middlewares on the routes, one
// inside the other, each with its own methods: they share the Keeper's key
// space and tell the methods apart by fingerprint. A GET may be listed too,
// although it should have no effect to guard.
func WithMethods(methods ...string) Option {
	return func(m *middleware) { m.methods = slices.Clone(methods) }
}

// WithKeyHeader sets the request header that carries the key. Default:
// "Idempotency-Key" (DefaultKeyHeader).
//
// Authenticate before the middleware runs: in middleware outside it, or in
// the scope function (WithScope), which may refuse the request; for a
// webhook, check the signature in a key function (WithKeyFunc). A request
// refused there never reaches Redis, so it cannot block the key. A check
// left to the handler still works: its 401, 403 or 407 is released, not
// stored (DefaultStorePolicy), so the genuine request with the key runs
// when it comes; but the refused request has claimed the key meanwhile, and
// a genuine one arriving at that moment is answered 409.
func WithKeyHeader(name string) Option {
	return func(m *middleware) { m.header = name }
}

// WithKeyRequired sets whether a guarded request must carry a key. When it
// must, a request without one answers 400; when it need not, such a request
// passes through to the handler unguarded. Default: true.
func WithKeyRequired(required bool) Option {
	return func(m *middleware) { m.required = required }
}

// WithScope sets the function that names the tenant or principal a request
// acts for, such as an account id taken from its authentication. A record is
// named by the scope and the key, so one tenant can never replay another's
// response nor block another's key. Default: every request belongs to one
// tenant, "".
//
// A request the function cannot place (no tenant, no account) must not share
// a key space with others: the function returns an error, and the
// middleware refuses the request before Redis is touched, with the status
// and detail of a *RefusedError (see Refuse), or 400 and a generic detail
// for any other error, whose text is not shown to the client. The handler
// does not run; the Keeper's Observer is told ResultRefused with the error. The function is
// called only for a request the middleware guards: a guarded method, with a
// key, whose body was read.
//
// By default a key names one request of a tenant across every endpoint, and
// reusing it on another endpoint answers 422. To give each endpoint its own
// key space, put the route into the scope, for example
// tenant(r)+" "+r.Pattern inside a ServeMux (chi:
// chi.RouteContext(r.Context()).RoutePattern(), which is known only once
// chi has routed the request: install the middleware on the route).
func WithScope(tenant func(r *http.Request) (string, error)) Option {
	return func(m *middleware) { m.scope = tenant }
}

// WithKeyFunc sets the function that reads a request's key, in place of the
// key header (WithKeyHeader is then unused): for webhooks and inboxes, whose
// key is the sender's event or message id, in a header of the sender's
// choosing (X-GitHub-Delivery) or in the body (a Stripe event's "id"). body
// is the whole request body, read up to the body limit (a larger one answers
// 413 before the function is called); r.Body reads the same bytes, for a
// function that reads it (as some webhook libraries' verifiers do), and the
// handler gets the whole body whatever the function does with r.Body.
//
// The function returns the key; or "" when the request has none, which is
// answered as a request without the key header is (400, or passed through
// unguarded when WithKeyRequired is false); or an error to refuse the
// request, as a scope function does (see WithScope): a signature that does
// not verify answers the status of Refuse(http.StatusUnauthorized, ...),
// and the handler does not run. A key that ValidateKey refuses answers 400.
// Default: none; the key is the key header's value.
//
// This is where a webhook's signature belongs: a forged or mis-signed
// delivery is refused before its event id is claimed, so it can neither
// replay an answer nor hold the id while the genuine delivery arrives. A
// signature checked in the handler instead answers 401, which is released
// rather than stored (DefaultStorePolicy), so the genuine delivery still
// runs; only a custom store policy that keeps 401 would lock it out.
func WithKeyFunc(key func(r *http.Request, body []byte) (string, error)) Option {
	return func(m *middleware) { m.keyFunc = key }
}

// WithRetryAfter sets the Retry-After of a 409 answered while another request
// with the key is in progress: how long the client should wait before it asks
// again. The header says d, or the time left on the other request's lease if
// that is shorter, in whole seconds rounded up (HTTP's unit, so at least 1).
// A handler that takes 200 ms is done long before the default lease
// (idem.DefaultLease, 30 s) runs out: the hint keeps an obedient client from
// waiting for the lease. Default: 1s (DefaultRetryAfter). It must be
// positive; idem.MaxDuration announces the whole lease left.
func WithRetryAfter(d time.Duration) Option {
	return func(m *middleware) { m.retryAfter = d }
}

// WithFingerprint sets the function that digests a request; a later request
// with the same key and another digest answers 422. body is the whole
// request body (at most the body limit); the handler gets it whole whatever
// the function does with r.Body. The method and the concrete path are
// always fingerprinted besides the digest, so a function that reads only the
// body (the IETF draft's payload fingerprint) still tells two resources
// apart; a nil digest leaves only them. Default: SHA-256 over the method,
// the path and query (r.URL.RequestURI()), and the body.
func WithFingerprint(digest func(r *http.Request, body []byte) []byte) Option {
	return func(m *middleware) { m.fingerprint, m.ownDigest = digest, true }
}

// WithBodyLimit sets how many bytes of a request body are read and
// fingerprinted; a larger body answers 413 and the handler does not run.
// Default: 1 MiB (DefaultBodyLimit). It must be positive.
func WithBodyLimit(n int64) Option {
	return func(m *middleware) { m.bodyLimit = n }
}

// WithResponseLimit sets how many bytes of a response body are kept for
// replays. A larger response still reaches the first client whole and is
// still stored (status and headers); replays say that its body was not
// kept. Default: 1 MiB (DefaultResponseLimit). It must be positive.
func WithResponseLimit(n int64) Option {
	return func(m *middleware) { m.responseLimit = n }
}

// WithStorePolicy sets which statuses are stored and replayed when the
// handler did not call ExecutionBegan; for the others the key is released,
// so that a retry runs the handler again. Once the handler called
// ExecutionBegan, every status is stored, whatever the policy says.
// Default: DefaultStorePolicy. SuccessStorePolicy is Stripe's rule. A
// policy that stores 401, 403 or 407 lets a request that failed
// authentication answer for the key: a forged webhook delivery would then
// lock its event id for the error retention.
func WithStorePolicy(store func(status int) bool) Option {
	return func(m *middleware) { m.store = store }
}

// SuccessStorePolicy stores 2xx and 3xx and releases every other status,
// 4xx included. With handlers that call ExecutionBegan before their side
// effect, it is Stripe's rule: a result is saved only for a request that
// began executing (or succeeded), so that a request that failed validation
// (400, 404, 422) never holds its key and the corrected request may use
// it; a failure after ExecutionBegan (a declined card's 402, a 500) is
// stored, whatever the policy says. A handler that has a side effect and
// then answers a 4xx without having called ExecutionBegan is run again by
// a retry under this policy, which is why it is not the default.
func SuccessStorePolicy(status int) bool {
	return status >= 200 && status < 400
}

// DefaultStorePolicy stores 2xx, 3xx, and 4xx except 401 Unauthorized, 403
// Forbidden and 407 Proxy Authentication Required, which say the request
// failed authentication and never started the operation (as Stripe saves
// no result for a request that did not start executing), and 408 Request
// Timeout, 409 Conflict, 425 Too Early and 429 Too Many Requests, which say
// "try again"; it releases 1xx and 5xx. A released status is answered to its
// request and not replayed: the next request with the key runs the handler.
func DefaultStorePolicy(status int) bool {
	switch status {
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusProxyAuthRequired,
		http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status >= 200 && status < 500
}

// WithWait makes a request that finds its key in progress wait up to d (and
// within its context) for the first request's response, and replay it,
// instead of answering 409 at once; still in progress after d, it answers
// 409 with the Retry-After hint (WithRetryAfter). If the first request's key
// is released meanwhile, the waiting request runs the handler itself.
// Default: 0, answer 409 at once. It must not be negative.
func WithWait(d time.Duration) Option {
	return func(m *middleware) { m.wait = d }
}

// WithFailOpen makes the middleware run the handler unguarded (no Claim in
// its context, nothing stored; RequestKey still gives the tenant and the
// key) when the store is unreachable, instead of answering 503. Retries may
// then run the handler more than once. Default: false.
func WithFailOpen(open bool) Option {
	return func(m *middleware) { m.failOpen = open }
}

// WithErrorWriter sets the function that writes every answer the
// middleware gives itself, in place of the handler's, so that an API
// answers in its own error shape (a Stripe-shaped API:
// {"error":{"type":"idempotency_error",...}}), and its clients' SDKs read
// those answers as they read the API's other errors. ref says what the
// answer is: its status, its kind (the Problem constants), a title and a
// detail, the request's idem.Result and the cause. Default: WriteProblem,
// RFC 9457 application/problem+json. A nil function is refused
// (ErrInvalidConfig).
//
// The function is called once per answer, with the request, after the
// middleware has set the headers of the answer on w.Header():
// Retry-After on a 409 and a 503, X-Content-Type-Options: nosniff, and,
// for a replay whose body was not kept (ProblemBodyNotKept), the stored
// headers with Idempotent-Replayed and Date but without the headers that
// describe a body (Content-Type, Content-Length, ETag...). It keeps them
// and writes the status and a body of its own (with its Content-Type);
// it may add headers (Stripe-Should-Retry) or remove some. It should
// answer ref.Status: a ProblemBodyNotKept answer is a replay, whose status
// may be a success, and whose body is the writer's too.
//
// The 500 stored for a handler that failed after ExecutionBegan
// (ProblemExecutionFailed) is rendered once, by the writer, into a
// response that is stored, not sent: w holds no header of the request's
// then, and what the writer answers is replayed to every retry.
//
// The writer cannot change what the middleware did: the handler ran or
// not, the key was stored, released or left alone before it is called.
// The Keeper's Observer is told ref.Result and ref.Status, whatever status
// the writer answers. A writer that writes no status answers ref.Status,
// with the body it wrote or none: never net/http's implicit 200. A writer
// that panics panics in the server's goroutine (net/http recovers it), and
// the Observer is told of the request all the same.
func WithErrorWriter(write func(w http.ResponseWriter, r *http.Request, ref Refusal)) Option {
	return func(m *middleware) { m.writeError, m.ownWriter = write, true }
}

// middleware holds the settings of New; it is read-only once made.
type middleware struct {
	k             *idem.Keeper
	methods       []string
	header        string
	required      bool
	scope         func(*http.Request) (string, error)
	keyFunc       func(*http.Request, []byte) (string, error) // nil: the key header
	fingerprint   func(*http.Request, []byte) []byte
	ownDigest     bool // fingerprint is the user's (WithFingerprint), not defaultFingerprint
	bodyLimit     int64
	responseLimit int64
	store         func(int) bool
	wait          time.Duration
	waitOption    idem.Option // idem.WithWait(wait), made once by New
	retryAfter    time.Duration
	failOpen      bool
	writeError    func(http.ResponseWriter, *http.Request, Refusal)
	ownWriter     bool // writeError is the user's (WithErrorWriter), not WriteProblem
}

func (m *middleware) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: middleware: "+format, append([]any{idem.ErrInvalidConfig}, args...)...)
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
	case m.writeError == nil:
		return bad("nil error writer")
	case m.bodyLimit <= 0:
		return bad("body limit %d is not positive", m.bodyLimit)
	case m.responseLimit <= 0:
		return bad("response limit %d is not positive", m.responseLimit)
	case m.wait < 0:
		return bad("wait %s is negative", m.wait)
	case m.retryAfter <= 0:
		return bad("Retry-After hint %s is not positive", m.retryAfter)
	}
	return nil
}
