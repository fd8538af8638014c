package idemhttp

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"testing/iotest"
	"time"

	"github.com/idemkit/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// reply is one scripted answer of a scriptedBase: a status with headers, or
// an error.
type reply struct {
	status int
	header []string // name, value pairs
	body   string   // "body" if empty
	err    error
}

// inProgress is the middleware's own 409: its problem type in an
// application/problem+json body, and a Retry-After of secs.
func inProgress(secs string) reply {
	return reply{status: 409, header: []string{"Retry-After", secs, "Content-Type", "application/problem+json"},
		body: `{"type":"` + ProblemInProgress + `","title":"Request in progress","status":409}` + "\n"}
}

// scriptedBase is an http.RoundTripper that answers the attempts it gets
// from a script (the last reply once the script runs out) and records what
// each attempt carried: its key header and its body.
type scriptedBase struct {
	mu      sync.Mutex
	script  []reply
	keys    []string
	bodies  []string
	closed  int // response bodies closed
	onReply func()
}

func (s *scriptedBase) RoundTrip(r *http.Request) (*http.Response, error) {
	var body []byte
	if r.Body != nil {
		body, _ = io.ReadAll(r.Body)
		r.Body.Close()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.keys = append(s.keys, strings.Join(r.Header.Values(DefaultKeyHeader), ","))
	s.bodies = append(s.bodies, string(body))
	rp := s.script[min(len(s.keys), len(s.script))-1]
	if s.onReply != nil {
		s.onReply()
	}
	if rp.err != nil {
		return nil, rp.err
	}
	body = []byte("body")
	if rp.body != "" {
		body = []byte(rp.body)
	}
	resp := &http.Response{StatusCode: rp.status, Header: http.Header{}, Request: r,
		Body: &closeCounter{ReadCloser: io.NopCloser(strings.NewReader(string(body))), s: s}}
	for i := 0; i+1 < len(rp.header); i += 2 {
		resp.Header.Add(rp.header[i], rp.header[i+1])
	}
	return resp, nil
}

func (s *scriptedBase) attempts() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.keys)
}

type closeCounter struct {
	io.ReadCloser
	s *scriptedBase
}

func (c *closeCounter) Close() error {
	c.s.mu.Lock()
	c.s.closed++
	c.s.mu.Unlock()
	return c.ReadCloser.Close()
}

// newScripted returns a Transport over a scriptedBase, whose waits are
// recorded, not slept.
func newScripted(script ...reply) (*Transport, *scriptedBase, *[]time.Duration) {
	base := &scriptedBase{script: script}
	var waits []time.Duration
	tr := &Transport{Base: base, sleep: func(ctx context.Context, d time.Duration) error {
		waits = append(waits, d)
		return ctx.Err()
	}}
	return tr, base, &waits
}

var errReset = errors.New("connection reset by peer")

func newPost(body string) *http.Request {
	r, err := http.NewRequest(http.MethodPost, "http://api.test/payments", strings.NewReader(body))
	if err != nil {
		panic(err)
	}
	return r
}

var uuidV4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestTransportKeepsOneKeyAcrossRetries(t *testing.T) {
	tr, base, waits := newScripted(
		reply{err: errReset},
		reply{status: 503, header: []string{"Retry-After", "1"}},
		inProgress("2"),
		reply{status: 503},
		reply{status: 502},
		reply{status: 504},
		reply{status: 201, header: []string{ReplayedHeader, "true"}},
	)
	tr.MaxAttempts = 7
	req := newPost(`{"amount":100}`)
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	defer resp.Body.Close()

	assert.Equal(t, 201, resp.StatusCode)
	assert.Equal(t, 7, Attempts(resp))
	assert.True(t, Replayed(resp))
	require.Len(t, base.keys, 7)
	assert.Regexp(t, uuidV4, base.keys[0], "a new key is a version 4 UUID")
	for i := range base.keys {
		assert.Equal(t, base.keys[0], base.keys[i], "attempt %d carries the first key", i+1)
		assert.Equal(t, `{"amount":100}`, base.bodies[i], "attempt %d carries the whole body", i+1)
	}
	assert.Equal(t, base.keys[0], resp.Request.Header.Get(DefaultKeyHeader), "the response's request carries the key")
	assert.Empty(t, req.Header.Get(DefaultKeyHeader), "the caller's request is not modified")
	assert.Equal(t, 5, base.closed, "the bodies of the answers retried are closed")

	require.Len(t, *waits, 6)
	assert.InDelta(t, 75*time.Millisecond, (*waits)[0], float64(25*time.Millisecond), "backoff: a random half of Backoff, plus half")
	assert.GreaterOrEqual(t, (*waits)[1], time.Second, "Retry-After is honoured")
	assert.LessOrEqual(t, (*waits)[1], time.Second+DefaultBackoff, "plus at most Backoff of jitter")
	assert.GreaterOrEqual(t, (*waits)[2], 2*time.Second)
	assert.LessOrEqual(t, (*waits)[2], 2*time.Second+DefaultBackoff)
	assert.InDelta(t, 600*time.Millisecond, (*waits)[3], float64(200*time.Millisecond), "the fourth attempt's backoff: 800ms, half of it random")
}

