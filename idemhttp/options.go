package idemhttp

import (
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/idemkit/idem"
)

// Option configures New.
type Option func(*middleware)

// WithMethods sets the methods the middleware guards; other requests pass
// straight through. Default: POST and PATCH. PUT and DELETE are idempotent by
// definition in HTTP, but may be listed. At least one method is required.
func WithMethods(methods ...string) Option {
	return func(m *middleware) { m.methods = slices.Clone(methods) }
}

// WithKeyHeader sets the request header that carries the key. Default:
// "Idempotency-Key" (DefaultKeyHeader).
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
func WithScope(tenant func(r *http.Request) string) Option {
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
func WithFingerprint(digest func(r *http.Request, body []byte) []byte) Option {
	return func(m *middleware) { m.fingerprint = digest }
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

// WithStorePolicy sets which statuses are stored and replayed; for the
// others the key is released, so that a retry runs the handler again.
// Default: DefaultStorePolicy.
func WithStorePolicy(store func(status int) bool) Option {
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
func WithWait(d time.Duration) Option {
	return func(m *middleware) { m.wait = d }
}

// WithFailOpen makes the middleware run the handler unguarded (no Claim in
// its context, nothing stored) when the store is unreachable, instead of
// answering 503. Retries may then run the handler more than once. Default:
// false.
func WithFailOpen(open bool) Option {
	return func(m *middleware) { m.failOpen = open }
}

// WithHook sets a function called with every outcome, for logs and metrics.
// It is called synchronously on the request's goroutine, so it must be quick
// and safe for concurrent use. Default: none.
func WithHook(hook func(Event)) Option {
	return func(m *middleware) { m.hook = hook }
}

// middleware holds the settings of New; it is read-only once made.
type middleware struct {
	k             *idem.Keeper
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
	case m.bodyLimit <= 0:
		return bad("body limit %d is not positive", m.bodyLimit)
	case m.responseLimit <= 0:
		return bad("response limit %d is not positive", m.responseLimit)
	case m.wait < 0:
		return bad("wait %s is negative", m.wait)
	}
	return nil
}
