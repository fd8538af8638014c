package idemhttp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"maps"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/scriptname"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMiddleware runs the middleware suite on miniredis;
// TestMiddlewareRedis runs it on redis-server.
func TestMiddleware(t *testing.T) { suite(t, redistest.Miniredis) }

// mwSuite is every middleware test that needs a Redis.
func suite(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	for _, tc := range []struct {
		name string
		test func(*testing.T, func(testing.TB) *redistest.Backend)
	}{
		{"StatusTable", testStatusTable},
		{"InProgressAnswers409", testInProgress},
		{"ConcurrentDuplicatesRunOnce", testConcurrent},
		{"ConcurrentDuplicatesWaitForTheReplay", testConcurrentWait},
		{"TenantsNeverShareRecords", testTenants},
		{"HeaderPolicy", testHeaderPolicy},
		{"RoutePattern", testRoutePattern},
		{"ErrorsKeptForErrorRetention", testErrorRetention},
		{"OversizedResponse", testOversized},
		{"FlushedResponse", testFlushed},
		{"ReadFromAndResponseController", testReadFrom},
		{"PanicReleasesAndRepanics", testPanic},
		{"ClientGoneBeforeAnswer", testClientGoneReleases},
		{"ClientGoneAfterSuccess", testClientGoneStores},
		{"RecoveredClaimAndLostLease", testLeaseLost},
		{"StoreLostAfterHandler", testStoreLostAfterHandler},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.test(t, newEnv) })
	}
}

// mwHandler is a test handler; run counts its calls from 1.
type handler func(run int64, w http.ResponseWriter, r *http.Request)

// mwAnswer answers statuses[run-1] (the last one once they run out) with
// {"run":N} as JSON and an X-Run header.
func answer(statuses ...int) handler {
	if len(statuses) == 0 {
		statuses = []int{http.StatusCreated}
	}
	return func(run int64, w http.ResponseWriter, r *http.Request) {
		status := statuses[min(int(run), len(statuses))-1]
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Run", strconv.FormatInt(run, 10))
		w.WriteHeader(status)
		if bodyAllowed(status) {
			fmt.Fprintf(w, "{\"run\":%d}\n", run)
		}
	}
}

// mwEcho answers 201 with the request body.
func echo(run int64, w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	w.WriteHeader(http.StatusCreated)
	w.Write(b)
}

// mwApp is a handler guarded by the middleware, counting its runs and
// recording the middleware's events.
type app struct {
	env    *redistest.Backend
	keeper *idem.Keeper
	runs   atomic.Int64
	h      http.Handler
	events tap
}

func newKeeper(t testing.TB, env *redistest.Backend, opts ...idem.Option) *idem.Keeper {
	t.Helper()
	return tapped(t, func(observe idem.Option) (*idem.Keeper, error) {
		return idem.NewRedis(env.Client, append(opts, observe)...)
	})
}

// newMWApp guards handler (mwAnswer() if nil) with the options, on k (a new
// Keeper on env if nil).
func newApp(t *testing.T, env *redistest.Backend, k *idem.Keeper, handler handler, opts ...Option) *app {
	t.Helper()
	if k == nil {
		k = newKeeper(t, env)
	}
	if handler == nil {
		handler = answer()
	}
	a := &app{env: env, keeper: k, events: tapOf(t, k)}
	mw, err := New(k, opts...)
	require.NoError(t, err)
	a.h = mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		handler(a.runs.Add(1), w, r)
	}))
	return a
}

func (a *app) do(r *http.Request) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	a.h.ServeHTTP(rec, r)
	return rec
}

// lastEvent returns the kind of the newest event so far, or 0.
func (a *app) lastEvent() idem.Result {
	var k idem.Result
	for {
		select {
		case ev := <-a.events:
			k = ev.Result
		default:
			return k
		}
	}
}

// await returns the next event of kind, skipping others; it fails the test
// after ten seconds.
func (a *app) await(t *testing.T, kind idem.Result) idem.Event {
	t.Helper()
	return awaitEvent(t, a.events, kind)
}

// awaitEvent returns the next event of kind from events, skipping others; it
// fails the test after ten seconds.
func awaitEvent(t *testing.T, events <-chan idem.Event, kind idem.Result) idem.Event {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev := <-events:
			if ev.Result == kind {
				return ev
			}
		case <-timeout:
			require.Failf(t, "timed out", "no %s event", kind)
		}
	}
}

// mwReq is a request with header name, value pairs.
func request(method, target, body string, hdr ...string) *http.Request {
	r := httptest.NewRequest(method, target, strings.NewReader(body))
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Add(hdr[i], hdr[i+1])
	}
	return r
}

// mwPost is POST /x with the key and body.
func postKey(key, body string) *http.Request {
	return request(http.MethodPost, "/x", body, DefaultKeyHeader, key)
}

// mwCheckProblem asserts an RFC 9457 answer of the middleware.
func checkProblem(t *testing.T, status int, h http.Header, body []byte, wantStatus int, wantType string) problem {
	t.Helper()
	require.Equal(t, wantStatus, status, "body: %s", body)
	assert.Equal(t, "application/problem+json", h.Get("Content-Type"))
	var p problem
	require.NoError(t, json.Unmarshal(body, &p), "body: %s", body)
	assert.Equal(t, wantType, p.Type)
	assert.Equal(t, wantStatus, p.Status)
	assert.NotEmpty(t, p.Title)
	assert.NotEmpty(t, p.Detail)
	return p
}

