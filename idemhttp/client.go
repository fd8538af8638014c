package idemhttp

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/idemkit/idem"
)

// Transport is an http.RoundTripper that retries unsafe requests safely: it
// sends every attempt of a request with one Idempotency-Key, so that a server
// guarded by New (or any server that honours the header, as Stripe's API
// does) runs the request once and answers every retry with the first
// response. Its zero value is ready to use, over http.DefaultTransport:
//
//	client := &http.Client{Transport: &idemhttp.Transport{}}
//
// For a request whose method it guards (Methods; default POST and PATCH):
//
//   - The key is the request's own key header (KeyHeader; default
//     Idempotency-Key) if it has one, else the key set on its context with
//     ContextWithKey, else a new random key (a version 4 UUID: 128 bits,
//     122 of them random). Every attempt carries it; the caller's request is
//     not modified. A key that idem.ValidateKey refuses, or two key headers, are
//     an error wrapping idem.ErrInvalidKey, and nothing is sent.
//   - The body is sent again with each attempt, from the request's GetBody
//     (which http.NewRequest sets for a bytes.Buffer, bytes.Reader or
//     strings.Reader). A body without GetBody is read into memory first, up
//     to DefaultBodyLimit; a larger one is sent once, without retries.
//   - The request is sent again, up to MaxAttempts times in all (default 5,
//     DefaultMaxAttempts), after a network error (a TLS certificate that does
//     not verify excepted); after the middleware's own "in progress" answer,
//     a 409 Conflict whose application/problem+json body has the type
//     ProblemInProgress (another request with the key is being handled: the
//     retry gets its response); after 503 Service Unavailable; and after 502
//     Bad Gateway and 504 Gateway Timeout: a proxy's answers that say the
//     server's own answer, if any, was lost, which the same key safely asks
//     for again. Any other status is returned at once: 500, 422 and every
//     other 4xx, and a 409 or 429 without the middleware's problem type,
//     which is the handler's own answer (the middleware does not keep those,
//     so a retry would run the handler again) or another server's.
//   - Before a retry it waits for the response's Retry-After (seconds or an
//     HTTP date), plus a jitter of up to Backoff; without one, for an
//     exponential backoff with jitter: Backoff (default 100 ms,
//     DefaultBackoff), doubled for each retry after the first, up to MaxDelay
//     (default 10 s), of which a random half is waited. A Retry-After longer
//     than MaxDelay (any number of digits: one too large for an int64 is the
//     longest) ends the retries: that response is returned.
//   - The request's context bounds it all. A wait that would end after the
//     context's deadline is not begun: the last response is returned, or the
//     last error. If the context ends during a wait, RoundTrip returns a
//     *TransportError wrapping the context's error.
//
// The response returned tells how many attempts were made (Attempts) and
// whether it replays a response stored for the key (Replayed); its Request
// carries the key. When no response can be returned (every attempt failed on
// the network, the context ended), the error is a *TransportError that holds
// the key: whether the server ran the request is then unknown, and sending it
// again later with that key (ContextWithKey) tells, without running it twice,
// as long as the server still keeps the key (24 h by default with New).
//
// Requests of other methods go to Base unchanged. A setting that cannot work
// (a negative one, a method or header name that is not an HTTP token) makes
// RoundTrip return an error wrapping idem.ErrInvalidConfig; nothing is sent.
// A Transport is safe for concurrent use; do not change its fields once it
// is in use.
type Transport struct {
	// Base sends each attempt. Nil means http.DefaultTransport.
	Base http.RoundTripper
	// Methods are the methods guarded. Nil means POST and PATCH.
	Methods []string
	// KeyHeader is the header that carries the key. Empty means
	// Idempotency-Key (DefaultKeyHeader).
	KeyHeader string
	// MaxAttempts is how many times a request is sent at most, the first
	// time included. Zero means DefaultMaxAttempts; 1 never retries.
	MaxAttempts int
	// Backoff is the wait before the first retry without a Retry-After, and
	// the jitter added to a Retry-After. Zero means DefaultBackoff.
	Backoff time.Duration
	// MaxDelay is the longest wait between two attempts, and the longest
	// Retry-After honoured. Zero means DefaultMaxDelay.
	MaxDelay time.Duration

	// sleep waits for d or until ctx ends; nil: a timer. Tests set it.
	sleep func(ctx context.Context, d time.Duration) error
}