func TestTransportNeverRetriesOtherStatuses(t *testing.T) {
	for _, status := range []int{200, 201, 302, 400, 401, 404, 408, 409, 422, 425, 429, 500, 501, 505} {
		tr, base, waits := newScripted(reply{status: status}, reply{status: 201})
		resp, err := tr.RoundTrip(newPost("x"))
		require.NoError(t, err)
		assert.Equal(t, status, resp.StatusCode)
		assert.Equal(t, 1, Attempts(resp), "status %d", status)
		assert.Equal(t, 1, base.attempts())
		assert.Empty(t, *waits)
	}
}

func TestTransportBoundsAttempts(t *testing.T) {
	tr, base, waits := newScripted(reply{status: 503})
	tr.MaxAttempts = 3
	resp, err := tr.RoundTrip(newPost("x"))
	require.NoError(t, err)
	assert.Equal(t, 503, resp.StatusCode, "the last answer is returned")
	assert.Equal(t, 3, Attempts(resp))
	assert.Equal(t, 3, base.attempts())
	assert.Len(t, *waits, 2)

	tr, base, _ = newScripted(reply{err: errReset})
	_, err = tr.RoundTrip(newPost("x"))
	var te *TransportError
	require.ErrorAs(t, err, &te)
	assert.Equal(t, DefaultMaxAttempts, te.Attempts)
	assert.Equal(t, base.keys[0], te.Key, "the error tells the key, to ask again later")
	assert.ErrorIs(t, err, errReset)
	assert.Equal(t, DefaultMaxAttempts, base.attempts())
}

func TestTransportBackoffGrowsUpToMaxDelay(t *testing.T) {
	tr, _, waits := newScripted(reply{status: 503})
	tr.MaxAttempts, tr.Backoff, tr.MaxDelay = 8, 100*time.Millisecond, time.Second
	_, err := tr.RoundTrip(newPost("x"))
	require.NoError(t, err)
	require.Len(t, *waits, 7)
	for i, d := range []time.Duration{100, 200, 400, 800, 1000, 1000, 1000} {
		d *= time.Millisecond
		assert.GreaterOrEqual(t, (*waits)[i], d/2, "wait %d", i+1)
		assert.LessOrEqual(t, (*waits)[i], d, "wait %d", i+1)
	}
}

// A Retry-After longer than the caller waits, or a wait that would outlast
// the request's deadline, returns the answer at hand at once.
func TestTransportDoesNotWaitPastItsBounds(t *testing.T) {
	tr, base, waits := newScripted(reply{status: 503, header: []string{"Retry-After", "60"}}, reply{status: 201})
	resp, err := tr.RoundTrip(newPost("x"))
	require.NoError(t, err)
	assert.Equal(t, 503, resp.StatusCode)
	assert.Equal(t, 1, base.attempts())
	assert.Empty(t, *waits)

	tr, base, waits = newScripted(reply{status: 503, header: []string{"Retry-After", "5"}}, reply{status: 201})
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	resp, err = tr.RoundTrip(newPost("x").WithContext(ctx))
	require.NoError(t, err)
	assert.Equal(t, 503, resp.StatusCode)
	assert.Equal(t, 1, base.attempts())
	assert.Empty(t, *waits)

	tr, base, _ = newScripted(reply{err: errReset}, reply{status: 201})
	ctx, cancel = context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	<-ctx.Done()
	_, err = tr.RoundTrip(newPost("x").WithContext(ctx))
	assert.ErrorIs(t, err, errReset, "past the deadline, the last error")
	assert.Equal(t, 1, base.attempts())
}

func TestTransportStopsWhenTheContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	tr, base, _ := newScripted(reply{status: 503, header: []string{"Retry-After", "1"}}, reply{status: 201})
	tr.sleep = func(ctx context.Context, d time.Duration) error {
		cancel() // the caller gives up while the Transport waits
		return (&Transport{}).wait(ctx, d)
	}
	_, err := tr.RoundTrip(newPost("x").WithContext(ctx))
	assert.ErrorIs(t, err, context.Canceled)
	var te *TransportError
	require.ErrorAs(t, err, &te)
	assert.Equal(t, 1, te.Attempts)
	assert.Equal(t, 1, base.attempts())

	// The timer's wait ends with the context.
	ctx, cancel = context.WithCancel(context.Background())
	cancel()
	assert.ErrorIs(t, (&Transport{}).wait(ctx, time.Hour), context.Canceled)

	// An attempt that failed because the context ended is not retried.
	ctx, cancel = context.WithCancel(context.Background())
	tr, base, _ = newScripted(reply{err: context.Canceled}, reply{status: 201})
	base.onReply = cancel
	_, err = tr.RoundTrip(newPost("x").WithContext(ctx))
	assert.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, 1, base.attempts())
}

func TestTransportDoesNotRetryACertificateThatDoesNotVerify(t *testing.T) {
	tr, base, _ := newScripted(reply{err: &tls.CertificateVerificationError{Err: errors.New("x509: unknown authority")}}, reply{status: 201})
	_, err := tr.RoundTrip(newPost("x"))
	require.Error(t, err)
	assert.Equal(t, 1, base.attempts())
}

func TestTransportKeyOfTheCaller(t *testing.T) {
	tr, base, _ := newScripted(reply{status: 201})
	req := newPost("x")
	req.Header.Set(DefaultKeyHeader, "order-42")
	_, err := tr.RoundTrip(req.WithContext(ContextWithKey(context.Background(), "from-context")))
	require.NoError(t, err)
	_, err = tr.RoundTrip(newPost("x").WithContext(ContextWithKey(context.Background(), "from-context")))
	require.NoError(t, err)
	assert.Equal(t, []string{"order-42", "from-context"}, base.keys, "the header first, then the context")

	custom, cbase, _ := newScripted(reply{status: 201})
	custom.KeyHeader = "X-Request-Key"
	_, err = custom.RoundTrip(newPost("x"))
	require.NoError(t, err)
	assert.Equal(t, []string{""}, cbase.keys)
}

// A key that cannot be used, or a setting that cannot work, is refused
// before anything is sent, and the body is closed.
func TestTransportRefusesBadInput(t *testing.T) {
	for name, tc := range map[string]struct {
		tr   Transport
		req  func() *http.Request
		want error
	}{
		"control character in the key": {req: func() *http.Request {
			r := newPost("x")
			r.Header.Set(DefaultKeyHeader, "a\x7fb")
			return r
		}, want: idem.ErrInvalidKey},
		"two key headers": {req: func() *http.Request {
			r := newPost("x")
			r.Header.Add(DefaultKeyHeader, "a")
			r.Header.Add(DefaultKeyHeader, "b")
			return r
		}, want: idem.ErrInvalidKey},
		"key over 255 bytes in the context": {req: func() *http.Request {
			return newPost("x").WithContext(ContextWithKey(context.Background(), strings.Repeat("k", 256)))
		}, want: idem.ErrInvalidKey},
		"empty key in the context": {req: func() *http.Request {
			return newPost("x").WithContext(ContextWithKey(context.Background(), ""))
		}, want: idem.ErrInvalidKey},
		"negative MaxAttempts": {tr: Transport{MaxAttempts: -1}, want: idem.ErrInvalidConfig},
		"negative Backoff":     {tr: Transport{Backoff: -1}, want: idem.ErrInvalidConfig},
		"negative MaxDelay":    {tr: Transport{MaxDelay: -1}, want: idem.ErrInvalidConfig},
		"bad key header":       {tr: Transport{KeyHeader: "Idempotency Key"}, want: idem.ErrInvalidConfig},
		"bad method":           {tr: Transport{Methods: []string{"POST", "PO ST"}}, want: idem.ErrInvalidConfig},
	} {
		t.Run(name, func(t *testing.T) {
			base := &scriptedBase{script: []reply{{status: 201}}}
			tc.tr.Base = base
			req := newPost("x")
			if tc.req != nil {
				req = tc.req()
			}
			body := &closeFlag{Reader: strings.NewReader("x")}
			req.Body = body
			_, err := tc.tr.RoundTrip(req)
			assert.ErrorIs(t, err, tc.want)
			assert.Zero(t, base.attempts(), "nothing is sent")
			assert.True(t, body.closed, "the body is closed")
		})
	}
}