func testStatusTable(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	post := func(key, body string) func() *http.Request {
		return func() *http.Request { return postKey(key, body) }
	}
	run1 := "{\"run\":1}\n"
	run2 := "{\"run\":2}\n"
	type row struct {
		name    string
		opts    []Option
		handler handler
		before  func(t *testing.T, a *app)
		req     func() *http.Request
		status  int
		header  map[string]string // "" means absent
		problem string            // the problem type, or "" for a handler's answer
		body    string            // the handler's body
		runs    int64
		event   idem.Result // the last event; 0 for none
	}
	first := func(req func() *http.Request) func(*testing.T, *app) {
		return func(t *testing.T, a *app) { a.do(req()) }
	}
	corruptAll := func(t *testing.T, a *app, value string) {
		ctx := context.Background()
		a.do(postKey("k1", "a"))
		keys, err := a.env.Client.Keys(ctx, idem.DefaultPrefix+"{*").Result()
		require.NoError(t, err)
		require.Len(t, keys, 1)
		require.NoError(t, a.env.Client.Set(ctx, keys[0], value, 0).Err())
	}
	fresh := map[string]string{ReplayedHeader: "", "Content-Type": "application/json"}
	replayed := map[string]string{ReplayedHeader: "true", "Content-Type": "application/json", "X-Run": "1"}
	rows := []row{
		{name: "unguarded method passes through", req: func() *http.Request { return request(http.MethodGet, "/x", "") },
			status: 201, header: fresh, body: run1, runs: 1},
		{name: "first request runs the handler", req: post("k1", "a"),
			status: 201, header: map[string]string{ReplayedHeader: "", "X-Run": "1"}, body: run1, runs: 1, event: idem.ResultDone},
		{name: "repeat replays", before: first(post("k1", "a")), req: post("k1", "a"),
			status: 201, header: replayed, body: run1, runs: 1, event: idem.ResultReplayed},
		{name: "missing key", req: func() *http.Request { return request(http.MethodPost, "/x", "a") },
			status: 400, problem: ProblemKeyMissing, event: idem.ResultInvalid},
		{name: "optional key missing passes through", opts: []Option{WithKeyRequired(false)},
			before: func(t *testing.T, a *app) { a.do(request(http.MethodPost, "/x", "a")) },
			req:    func() *http.Request { return request(http.MethodPost, "/x", "a") },
			status: 201, header: fresh, body: run2, runs: 2},
		{name: "optional key present is guarded", opts: []Option{WithKeyRequired(false)},
			before: first(post("k1", "a")), req: post("k1", "a"),
			status: 201, header: replayed, body: run1, runs: 1, event: idem.ResultReplayed},
		{name: "empty key", req: post("", "a"), status: 400, problem: ProblemKeyInvalid, event: idem.ResultInvalid},
		{name: "key of 256 bytes", req: post(strings.Repeat("k", 256), "a"), status: 400, problem: ProblemKeyInvalid, event: idem.ResultInvalid},
		{name: "key of 255 bytes", req: post(strings.Repeat("k", 255), "a"), status: 201, body: run1, runs: 1, event: idem.ResultDone},
		{name: "control character in key", req: post("a\tb", "a"), status: 400, problem: ProblemKeyInvalid, event: idem.ResultInvalid},
		{name: "DEL in key", req: post("a\x7fb", "a"), status: 400, problem: ProblemKeyInvalid, event: idem.ResultInvalid},
		{name: "two key headers", req: func() *http.Request {
			return request(http.MethodPost, "/x", "a", DefaultKeyHeader, "k1", DefaultKeyHeader, "k2")
		}, status: 400, problem: ProblemKeyInvalid, event: idem.ResultInvalid},
		{name: "unterminated quoted key", req: post(`"k1`, "a"), status: 400, problem: ProblemKeyInvalid, event: idem.ResultInvalid},
		{name: "quoted key with a bad escape", req: post(`"k\1"`, "a"), status: 400, problem: ProblemKeyInvalid, event: idem.ResultInvalid},
		{name: "empty quoted key", req: post(`""`, "a"), status: 400, problem: ProblemKeyInvalid, event: idem.ResultInvalid},
		{name: "quoted key is its content", before: first(post("k\"1", "a")), req: post(`"k\"1"`, "a"),
			status: 201, header: replayed, body: run1, runs: 1, event: idem.ResultReplayed},
		{name: "body above the limit", opts: []Option{WithBodyLimit(8)}, req: post("k1", "123456789"),
			status: 413, problem: ProblemBodyTooLarge, event: idem.ResultTooLarge},
		{name: "body above the limit, no Content-Length", opts: []Option{WithBodyLimit(8)},
			req: func() *http.Request {
				r := postKey("k1", "")
				r.Body, r.ContentLength = io.NopCloser(strings.NewReader("123456789")), -1
				return r
			}, status: 413, problem: ProblemBodyTooLarge, event: idem.ResultTooLarge},
		{name: "body at the limit", opts: []Option{WithBodyLimit(8)}, req: post("k1", "12345678"),
			status: 201, body: run1, runs: 1, event: idem.ResultDone},
		{name: "same key, other body", before: first(post("k1", "a")), req: post("k1", "b"),
			status: 422, problem: ProblemMismatch, runs: 1, event: idem.ResultMismatch},
		{name: "same key, other query", before: first(post("k1", "a")),
			req:    func() *http.Request { return request(http.MethodPost, "/x?dry=1", "a", DefaultKeyHeader, "k1") },
			status: 422, problem: ProblemMismatch, runs: 1, event: idem.ResultMismatch},
		{name: "same key, other method is refused", before: first(post("k1", "a")),
			req:    func() *http.Request { return request(http.MethodPatch, "/x", "a", DefaultKeyHeader, "k1") },
			status: 422, problem: ProblemMismatch, runs: 1, event: idem.ResultMismatch},
		{name: "same key, other path is refused", before: first(post("k1", "a")),
			req:    func() *http.Request { return request(http.MethodPost, "/y", "a", DefaultKeyHeader, "k1") },
			status: 422, problem: ProblemMismatch, runs: 1, event: idem.ResultMismatch},
		{name: "same key, other tenant is another record", opts: []Option{WithScope(func(r *http.Request) (string, error) { return r.Header.Get("Tenant"), nil })},
			before: first(post("k1", "a")),
			req: func() *http.Request {
				r := request(http.MethodPost, "/x", "a", DefaultKeyHeader, "k1")
				r.Header.Set("Tenant", "t2")
				return r
			},
			status: 201, header: fresh, body: run2, runs: 2, event: idem.ResultDone},
		{name: "handler reads the whole body", handler: echo, req: post("k1", "the body"),
			status: 201, body: "the body", runs: 1, event: idem.ResultDone},
		{name: "fingerprint reading r.Body leaves it whole",
			opts: []Option{WithFingerprint(func(r *http.Request, body []byte) []byte {
				b, _ := io.ReadAll(r.Body)
				return b
			})},
			handler: echo, req: post("k1", "the body"), status: 201, body: "the body", runs: 1, event: idem.ResultDone},
		{name: "custom fingerprint may ignore the body",
			opts:   []Option{WithFingerprint(func(r *http.Request, body []byte) []byte { return []byte(r.Method) })},
			before: first(post("k1", "a")), req: post("k1", "b"),
			status: 201, header: replayed, body: run1, runs: 1, event: idem.ResultReplayed},
		{name: "custom key header", opts: []Option{WithKeyHeader("x-request-id")},
			before: func(t *testing.T, a *app) { a.do(request(http.MethodPost, "/x", "a", "X-Request-Id", "k1")) },
			req:    func() *http.Request { return request(http.MethodPost, "/x", "a", "X-Request-Id", "k1") },
			status: 201, header: replayed, body: run1, runs: 1, event: idem.ResultReplayed},
		{name: "custom key header, default one ignored", opts: []Option{WithKeyHeader("X-Request-Id")},
			req: post("k1", "a"), status: 400, problem: ProblemKeyMissing, event: idem.ResultInvalid},
		{name: "custom methods: POST passes", opts: []Option{WithMethods(http.MethodPut)},
			before: first(func() *http.Request { return request(http.MethodPost, "/x", "a") }),
			req:    func() *http.Request { return request(http.MethodPost, "/x", "a") },
			status: 201, header: fresh, body: run2, runs: 2},
		{name: "custom methods: PUT guarded", opts: []Option{WithMethods(http.MethodPut)},
			req:    func() *http.Request { return request(http.MethodPut, "/x", "a") },
			status: 400, problem: ProblemKeyMissing, event: idem.ResultInvalid},
		{name: "204 replays without a body", handler: answer(204), before: first(post("k1", "a")), req: post("k1", "a"),
			status: 204, header: map[string]string{ReplayedHeader: "true", "Content-Length": ""}, runs: 1, event: idem.ResultReplayed},
		{name: "custom store policy releases 404",
			opts:    []Option{WithStorePolicy(func(s int) bool { return s < 300 })},
			handler: answer(404, 201), before: first(post("k1", "a")), req: post("k1", "a"),
			status: 201, header: fresh, body: run2, runs: 2, event: idem.ResultDone},
		{name: "store unavailable", before: func(t *testing.T, a *app) { a.env.Stop() }, req: post("k1", "a"),
			status: 503, header: map[string]string{"Retry-After": "1"}, problem: ProblemUnavailable, event: idem.ResultUnavailable},
		{name: "store unavailable, fail open", opts: []Option{WithFailOpen(true)},
			before: func(t *testing.T, a *app) { a.env.Stop() }, req: post("k1", "a"),
			status: 201, header: fresh, body: run1, runs: 1, event: idem.ResultFailOpen},
		{name: "record not ours", before: func(t *testing.T, a *app) { corruptAll(t, a, "garbage") }, req: post("k1", "a"),
			status: 500, problem: ProblemCorrupt, runs: 1, event: idem.ResultCorrupt},
		{name: "record of another type", before: func(t *testing.T, a *app) {
			ctx := context.Background()
			a.do(postKey("k1", "a"))
			keys, err := a.env.Client.Keys(ctx, idem.DefaultPrefix+"{*").Result()
			require.NoError(t, err)
			require.NoError(t, a.env.Client.Del(ctx, keys...).Err())
			require.NoError(t, a.env.Client.HSet(ctx, keys[0], "f", "v").Err())
		}, req: post("k1", "a"), status: 500, problem: ProblemCorrupt, runs: 1, event: idem.ResultCorrupt},
		{name: "stored response unreadable", before: func(t *testing.T, a *app) {
			r := postKey("k1", "a")
			out, err := a.keeper.Begin(context.Background(), "", "k1",
				idem.WithFingerprint(requestFingerprint(r, defaultFingerprint(r, []byte("a")))))
			require.NoError(t, err)
			require.NoError(t, out.Claim.Complete(context.Background(), []byte{0x93, 1, 2}, 0))
		}, req: post("k1", "a"), status: 500, problem: ProblemCorrupt, event: idem.ResultCorrupt},
	}
	for _, status := range []int{500, 502, 503, 401, 403, 407, 408, 409, 425, 429} {
		rows = append(rows, row{name: fmt.Sprintf("%d is released", status), handler: answer(status, 201),
			before: first(post("k1", "a")), req: post("k1", "a"),
			status: 201, header: fresh, body: run2, runs: 2, event: idem.ResultDone})
	}
	for _, status := range []int{200, 202, 301, 303, 400, 402, 404, 410, 422} {
		rows = append(rows, row{name: fmt.Sprintf("%d is stored", status), handler: answer(status, 201),
			before: first(post("k1", "a")), req: post("k1", "a"),
			status: status, header: replayed, body: run1, runs: 1, event: idem.ResultReplayed})
	}
	for _, tc := range rows {
		t.Run(tc.name, func(t *testing.T) {
			a := newApp(t, newEnv(t), nil, tc.handler, tc.opts...)
			if tc.before != nil {
				tc.before(t, a)
			}
			rec := a.do(tc.req())
			if tc.problem != "" {
				checkProblem(t, rec.Code, rec.Header(), rec.Body.Bytes(), tc.status, tc.problem)
			} else {
				require.Equal(t, tc.status, rec.Code, "body: %s", rec.Body)
				assert.Equal(t, tc.body, rec.Body.String())
			}
			for name, want := range tc.header {
				if want == "" {
					assert.NotContains(t, rec.Header(), name)
				} else {
					assert.Equal(t, want, rec.Header().Get(name), name)
				}
			}
			if rec.Header().Get(ReplayedHeader) == "true" {
				_, err := http.ParseTime(rec.Header().Get("Date"))
				assert.NoError(t, err, "a replay has a fresh Date")
			}
			assert.Equal(t, tc.runs, a.runs.Load(), "handler runs")
			assert.Equal(t, tc.event, a.lastEvent(), "last event")
		})
	}
}