// TransportError is the error of a Transport's RoundTrip that has no
// response to return. The server may or may not have run the request: send
// it again with Key to learn its outcome. http.Client wraps it in a
// *url.Error; errors.As finds it.
type TransportError struct {
	// Key is the idempotency key every attempt carried.
	Key string
	// Attempts is how many attempts were sent; 0 when none was.
	Attempts int
	// Err is the last attempt's error, or the context's when it ended
	// between attempts.
	Err error
}

// Error implements error.
func (e *TransportError) Error() string {
	return fmt.Sprintf("idemhttp: %d attempts with idempotency key %q: %v", e.Attempts, e.Key, e.Err)
}

// Unwrap returns the last error.
func (e *TransportError) Unwrap() error { return e.Err }

type contextKey struct{}

// ContextWithKey returns a copy of ctx that makes a Transport send the
// requests made with it with key, unless a request has its own key header.
// Use it to resend a request whose outcome is unknown with the key of its
// first sending (TransportError.Key).
func ContextWithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, contextKey{}, key)
}

// Attempts returns how many times a Transport sent the request that resp
// answers; 0 when resp did not come through a Transport's retries.
func Attempts(resp *http.Response) int {
	if resp == nil {
		return 0
	}
	n, _ := strconv.Atoi(resp.Header.Get(AttemptsHeader))
	return n
}

// Replayed reports whether resp is a replay of the response stored for its
// key: it carries "Idempotent-Replayed: true" (ReplayedHeader), as New's
// replays do.
func Replayed(resp *http.Response) bool {
	return resp != nil && resp.Header.Get(ReplayedHeader) == "true"
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if !slices.Contains(t.methods(), req.Method) {
		return t.base().RoundTrip(req)
	}
	header, err := t.validate()
	if err != nil {
		closeBody(req)
		return nil, err
	}
	key, err := requestKeyOf(req, header)
	if err != nil {
		closeBody(req)
		return nil, err
	}
	first, again, err := replayableBody(req)
	if err != nil {
		return nil, &TransportError{Key: key, Err: err}
	}
	return t.send(req, header, key, first, again)
}