type closeFlag struct {
	io.Reader
	closed bool
}

func (c *closeFlag) Close() error { c.closed = true; return nil }

func TestTransportPassesOtherMethodsThrough(t *testing.T) {
	for _, method := range []string{http.MethodGet, http.MethodPut, http.MethodDelete} {
		tr, base, _ := newScripted(reply{status: 503}, reply{status: 200})
		req, _ := http.NewRequest(method, "http://api.test/x", nil)
		resp, err := tr.RoundTrip(req)
		require.NoError(t, err)
		assert.Equal(t, 503, resp.StatusCode)
		assert.Zero(t, Attempts(resp))
		assert.Equal(t, []string{""}, base.keys, "no key is added")
	}
	tr, base, _ := newScripted(reply{status: 503}, reply{status: 200})
	tr.Methods = []string{http.MethodPut}
	req, _ := http.NewRequest(http.MethodPut, "http://api.test/x", nil)
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	assert.Equal(t, 200, resp.StatusCode)
	assert.Equal(t, 2, base.attempts())
}

// A body without GetBody is read into memory and sent again; one over the
// limit is sent once, whole.
func TestTransportBodyWithoutGetBody(t *testing.T) {
	tr, base, _ := newScripted(reply{err: errReset}, reply{status: 201})
	req := newPost("")
	req.Body, req.GetBody = io.NopCloser(iotest.OneByteReader(strings.NewReader("payload"))), nil
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	assert.Equal(t, 2, Attempts(resp))
	assert.Equal(t, []string{"payload", "payload"}, base.bodies)

	tr, base, _ = newScripted(reply{err: errReset}, reply{status: 201})
	large := strings.Repeat("b", DefaultBodyLimit+10)
	req = newPost("")
	req.Body, req.GetBody = io.NopCloser(strings.NewReader(large)), nil
	_, err = tr.RoundTrip(req)
	var te *TransportError
	require.ErrorAs(t, err, &te)
	assert.Equal(t, 1, te.Attempts, "a body that cannot be sent again is sent once")
	require.Len(t, base.bodies, 1)
	assert.Equal(t, large, base.bodies[0])

	tr, base, _ = newScripted(reply{err: errReset}, reply{status: 201})
	req = newPost("x")
	req.GetBody = func() (io.ReadCloser, error) { return nil, errors.New("spent") }
	_, err = tr.RoundTrip(req)
	require.ErrorAs(t, err, &te)
	assert.ErrorContains(t, err, "GetBody")
	assert.Equal(t, 1, base.attempts())
}

func TestRetryAfterParsing(t *testing.T) {
	now := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	for v, want := range map[string]time.Duration{
		"0":                             0,
		"7":                             7 * time.Second,
		"Thu, 02 Jan 2025 03:04:35 GMT": 30 * time.Second,
		"Thu, 02 Jan 2025 03:00:00 GMT": 0, // in the past
		"99999999999999999":             idem.MaxDuration.Truncate(time.Second),
	} {
		d, ok := retryAfter(v, now)
		assert.True(t, ok, v)
		assert.Equal(t, want, d, v)
	}
	for _, v := range []string{"", "-1", "soon", "1.5"} {
		_, ok := retryAfter(v, now)
		assert.False(t, ok, v)
	}
}