func testInProgress(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	gate := make(chan struct{})
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		<-gate
		answer()(run, w, r)
	})
	done := make(chan *httptest.ResponseRecorder)
	go func() { done <- a.do(postKey("k1", "a")) }()
	claimed := a.await(t, idem.ResultClaimed)
	assert.Equal(t, 1, claimed.Attempt)

	rec := a.do(postKey("k1", "a"))
	checkProblem(t, rec.Code, rec.Header(), rec.Body.Bytes(), http.StatusConflict, ProblemInProgress)
	secs, err := strconv.Atoi(rec.Header().Get("Retry-After"))
	require.NoError(t, err, "Retry-After is whole seconds")
	assert.Equal(t, 1, secs, "Retry-After is the short hint (DefaultRetryAfter), not the lease left")
	conflict := a.await(t, idem.ResultInProgress)
	assert.Equal(t, http.StatusConflict, conflict.Status)
	assert.True(t, conflict.LeaseLeft > 0 && conflict.LeaseLeft <= idem.DefaultLease)

	close(gate)
	first := <-done
	assert.Equal(t, http.StatusCreated, first.Code)
	rec = a.do(postKey("k1", "a"))
	assert.Equal(t, http.StatusCreated, rec.Code)
	assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
	assert.Equal(t, first.Body.String(), rec.Body.String())
	assert.EqualValues(t, 1, a.runs.Load())
}