// CloseIdleConnections closes the idle connections of Base, if it keeps
// any; http.Client.CloseIdleConnections calls it.
func (t *Transport) CloseIdleConnections() {
	if c, ok := t.base().(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// send sends the attempts of req with key. first is the first attempt's
// body; again makes the body of each later one, nil when the body cannot be
// sent again.
func (t *Transport) send(req *http.Request, header, key string, first io.ReadCloser, again func() (io.ReadCloser, error)) (*http.Response, error) {
	ctx := req.Context()
	limit := t.maxAttempts()
	if again == nil {
		limit = 1
	}
	body := first
	for attempt := 1; ; attempt++ {
		resp, err := t.base().RoundTrip(attemptRequest(req, header, key, body))
		delay, retry := t.retryDelay(resp, err, attempt)
		if !retry || attempt == limit || ctx.Err() != nil || pastDeadline(ctx, delay) {
			return lastAnswer(resp, err, key, attempt)
		}
		drain(resp)
		if err := t.wait(ctx, delay); err != nil {
			return nil, &TransportError{Key: key, Attempts: attempt, Err: err}
		}
		if body, err = again(); err != nil {
			return nil, &TransportError{Key: key, Attempts: attempt, Err: fmt.Errorf("idemhttp: GetBody: %w", err)}
		}
	}
}

// retryDelay says whether the answer of an attempt (resp or err) calls for
// another, and after how long.
func (t *Transport) retryDelay(resp *http.Response, err error, attempt int) (time.Duration, bool) {
	if err != nil {
		return t.backoff(attempt), retryableError(err)
	}
	switch resp.StatusCode {
	case http.StatusServiceUnavailable, http.StatusBadGateway, http.StatusGatewayTimeout:
	case http.StatusConflict:
		if !inProgressAnswer(resp) {
			return 0, false // the handler's own 409, or another server's
		}
	default:
		return 0, false
	}
	after, ok := retryAfter(resp.Header.Get("Retry-After"), time.Now())
	switch {
	case !ok:
		return t.backoff(attempt), true
	case after > t.maxDelay():
		return 0, false // the server asks for longer than the caller waits
	}
	return after + mrand.N(t.backoffBase()+1), true
}

// backoff is the wait after the attempt-th attempt without a Retry-After:
// Backoff doubled for each retry after the first, at most MaxDelay, of which
// a random half is waited ("equal jitter").
func (t *Transport) backoff(attempt int) time.Duration {
	d := t.backoffBase()
	for i := 1; i < attempt && d < t.maxDelay(); i++ {
		d *= 2
	}
	d = min(d, t.maxDelay())
	return d/2 + mrand.N(d/2+1)
}

// wait waits d, or until ctx ends.
func (t *Transport) wait(ctx context.Context, d time.Duration) error {
	if t.sleep != nil {
		return t.sleep(ctx, d)
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// lastAnswer is RoundTrip's answer after the last attempt.
func lastAnswer(resp *http.Response, err error, key string, attempts int) (*http.Response, error) {
	if err != nil {
		return nil, &TransportError{Key: key, Attempts: attempts, Err: err}
	}
	if resp.Header == nil {
		resp.Header = make(http.Header)
	}
	resp.Header.Set(AttemptsHeader, strconv.Itoa(attempts))
	return resp, nil
}

// attemptRequest is one attempt of req: a copy with the key and body.
func attemptRequest(req *http.Request, header, key string, body io.ReadCloser) *http.Request {
	r := req.Clone(req.Context())
	r.Header.Set(header, key)
	r.Body = body
	return r
}

// requestKeyOf is the key of req: its own header, its context's key, or a
// new one.
func requestKeyOf(req *http.Request, header string) (string, error) {
	vs := req.Header.Values(header)
	key, fromCtx := req.Context().Value(contextKey{}).(string)
	switch {
	case len(vs) > 1:
		return "", fmt.Errorf("%w: %d %s headers", idem.ErrInvalidKey, len(vs), header)
	case len(vs) == 1:
		key = vs[0]
	case !fromCtx:
		return newKey(), nil
	}
	if err := idem.ValidateKey(key); err != nil {
		return "", fmt.Errorf("idemhttp: %s: %w", header, err)
	}
	return key, nil
}

// newKey returns a random version 4 UUID.
func newKey() string {
	var u [16]byte
	_, _ = rand.Read(u[:]) // never fails (crypto/rand)
	u[6] = u[6]&0x0f | 0x40
	u[8] = u[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// replayableBody returns the body of the first attempt and a function that
// makes the body of each later one, nil when the body cannot be sent again:
// without GetBody, a body is read into memory up to DefaultBodyLimit, and a
// larger one is sent once.
func replayableBody(req *http.Request) (io.ReadCloser, func() (io.ReadCloser, error), error) {
	switch {
	case req.Body == nil || req.Body == http.NoBody:
		return req.Body, func() (io.ReadCloser, error) { return req.Body, nil }, nil
	case req.GetBody != nil:
		return req.Body, req.GetBody, nil
	}
	buf, err := io.ReadAll(io.LimitReader(req.Body, DefaultBodyLimit+1))
	if err != nil {
		closeBody(req)
		return nil, nil, fmt.Errorf("idemhttp: reading the request body: %w", err)
	}
	if len(buf) > DefaultBodyLimit {
		rest := struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf), req.Body), req.Body}
		return rest, nil, nil
	}
	closeBody(req)
	again := func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf)), nil }
	first, _ := again()
	return first, again, nil
}

// retryableError reports whether a failed attempt may be sent again: not
// when the caller's context ended, nor when the server's certificate does
// not verify (it will not on a retry either).
func retryableError(err error) bool {
	var (
		verify  *tls.CertificateVerificationError
		unknown x509.UnknownAuthorityError
		host    x509.HostnameError
		invalid x509.CertificateInvalidError
	)
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return false
	case errors.As(err, &verify), errors.As(err, &unknown), errors.As(err, &host), errors.As(err, &invalid):
		return false
	}
	return true
}