// Through http.Client, a *TransportError comes wrapped in a *url.Error.
func TestTransportErrorThroughClient(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	srv.Close() // nothing listens: every attempt is refused
	client := &http.Client{Transport: &Transport{MaxAttempts: 2, Backoff: time.Millisecond}}
	_, err := client.Post(srv.URL, "text/plain", strings.NewReader("x"))
	var te *TransportError
	require.ErrorAs(t, err, &te)
	assert.Equal(t, 2, te.Attempts)
	assert.Regexp(t, uuidV4, te.Key)
	assert.Contains(t, err.Error(), te.Key)
}

func TestAttemptsAndReplayedOfOtherResponses(t *testing.T) {
	assert.Zero(t, Attempts(nil))
	assert.False(t, Replayed(nil))
	assert.Zero(t, Attempts(&http.Response{Header: http.Header{}}))
}

type idleCloser struct {
	http.RoundTripper
	closed bool
}

func (c *idleCloser) CloseIdleConnections() { c.closed = true }

func TestTransportClosesIdleConnectionsOfItsBase(t *testing.T) {
	base := &idleCloser{}
	(&http.Client{Transport: &Transport{Base: base}}).CloseIdleConnections()
	assert.True(t, base.closed)
	(&Transport{Base: &scriptedBase{}}).CloseIdleConnections() // a Base without idle connections
}

// okBase answers 201 at once, without a network.
type okBase struct{}

func (okBase) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil {
		_, _ = io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	return &http.Response{StatusCode: http.StatusCreated, Header: http.Header{}, Body: http.NoBody, Request: r}, nil
}

// BenchmarkTransportOverhead is what a Transport adds to a request answered
// at once: a new key, a copy of the request, the attempts header (and the
// request's own making, in the loop).
func BenchmarkTransportOverhead(b *testing.B) {
	tr := &Transport{Base: okBase{}}
	b.ReportAllocs()
	for b.Loop() {
		resp, err := tr.RoundTrip(newPost(`{"amount":100}`))
		if err != nil || resp.StatusCode != http.StatusCreated {
			b.Fatal(resp, err)
		}
	}
}

// TestTransportRetriesOnlyTheMiddlewaresInProgress: a 409 is retried only
// when it is the middleware's own "in progress" answer (its problem type);
// a handler's own 409 or 429 (which the middleware does not keep, so a retry
// would run the handler again), or another problem type, is returned at
// once, its body whole.
func TestTransportRetriesOnlyTheMiddlewaresInProgress(t *testing.T) {
	tr, base, _ := newScripted(inProgress("1"), reply{status: 201})
	resp, err := tr.RoundTrip(newPost("x"))
	require.NoError(t, err)
	assert.Equal(t, 201, resp.StatusCode)
	assert.Equal(t, 2, base.attempts())

	problem := `{"type":"https://example.com/problems/order-shipped","status":409}`
	for _, r := range []reply{
		{status: 409, header: []string{"Retry-After", "1"}, body: `{"error":"conflict"}`},
		{status: 409, header: []string{"Content-Type", "application/problem+json"}, body: problem},
		{status: 409, header: []string{"Content-Type", "application/json"}, body: `{"type":"` + ProblemInProgress + `"}`},
		{status: 429, header: []string{"Retry-After", "1", "Content-Type", "application/problem+json"}, body: `{"type":"` + ProblemInProgress + `"}`},
		{status: 429, header: []string{"Retry-After", "1"}},
	} {
		tr, base, waits := newScripted(r, reply{status: 201})
		resp, err := tr.RoundTrip(newPost("x"))
		require.NoError(t, err)
		assert.Equal(t, r.status, resp.StatusCode, "%+v", r)
		assert.Equal(t, 1, base.attempts(), "%+v: the handler's own answer is not retried", r)
		assert.Empty(t, *waits)
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		want := r.body
		if want == "" {
			want = "body"
		}
		assert.Equal(t, want, string(body), "the body is returned whole")
	}

	// A problem body larger than what is read to find the type is returned
	// whole too.
	large := `{"detail":"` + strings.Repeat("x", 2*problemPeek) + `","type":"` + ProblemInProgress + `"}`
	tr, _, _ = newScripted(reply{status: 409, header: []string{"Content-Type", "application/problem+json"}, body: large}, reply{status: 201})
	resp, err = tr.RoundTrip(newPost("x"))
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Equal(t, 409, resp.StatusCode)
	assert.Equal(t, large, string(body))
}