// mwResult is a response read by a net/http client.
type result struct {
	status int
	header http.Header
	body   []byte
	err    error
}

func send(c *http.Client, r *http.Request) result {
	resp, err := c.Do(r)
	if err != nil {
		return result{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return result{status: resp.StatusCode, header: resp.Header, body: b, err: err}
}

func clientPost(t *testing.T, url, key, body string) *http.Request {
	r, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	r.Header.Set(DefaultKeyHeader, key)
	return r
}

func testConcurrent(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	const n = 12
	gate := make(chan struct{})
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		<-gate
		answer()(run, w, r)
	})
	srv := httptest.NewServer(a.h)
	defer srv.Close()
	results := make(chan result, n)
	for range n {
		go func() { results <- send(srv.Client(), clientPost(t, srv.URL, "k1", "a")) }()
	}
	// The claim holder waits at the gate, so every other request is answered
	// 409 before it.
	for range n - 1 {
		res := <-results
		require.NoError(t, res.err)
		checkProblem(t, res.status, res.header, res.body, http.StatusConflict, ProblemInProgress)
		assert.NotEmpty(t, res.header.Get("Retry-After"))
	}
	close(gate)
	res := <-results
	require.NoError(t, res.err)
	assert.Equal(t, http.StatusCreated, res.status)
	assert.Empty(t, res.header.Get(ReplayedHeader))

	again := send(srv.Client(), clientPost(t, srv.URL, "k1", "a"))
	require.NoError(t, again.err)
	assert.Equal(t, http.StatusCreated, again.status)
	assert.Equal(t, "true", again.header.Get(ReplayedHeader))
	assert.Equal(t, res.body, again.body)
	assert.EqualValues(t, 1, a.runs.Load())
}

func testConcurrentWait(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	const n = 12
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		time.Sleep(20 * time.Millisecond) // long enough for duplicates to find it in progress
		answer()(run, w, r)
	}, WithWait(20*time.Second))
	srv := httptest.NewServer(a.h)
	defer srv.Close()
	results := make(chan result, n)
	for range n {
		go func() { results <- send(srv.Client(), clientPost(t, srv.URL, "k1", "a")) }()
	}
	replays := 0
	var bodies [][]byte
	for range n {
		res := <-results
		require.NoError(t, res.err)
		require.Equal(t, http.StatusCreated, res.status, "body: %s", res.body)
		if res.header.Get(ReplayedHeader) == "true" {
			replays++
		}
		bodies = append(bodies, res.body)
	}
	assert.Equal(t, n-1, replays)
	for _, b := range bodies {
		assert.Equal(t, "{\"run\":1}\n", string(b))
	}
	assert.EqualValues(t, 1, a.runs.Load())
}

func testTenants(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "secret of %s, run %d", r.Header.Get("X-Tenant"), run)
	}, WithScope(func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil }))
	send := func(tenant string) *httptest.ResponseRecorder {
		return a.do(request(http.MethodPost, "/x", "same body", DefaultKeyHeader, "k1", "X-Tenant", tenant))
	}
	assert.Equal(t, "secret of alice, run 1", send("alice").Body.String())
	bob := send("bob")
	assert.Equal(t, "secret of bob, run 2", bob.Body.String(), "same key and body, another tenant: its own run")
	assert.Empty(t, bob.Header().Get(ReplayedHeader))
	for range 2 {
		alice, bob := send("alice"), send("bob")
		assert.Equal(t, "secret of alice, run 1", alice.Body.String())
		assert.Equal(t, "secret of bob, run 2", bob.Body.String())
		assert.Equal(t, "true", alice.Header().Get(ReplayedHeader))
		assert.Equal(t, "true", bob.Header().Get(ReplayedHeader))
	}
	// A tenant whose name runs into the method cannot reach another scope.
	assert.Equal(t, "secret of aliPOST /x, run 3", send("aliPOST /x").Body.String())
	assert.EqualValues(t, 3, a.runs.Load())
}

func testHeaderPolicy(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	const oldDate = "Mon, 01 Jan 2001 00:00:00 GMT"
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Add("Set-Cookie", "session=1")
		h.Add("Set-Cookie", "theme=dark")
		h.Set("Authorization", "Bearer secret")
		h.Set("WWW-Authenticate", `Basic realm="x"`)
		h.Set("Proxy-Authenticate", `Basic realm="y"`)
		h.Set("Connection", "X-Hop")
		h.Set("X-Hop", "one link only")
		h.Set("Keep-Alive", "timeout=5")
		h.Set("Upgrade", "h2c")
		h.Set("Te", "trailers")
		h.Set("Trailer", "X-Checksum")
		h.Set("Date", oldDate)
		h.Add("Link", "</a>; rel=next")
		h.Add("Link", "</b>; rel=prev")
		h["X-Multi"] = []string{"one", "two", "three"}
		h.Set("Content-Type", "text/plain")
		h.Set("Location", "/payments/1")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "body")
		h.Set("X-Checksum", "after the body: a trailer") // not a header of the response
		h.Set("X-Late", "set after WriteHeader")
	})
	first := a.do(postKey("k1", "a"))
	require.Equal(t, http.StatusCreated, first.Code)
	assert.Equal(t, []string{"session=1", "theme=dark"}, first.Header().Values("Set-Cookie"), "the first answer is the handler's")

	for range 2 {
		rec := a.do(postKey("k1", "a"))
		require.Equal(t, http.StatusCreated, rec.Code)
		h := rec.Header()
		assert.Equal(t, "true", h.Get(ReplayedHeader))
		assert.Equal(t, []string{"one", "two", "three"}, h.Values("X-Multi"))
		assert.Equal(t, []string{"</a>; rel=next", "</b>; rel=prev"}, h.Values("Link"))
		assert.Equal(t, "text/plain", h.Get("Content-Type"))
		assert.Equal(t, "/payments/1", h.Get("Location"))
		assert.Equal(t, "4", h.Get("Content-Length"))
		for _, name := range []string{"Set-Cookie", "Authorization", "Www-Authenticate", "Proxy-Authenticate",
			"Connection", "X-Hop", "Keep-Alive", "Upgrade", "Te", "Trailer", "X-Checksum", "X-Late"} {
			assert.NotContains(t, h, name)
		}
		assert.NotEqual(t, oldDate, h.Get("Date"))
		_, err := http.ParseTime(h.Get("Date"))
		assert.NoError(t, err)
		assert.Equal(t, "body", rec.Body.String())
	}
	assert.EqualValues(t, 1, a.runs.Load())

	// Headers set by outer middleware are theirs: a replay carries this
	// request's id, not the first one's, while a header the handler changed
	// is kept.
	ids := 0
	outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ids++
		w.Header().Set("X-Request-Id", strconv.Itoa(ids))
		w.Header().Set("Content-Type", "application/octet-stream")
		a.h.ServeHTTP(w, r)
	})
	for _, want := range []string{"1", "2"} {
		rec := httptest.NewRecorder()
		outer.ServeHTTP(rec, postKey("k2", "a"))
		assert.Equal(t, want, rec.Header().Get("X-Request-Id"))
		assert.Equal(t, "text/plain", rec.Header().Get("Content-Type"))
		assert.Equal(t, want == "2", rec.Header().Get(ReplayedHeader) == "true")
	}

	// Through a real server and client, multi-value headers arrive intact.
	srv := httptest.NewServer(a.h)
	defer srv.Close()
	res := send(srv.Client(), clientPost(t, srv.URL+"/x", "k1", "a"))
	require.NoError(t, res.err)
	assert.Equal(t, []string{"one", "two", "three"}, res.header.Values("X-Multi"))
	assert.Empty(t, res.header.Values("Set-Cookie"))
	assert.Equal(t, "body", string(res.body))
}