// problemPeek is how much of a 409's body inProgressAnswer reads to find
// its problem type: the middleware's own is about 300 bytes.
const problemPeek = 4 << 10

// inProgressAnswer reports whether resp, a 409, is the middleware's "in
// progress" answer: an application/problem+json body whose type is
// ProblemInProgress. It reads up to problemPeek bytes of the body, and puts
// them back in front of the rest, so that the body can still be read whole.
func inProgressAnswer(resp *http.Response) bool {
	mediaType, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if mediaType != "application/problem+json" || resp.Body == nil {
		return false
	}
	head, err := io.ReadAll(io.LimitReader(resp.Body, problemPeek))
	resp.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(head), resp.Body), resp.Body}
	if err != nil {
		return false
	}
	var p struct {
		Type string `json:"type"`
	}
	return json.Unmarshal(head, &p) == nil && p.Type == ProblemInProgress
}

// retryAfter parses a Retry-After value, seconds or an HTTP date, as a
// delay from now; ok is false when v is empty or unreadable. RFC 9110's
// delay-seconds is any number of digits: one too large for an int64 is read
// as the longest delay.
func retryAfter(v string, now time.Time) (d time.Duration, ok bool) {
	if v == "" {
		return 0, false
	}
	longest := time.Duration(int64(idem.MaxDuration/time.Second)) * time.Second
	secs, err := strconv.ParseInt(v, 10, 64)
	switch {
	case err == nil && secs < 0:
		return 0, false
	case err == nil:
		return time.Duration(min(secs, int64(idem.MaxDuration/time.Second))) * time.Second, true
	case errors.Is(err, strconv.ErrRange) && isDigits(v):
		return longest, true
	}
	at, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	return max(0, at.Sub(now)), true
}

// pastDeadline reports whether a wait of d would end after ctx's deadline.
func pastDeadline(ctx context.Context, d time.Duration) bool {
	deadline, ok := ctx.Deadline()
	return ok && !time.Now().Add(d).Before(deadline)
}

// drain reads a little of a response that is not returned and closes it,
// so that its connection can be used again.
func drain(resp *http.Response) {
	if resp == nil || resp.Body == nil {
		return
	}
	_, _ = io.CopyN(io.Discard, resp.Body, 64<<10)
	resp.Body.Close()
}

// closeBody closes req's body, as a RoundTripper must even when it sends
// nothing.
func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// validate checks the settings and returns the key header's name.
func (t *Transport) validate() (string, error) {
	bad := func(format string, args ...any) (string, error) {
		return "", fmt.Errorf("%w: Transport: "+format, append([]any{idem.ErrInvalidConfig}, args...)...)
	}
	switch {
	case t.MaxAttempts < 0:
		return bad("MaxAttempts %d is negative", t.MaxAttempts)
	case t.Backoff < 0:
		return bad("Backoff %s is negative", t.Backoff)
	case t.MaxDelay < 0:
		return bad("MaxDelay %s is negative", t.MaxDelay)
	}
	for _, m := range t.Methods {
		if !isToken(m) {
			return bad("method %q is not an HTTP token", m)
		}
	}
	header := t.KeyHeader
	if header == "" {
		header = DefaultKeyHeader
	}
	if !isToken(header) {
		return bad("key header %q is not an HTTP token", header)
	}
	return header, nil
}

func (t *Transport) base() http.RoundTripper {
	if t.Base == nil {
		return http.DefaultTransport
	}
	return t.Base
}

// clientMethods are the methods a Transport guards by default.
var clientMethods = []string{http.MethodPost, http.MethodPatch}

func (t *Transport) methods() []string {
	if t.Methods == nil {
		return clientMethods
	}
	return t.Methods
}

func (t *Transport) maxAttempts() int {
	if t.MaxAttempts == 0 {
		return DefaultMaxAttempts
	}
	return t.MaxAttempts
}

func (t *Transport) backoffBase() time.Duration {
	if t.Backoff == 0 {
		return DefaultBackoff
	}
	return t.Backoff
}

func (t *Transport) maxDelay() time.Duration {
	if t.MaxDelay == 0 {
		return DefaultMaxDelay
	}
	return t.MaxDelay
}

// isDigits reports whether s is one or more ASCII digits.
func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}