func testRoutePattern(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "item %s, run %d", r.PathValue("id"), run)
	})
	inside := http.NewServeMux()
	inside.Handle("POST /items/{id}", a.h)
	// One key names one request of the tenant: another item with it is
	// another request.
	rec := httptest.NewRecorder()
	inside.ServeHTTP(rec, request(http.MethodPost, "/items/1", "a", DefaultKeyHeader, "k1"))
	assert.Equal(t, "item 1, run 1", rec.Body.String())
	rec = httptest.NewRecorder()
	inside.ServeHTTP(rec, request(http.MethodPost, "/items/2", "a", DefaultKeyHeader, "k1"))
	checkProblem(t, rec.Code, rec.Header(), rec.Body.Bytes(), http.StatusUnprocessableEntity, ProblemMismatch)

	// Around the mux the answers are the same: the router does not matter.
	mux := http.NewServeMux()
	mux.HandleFunc("POST /items/{id}", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "item %s", r.PathValue("id"))
	})
	mw, err := New(a.keeper)
	require.NoError(t, err)
	around := mw(mux)
	rec = httptest.NewRecorder()
	around.ServeHTTP(rec, request(http.MethodPost, "/items/1", "a", DefaultKeyHeader, "k2"))
	assert.Equal(t, "item 1", rec.Body.String())
	rec = httptest.NewRecorder()
	around.ServeHTTP(rec, request(http.MethodPost, "/items/2", "a", DefaultKeyHeader, "k2"))
	checkProblem(t, rec.Code, rec.Header(), rec.Body.Bytes(), http.StatusUnprocessableEntity, ProblemMismatch)
	rec = httptest.NewRecorder()
	around.ServeHTTP(rec, request(http.MethodPost, "/items/1", "a", DefaultKeyHeader, "k2"))
	assert.Equal(t, "item 1", rec.Body.String())
	assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
}

func testErrorRetention(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	env := newEnv(t)
	k := newKeeper(t, env, idem.WithErrorRetention(time.Minute))
	a := newApp(t, env, k, func(run int64, w http.ResponseWriter, r *http.Request) {
		status, _ := strconv.Atoi(r.URL.Query().Get("status"))
		w.WriteHeader(status)
	})
	ttl := func(status int) time.Duration {
		target := "/x?status=" + strconv.Itoa(status)
		rec := a.do(request(http.MethodPost, target, "", DefaultKeyHeader, "k1"))
		require.Equal(t, status, rec.Code)
		key := recordKey(t, env, "", "k1")
		d, err := env.Client.PTTL(context.Background(), key).Result()
		require.NoError(t, err)
		require.NoError(t, env.Client.Del(context.Background(), key).Err())
		return d
	}
	for _, status := range []int{400, 404, 422} {
		d := ttl(status)
		assert.True(t, d > 0 && d <= time.Minute, "%d kept for %s, the error retention", status, d)
	}
	for _, status := range []int{200, 201, 303} {
		d := ttl(status)
		assert.True(t, d > time.Minute && d <= idem.DefaultRetention, "%d kept for %s, the retention", status, d)
	}
}

func testOversized(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		n, _ := strconv.Atoi(r.URL.Query().Get("n"))
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Etag", `"v1"`)
		w.Header().Set("X-Kept", "yes")
		w.WriteHeader(http.StatusCreated)
		half := strings.Repeat("a", n/2)
		io.WriteString(w, half)
		w.Write([]byte(strings.Repeat("b", n-len(half))))
	}, WithResponseLimit(64))
	send := func(n int) *httptest.ResponseRecorder {
		return a.do(request(http.MethodPost, "/x?n="+strconv.Itoa(n), "", DefaultKeyHeader, "k"+strconv.Itoa(n)))
	}

	// At the limit: kept.
	first := send(64)
	assert.Len(t, first.Body.String(), 64)
	rec := send(64)
	assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
	assert.Equal(t, first.Body.String(), rec.Body.String())
	assert.Equal(t, `"v1"`, rec.Header().Get("Etag"))

	// Above it: the first client gets it all, the record is completed, and
	// replays say the body was not kept.
	first = send(65)
	assert.Equal(t, http.StatusCreated, first.Code)
	assert.Equal(t, strings.Repeat("a", 32)+strings.Repeat("b", 33), first.Body.String())
	assert.Equal(t, idem.ResultDone, a.lastEvent())
	for range 2 {
		rec = send(65)
		p := checkProblem(t, rec.Code, rec.Header(), rec.Body.Bytes(), http.StatusCreated, ProblemBodyNotKept)
		assert.Contains(t, p.Detail, "65 bytes")
		assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
		assert.Equal(t, "yes", rec.Header().Get("X-Kept"))
		assert.NotContains(t, rec.Header(), "Etag", "the validator of a body that is not sent")
	}
	assert.EqualValues(t, 2, a.runs.Load())
}

func testFlushed(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: 1\n\n")
		if r.URL.Query().Get("via") == "controller" {
			require.NoError(t, http.NewResponseController(w).Flush())
		} else {
			w.(http.Flusher).Flush()
		}
		io.WriteString(w, "data: 2\n\n")
	})
	for _, via := range []string{"controller", "flusher"} {
		send := func() *httptest.ResponseRecorder {
			return a.do(request(http.MethodPost, "/x?via="+via, "", DefaultKeyHeader, via))
		}
		first := send()
		assert.True(t, first.Flushed)
		assert.Equal(t, "data: 1\n\ndata: 2\n\n", first.Body.String())
		assert.Equal(t, idem.ResultDone, a.lastEvent(), "a streamed response is stored, not released")
		rec := send()
		p := checkProblem(t, rec.Code, rec.Header(), rec.Body.Bytes(), http.StatusOK, ProblemBodyNotKept)
		assert.Contains(t, p.Detail, "streamed")
		assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
	}
	assert.EqualValues(t, 2, a.runs.Load())
}

func testReadFrom(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	big := strings.Repeat("0123456789", 10_000)
	var rcErr atomic.Value
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		if err := rc.SetWriteDeadline(time.Now().Add(time.Minute)); err != nil {
			rcErr.Store(err)
		}
		if _, ok := w.(io.ReaderFrom); !ok {
			rcErr.Store(errors.New("not an io.ReaderFrom"))
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "head:")
		src := r.URL.Query().Get("src")
		if src == "big" {
			io.Copy(w, strings.NewReader(big))
		} else {
			io.Copy(w, strings.NewReader(src))
		}
	}, WithResponseLimit(1024))
	srv := httptest.NewServer(a.h)
	defer srv.Close()
	send := func(src string) result {
		res := send(srv.Client(), clientPost(t, srv.URL+"/x?src="+src, "k-"+src, ""))
		require.NoError(t, res.err)
		require.Equal(t, http.StatusCreated, res.status)
		return res
	}
	first := send("small")
	assert.Equal(t, "head:small", string(first.body))
	again := send("small")
	assert.Equal(t, "true", again.header.Get(ReplayedHeader))
	assert.Equal(t, "head:small", string(again.body))

	first = send("big")
	assert.Equal(t, "head:"+big, string(first.body))
	again = send("big")
	assert.Equal(t, "true", again.header.Get(ReplayedHeader))
	var p problem
	require.NoError(t, json.Unmarshal(again.body, &p))
	assert.Equal(t, ProblemBodyNotKept, p.Type)
	assert.Contains(t, p.Detail, strconv.Itoa(len("head:"+big))+" bytes")
	assert.Nil(t, rcErr.Load(), "http.ResponseController reaches the connection through Unwrap")
	assert.EqualValues(t, 2, a.runs.Load())
}

// mwQuietServer is an httptest.Server that does not log handler panics.
func quietServer(h http.Handler) *httptest.Server {
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.Start()
	return srv
}

func testPanic(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		if run <= 2 {
			w.Header().Set("X-Partial", "yes")
			panic(fmt.Sprintf("boom %d", run))
		}
		answer()(run, w, r)
	})
	// Direct: the panic goes on after the release.
	var got any
	func() {
		defer func() { got = recover() }()
		a.do(postKey("k1", "a"))
	}()
	assert.Equal(t, "boom 1", got)
	ev := a.await(t, idem.ResultReleased)
	assert.ErrorIs(t, ev.Err, errPanicked)

	// Through a server: net/http recovers it, the client sees the
	// connection end, and the retry runs the handler again.
	srv := quietServer(a.h)
	defer srv.Close()
	res := send(srv.Client(), clientPost(t, srv.URL+"/x", "k1", "a"))
	assert.Error(t, res.err)
	a.await(t, idem.ResultReleased)
	res = send(srv.Client(), clientPost(t, srv.URL+"/x", "k1", "a"))
	require.NoError(t, res.err)
	assert.Equal(t, http.StatusCreated, res.status)
	assert.Equal(t, "{\"run\":3}\n", string(res.body))
	claimed := a.await(t, idem.ResultClaimed)
	assert.Equal(t, 3, claimed.Attempt)
	assert.False(t, claimed.Recovered, "a released key is claimed afresh")
	assert.EqualValues(t, 3, a.runs.Load())
}

// mwDisconnect sends a request through srv and cuts it off once the handler
// has started.
func disconnect(t *testing.T, srv *httptest.Server, started <-chan struct{}) {
	ctx, cancel := context.WithCancel(context.Background())
	r := clientPost(t, srv.URL, "k1", "a").WithContext(ctx)
	done := make(chan result)
	go func() { done <- send(srv.Client(), r) }()
	<-started
	cancel()
	res := <-done
	require.ErrorIs(t, res.err, context.Canceled)
}

func testClientGoneReleases(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	started := make(chan struct{}, 1)
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		if run == 1 {
			started <- struct{}{}
			<-r.Context().Done() // gives up without answering
			return
		}
		answer()(run, w, r)
	})
	srv := httptest.NewServer(a.h)
	defer srv.Close()
	disconnect(t, srv, started)
	ev := a.await(t, idem.ResultReleased)
	assert.Equal(t, http.StatusOK, ev.Status)

	res := send(srv.Client(), clientPost(t, srv.URL, "k1", "a"))
	require.NoError(t, res.err)
	assert.Equal(t, http.StatusCreated, res.status)
	assert.Equal(t, "{\"run\":2}\n", string(res.body))
	assert.EqualValues(t, 2, a.runs.Load())
}

func testClientGoneStores(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	started := make(chan struct{}, 1)
	a := newApp(t, newEnv(t), nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-r.Context().Done()
		// The side effect happened anyway; the handler says so.
		answer()(run, w, r)
	})
	srv := httptest.NewServer(a.h)
	defer srv.Close()
	disconnect(t, srv, started)
	ev := a.await(t, idem.ResultDone)
	assert.Equal(t, http.StatusCreated, ev.Status)

	res := send(srv.Client(), clientPost(t, srv.URL, "k1", "a"))
	require.NoError(t, res.err)
	assert.Equal(t, http.StatusCreated, res.status)
	assert.Equal(t, "true", res.header.Get(ReplayedHeader))
	assert.Equal(t, "{\"run\":1}\n", string(res.body))
	assert.EqualValues(t, 1, a.runs.Load())
}

// dropRenewals makes every lease renewal (extend.lua) of a Keeper on env
// succeed without reaching Redis, as a process paused past its lease would
// leave its lease unrenewed: the call is answered 1, extend.lua's "renewed",
// and never sent.
func dropRenewals(env *redistest.Backend) {
	env.Client.AddHook(redistest.ScriptHook{On: func(ctx context.Context, name string, cmd redis.Cmder, send func() error) error {
		c, ok := cmd.(*redis.Cmd)
		if name != "extend" || !ok {
			return send()
		}
		c.SetVal(int64(1))
		return nil
	}})
}

func testLeaseLost(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	env := newEnv(t)
	dropRenewals(env)
	const lease = 300 * time.Millisecond
	// A busy machine that pauses the first request between its claim and
	// its handler must not make the claim look lost before the handler runs.
	clock, advance := redisPacedClock(env)
	k := tapped(t, func(observe idem.Option) (*idem.Keeper, error) {
		return idem.NewRedis(env.Client, idem.WithLease(lease), clock, observe)
	})

	type seen struct {
		token     int64
		attempt   int
		recovered bool
		cause     error
	}
	seenBy := make(chan seen, 2)
	running := make(chan struct{})
	a := newApp(t, env, k, func(run int64, w http.ResponseWriter, r *http.Request) {
		c, ok := idem.ClaimFromContext(r.Context())
		require.True(t, ok)
		s := seen{token: c.Token(), attempt: c.Attempt(), recovered: c.Recovered()}
		if run == 1 {
			close(running)
			select { // bounded, so that a first request that never ran fails the test instead of hanging it
			case <-r.Context().Done():
				s.cause = context.Cause(r.Context())
			case <-time.After(10 * time.Second):
				assert.Fail(t, "the first holder's context was never cancelled")
			}
		}
		seenBy <- s
		fmt.Fprintf(w, "run %d", run)
	})

	firstDone := make(chan *httptest.ResponseRecorder, 1)
	go func() { firstDone <- a.do(postKey("k1", "a")) }()
	a.await(t, idem.ResultClaimed)
	// The lease runs out only once the handler runs: a claim whose lease
	// has run out when its work would start does not start it.
	select {
	case <-running:
	case rec := <-firstDone:
		require.Failf(t, "the first request ended before its handler ran", "%d %s", rec.Code, rec.Body)
	case <-time.After(10 * time.Second):
		require.Fail(t, "the first request's handler never ran")
	}
	advance(lease + 100*time.Millisecond) // the first holder's lease runs out unrenewed

	// The first holder's next renewal finds its lease run out by its own
	// clock: its handler's context ends then, whatever Redis would say.
	s1 := <-seenBy
	assert.ErrorIs(t, s1.cause, idem.ErrLeaseLost, "the handler's context says why it ended")
	assert.Equal(t, 1, s1.attempt)
	first := <-firstDone
	assert.Equal(t, "run 1", first.Body.String(), "the first client got its own answer")
	ev := a.await(t, idem.ResultLeaseLost)
	assert.ErrorIs(t, ev.Err, idem.ErrLeaseLost)

	second := a.do(postKey("k1", "a"))
	assert.Equal(t, "run 2", second.Body.String())
	s2 := <-seenBy
	assert.True(t, s2.recovered, "the takeover is marked recovered")
	assert.Equal(t, 2, s2.attempt)
	assert.Equal(t, idem.ResultDone, a.await(t, idem.ResultDone).Result)
	assert.Greater(t, s2.token, s1.token, "fencing tokens increase")

	rec := a.do(postKey("k1", "a"))
	assert.Equal(t, "run 2", rec.Body.String(), "the stale holder overwrote nothing")
	assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
}

func testStoreLostAfterHandler(t *testing.T, newEnv func(testing.TB) *redistest.Backend) {
	env := newEnv(t)
	a := newApp(t, env, nil, func(run int64, w http.ResponseWriter, r *http.Request) {
		env.Stop()
		answer()(run, w, r)
	})
	rec := a.do(postKey("k1", "a"))
	assert.Equal(t, http.StatusCreated, rec.Code, "the client gets the handler's answer")
	ev := a.await(t, idem.ResultUnavailable)
	assert.Equal(t, http.StatusCreated, ev.Status)
	assert.ErrorIs(t, ev.Err, idem.ErrUnavailable)
}

func TestMiddlewareRefusesMisuse(t *testing.T) {
	k, err := idem.NewRedis(redistest.Miniredis(t).Client)
	require.NoError(t, err)
	_, err = New(nil)
	assert.ErrorIs(t, err, idem.ErrInvalidConfig)
	for name, opt := range map[string]Option{
		"no methods":          WithMethods(),
		"bad method":          WithMethods("PO ST"),
		"bad header":          WithKeyHeader("Idempotency Key"),
		"empty header":        WithKeyHeader(""),
		"nil scope":           WithScope(nil),
		"nil fingerprint":     WithFingerprint(nil),
		"nil policy":          WithStorePolicy(nil),
		"zero body limit":     WithBodyLimit(0),
		"zero response limit": WithResponseLimit(0),
		"negative wait":       WithWait(-time.Second),
	} {
		_, err := New(k, opt)
		assert.ErrorIs(t, err, idem.ErrInvalidConfig, name)
	}
	_, err = New(k, WithMethods("PUT", "DELETE"), WithKeyHeader("X-Key"), WithWait(time.Second))
	assert.NoError(t, err)
}

func TestDefaultStorePolicy(t *testing.T) {
	stored := map[int]bool{
		100: false, 101: false, 200: true, 201: true, 204: true, 301: true, 304: true,
		400: true, 401: false, 402: true, 403: false, 404: true, 405: true, 407: false,
		408: false, 409: false, 410: true, 422: true,
		425: false, 429: false, 499: true, 500: false, 502: false, 503: false,
	}
	for status, want := range stored {
		assert.Equal(t, want, DefaultStorePolicy(status), "%d", status)
	}
}

func TestRequestFingerprintsAreDistinct(t *testing.T) {
	seen := map[string]string{}
	for _, s := range [][3]string{
		{"POST", "/x", ""}, {"PATCH", "/x", ""}, {"POST", "/y", ""}, {"POST", "/x", "a"},
		{"POST", "/x/a", ""}, {"POS", "/T/x", ""}, {"POST", "/T/x", ""}, {"POST", "/x%2Fa", ""}, {"POST", "/x/", ""},
	} {
		r := httptest.NewRequest(s[0], s[1], nil)
		var digest []byte
		if s[2] != "" {
			digest = []byte(s[2])
		}
		fp := string(requestFingerprint(r, digest))
		prev, dup := seen[fp]
		assert.False(t, dup, "%q and %q share a fingerprint", s, prev)
		seen[fp] = fmt.Sprint(s)
	}
	// The path is the one the client sent, not one a router rewrote.
	a := httptest.NewRequest("POST", "/v1/x?q=1", nil)
	b := httptest.NewRequest("POST", "/v1/x?q=2", nil)
	b.URL.Path = "/x"
	assert.Equal(t, requestFingerprint(a, nil), requestFingerprint(b, nil))
}

// discard is a ResponseWriter that throws the response away.
type discard struct{ h http.Header }

func (d *discard) Header() http.Header         { return d.h }
func (d *discard) Write(p []byte) (int, error) { return len(p), nil }
func (d *discard) WriteHeader(int)             {}

// memoReplies is a go-redis hook for benchmarks of the middleware's own
// cost: until freeze is called it sends every command and keeps the last
// reply Redis gave each of idem's scripts (by name, see redistest.ScriptHook); after,
// it answers every call of a script it kept a reply of with that reply,
// without sending it, and counts the commands that still reached Redis
// (none should: memoKeeper fails the benchmark otherwise).
type memoReplies struct {
	mu     sync.Mutex
	last   map[string]any // before freeze
	frozen atomic.Pointer[map[string]any]
	sent   atomic.Int64 // commands sent after freeze
}

// freeze makes m answer from the replies it kept.
func (m *memoReplies) freeze() {
	m.mu.Lock()
	defer m.mu.Unlock()
	kept := maps.Clone(m.last)
	m.frozen.Store(&kept)
}

// DialHook implements redis.Hook.
func (m *memoReplies) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (m *memoReplies) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		name := scriptname.Of(cmd.Args())
		c, _ := cmd.(*redis.Cmd)
		if kept := m.frozen.Load(); kept != nil {
			if v, ok := (*kept)[name]; ok && c != nil {
				c.SetVal(v)
				return nil
			}
			m.sent.Add(1)
			return next(ctx, cmd)
		}
		err := next(ctx, cmd)
		if name != "" && c != nil && err == nil {
			m.mu.Lock()
			m.last[name] = c.Val()
			m.mu.Unlock()
		}
		return err
	}
}

// ProcessPipelineHook implements redis.Hook: pipelines are sent, and
// counted once frozen.
func (m *memoReplies) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if m.frozen.Load() != nil {
			m.sent.Add(1)
		}
		return next(ctx, cmds)
	}
}

// memoKeeper returns a Keeper on a miniredis, through a client with no hook
// but a memoReplies, and its freeze: once a benchmark has served its request
// as its loop will (claimed and completed, or replayed), freeze makes every
// later call answered from memory as Redis answered the last one, so that
// the loop measures the middleware, the Keeper and its RedisStore (the
// script calls' arguments, reading their replies) with no network. The
// benchmark fails if a command reaches Redis after freeze.
func memoKeeper(b *testing.B) (*idem.Keeper, func()) {
	c := redistest.NewClient(b, miniredis.RunT(b).Addr())
	m := &memoReplies{last: map[string]any{}}
	c.AddHook(m)
	b.Cleanup(func() {
		if n := m.sent.Load(); n > 0 {
			b.Errorf("%d commands reached Redis while the replies were answered from memory", n)
		}
	})
	k, err := idem.NewRedis(c)
	require.NoError(b, err)
	return k, m.freeze
}

// benchBody is a request body that a benchmark rewinds between requests
// without allocating.
type benchBody struct{ bytes.Reader }

func (*benchBody) Close() error { return nil }

// bench runs one request through a middleware on k, b.N times, and counts
// only what the middleware (and the Keeper and store under it) spends: the
// request, its header and its body reader are made once and rewound per
// iteration (the body reset, r.Body set back to it, since the middleware
// replaces it), and the writer's header map is cleared, not made anew.
// Before the timing starts the request is served as the loop expects it to
// be answered (once, or twice for a replay: the first stores the
// response), and then warmed is called, when set.
func bench(b *testing.B, k *idem.Keeper, wantReplay bool, warmed func()) {
	mw, err := New(k)
	require.NoError(b, err)
	payload := bytes.Repeat([]byte("x"), 512)
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write(payload)
	}))
	body := []byte(`{"amount":1000,"currency":"EUR"}`)
	r := postKey("bench", string(body))
	rb := &benchBody{}
	w := &discard{h: http.Header{}}
	serve := func() {
		rb.Reset(body)
		r.Body = rb
		clear(w.h)
		h.ServeHTTP(w, r)
	}
	serve()
	if wantReplay {
		serve()
	}
	if warmed != nil {
		warmed()
	}
	b.ReportAllocs()
	for b.Loop() {
		serve()
		// testify only on failure: it calls b.Helper, which the timer would count.
		if (w.h.Get(ReplayedHeader) == "true") != wantReplay {
			require.Equal(b, wantReplay, w.h.Get(ReplayedHeader) == "true", "unexpected replay header")
		}
	}
}

// BenchmarkMiddlewareFirstRequest measures the middleware's own cost on a
// first request (fingerprint, claim, capture, keep-alive, encoding the
// response), with the Keeper and RedisStore under it, on a Redis answered
// from memory (memoKeeper): every claim is answered "claimed" and every
// completion "stored".
func BenchmarkMiddlewareFirstRequest(b *testing.B) {
	k, freeze := memoKeeper(b)
	bench(b, k, false, freeze)
}

// BenchmarkMiddlewareReplayOverhead measures the middleware's own cost on a
// replay, with the Keeper and RedisStore under it, on a Redis answered from
// memory (memoKeeper): every claim is answered with the stored response.
func BenchmarkMiddlewareReplayOverhead(b *testing.B) {
	k, freeze := memoKeeper(b)
	bench(b, k, true, freeze)
}

// BenchmarkStoredResponseDecode measures reading a stored response as a
// replay does: decoding it and setting its headers in the (cleared) header
// map of the writer.
func BenchmarkStoredResponseDecode(b *testing.B) {
	s := &storedResponse{Status: 201, Header: http.Header{
		"Content-Type": {"application/json"}, "Location": {"/payments/1"}, "X-Request-Id": {"abc"},
	}, Body: bytes.Repeat([]byte("x"), 512), Size: 512}
	for _, format := range []struct {
		name    string
		payload []byte
	}{{"format2", encodeResponse(*s)}} {
		b.Run(format.name, func(b *testing.B) {
			h := http.Header{}
			b.ReportAllocs()
			for b.Loop() {
				clear(h)
				out, err := decodeResponse(format.payload)
				if err != nil {
					require.NoError(b, err) // only on failure, as in bench
				}
				out.copyHeader(h, 0)
			}
		})
	}
}

// recordKey is the Redis key of the record of (scope, key) on env, with the
// default prefix: Record.Key, as a Keeper on env inspects it.
func recordKey(t testing.TB, env *redistest.Backend, scope, key string) string {
	k, err := idem.NewRedis(env.Client)
	require.NoError(t, err)
	r, err := k.Inspect(context.Background(), scope, key)
	require.NoError(t, err)
	return r.Key
}
