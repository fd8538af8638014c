package idemhttp

// Clients that go away: while their body is being sent, while the handler
// runs, while the response is being sent; handlers that outlive their
// client by several leases; clients that leave while the store fails or
// while they wait for an attempt in progress. Every test runs on a
// redis-server and on miniredis, through httptest.Server, and asserts how
// often the handler ran and which events the hook saw. The helpers are
// prefixed cg, apart from the suite's.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// cgServer is a handler behind the middleware on an httptest.Server, with
// the middleware's events and the handler's runs. A request with an
// X-Cg-Id header registered by watchBody signals when the middleware starts
// reading its body.
type cgServer struct {
	*httptest.Server
	events  tap
	runs    atomic.Int64
	reading sync.Map // X-Cg-Id -> chan struct{}
}

// newCGServer guards handler with opts (and a hook that records events) on
// k, and serves it on a loopback httptest.Server that does not log.
func newCGServer(t *testing.T, k *idem.Keeper, handler http.HandlerFunc, opts ...Option) *cgServer {
	t.Helper()
	s := &cgServer{events: tapOf(t, k)}
	mw, err := New(k, opts...)
	require.NoError(t, err)
	guarded := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.runs.Add(1)
		handler(w, r)
	}))
	s.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if ch, ok := s.reading.Load(r.Header.Get("X-Cg-Id")); ok {
			r.Body = &cgSignalBody{ReadCloser: r.Body, first: ch.(chan struct{})}
		}
		guarded.ServeHTTP(w, r)
	}))
	s.Config.ErrorLog = log.New(io.Discard, "", 0)
	s.Start()
	t.Cleanup(s.Close)
	return s
}

// watchBody registers id and returns the channel closed once the middleware
// has read the first bytes of that request's body.
func (s *cgServer) watchBody(id string) <-chan struct{} {
	ch := make(chan struct{})
	s.reading.Store(id, ch)
	return ch
}

// next returns the next event whose kind is one of kinds, skipping the
// others; it fails the test after ten seconds.
func (s *cgServer) next(t *testing.T, kinds ...idem.Result) idem.Event {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev := <-s.events:
			for _, k := range kinds {
				if ev.Result == k {
					return ev
				}
			}
		case <-timeout:
			require.Failf(t, "timed out", "no event among %v", kinds)
		}
	}
}

// drain returns the kinds of the events seen so far and not read.
func (s *cgServer) drain() []idem.Result {
	var kinds []idem.Result
	for {
		select {
		case ev := <-s.events:
			kinds = append(kinds, ev.Result)
		default:
			return kinds
		}
	}
}

// cgSignalBody closes first once the first bytes were read from it.
type cgSignalBody struct {
	io.ReadCloser
	once  sync.Once
	first chan struct{}
}

func (b *cgSignalBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.once.Do(func() { close(b.first) })
	}
	return n, err
}

// cgAnswer is a response read by a client.
type cgAnswer struct {
	status int
	header http.Header
	body   []byte
	err    error
}

// cgPost sends a POST of body with key to srv and reads the whole answer.
func cgPost(ctx context.Context, srv *cgServer, key, body string) cgAnswer {
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/pay", strings.NewReader(body))
	if err != nil {
		return cgAnswer{err: err}
	}
	r.Header.Set(DefaultKeyHeader, key)
	resp, err := srv.Client().Do(r)
	if err != nil {
		return cgAnswer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return cgAnswer{status: resp.StatusCode, header: resp.Header, body: b, err: err}
}

// cgProblemType returns the type of a problem+json body, or "".
func cgProblemType(body []byte) string {
	var p problem
	if json.Unmarshal(body, &p) != nil {
		return ""
	}
	return p.Type
}

// cgOn is what a test does with each call of one of idem's scripts on its
// way to Redis, by the script's name (see redistest.ScriptHook): send it,
// or fail it unsent.
type cgOn func(ctx context.Context, name string, cmd redis.Cmder, send func() error) error

// cgSend sends every call as it came.
func cgSend(_ context.Context, _ string, _ redis.Cmder, send func() error) error { return send() }

// cgKeeper is a Keeper on b with the given lease, and the count of its
// renewals that succeeded; every call of one of its scripts goes through
// on, when set, on its way to Redis (b's client).
func cgKeeper(t *testing.T, b *redistest.Backend, lease time.Duration, on cgOn, opts ...idem.Option) (*idem.Keeper, *cgCounts) {
	t.Helper()
	counts := &cgCounts{}
	b.Client.AddHook(redistest.ScriptHook{On: counts.count})
	if on != nil {
		b.Client.AddHook(redistest.ScriptHook{On: on})
	}
	k := tapped(t, func(observe idem.Option) (*idem.Keeper, error) {
		return idem.NewRedis(b.Client, append([]idem.Option{idem.WithLease(lease), idem.WithRetention(time.Minute), observe}, opts...)...)
	})
	return k, counts
}

// cgCounts counts the renewals (extend.lua) that succeeded: those Redis
// answered 1, "renewed".
type cgCounts struct {
	extends atomic.Int64
}

// count is a ScriptHook's On: it sends every call and counts the renewals
// that succeeded.
func (c *cgCounts) count(ctx context.Context, name string, cmd redis.Cmder, send func() error) error {
	err := send()
	if c2, ok := cmd.(*redis.Cmd); ok && name == "extend" && err == nil && c2.Val() == int64(1) {
		c.extends.Add(1)
	}
	return err
}

// cgBody is a request body large enough that the client's transport sends
// its first part before the rest is written.
var cgBody = strings.Repeat("0123456789abcdef", 8<<10) // 128 KiB

// cgMidBody sends a POST with key whose body the client starts to send and
// then abandons: it cancels the request once the middleware has read the
// first bytes. It returns the client's error.
func cgMidBody(t *testing.T, srv *cgServer, key, id string) error {
	reading := srv.watchBody(id)
	pr, pw := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/pay", pr)
	if err != nil {
		return err
	}
	r.Header.Set(DefaultKeyHeader, key)
	r.Header.Set("X-Cg-Id", id)
	done := make(chan error, 1)
	go func() {
		resp, err := srv.Client().Do(r)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	go pw.Write([]byte(cgBody[:len(cgBody)/2])) // the rest never comes
	select {
	case <-reading:
	case <-time.After(10 * time.Second):
		assert.Fail(t, "the middleware never read the body")
	}
	cancel()
	pw.CloseWithError(context.Canceled)
	return <-done
}

// TestClientGoneMidRequest: the client goes away while its body is being
// sent. The handler does not run, the key is not claimed, and the client's
// retry runs the handler once, as the first attempt.
func TestClientGoneMidRequest(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, _ := cgKeeper(t, b, time.Minute, nil)
		srv := newCGServer(t, k, func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "charged")
		})
		err := cgMidBody(t, srv, "k1", "mid-body")
		require.ErrorIs(t, err, context.Canceled)
		ev := srv.next(t, idem.ResultCanceled, idem.ResultInvalid, idem.ResultClaimed)
		assert.NotEqual(t, idem.ResultClaimed, ev.Result, "a request whose body never arrived claimed its key")
		assert.Zero(t, srv.runs.Load(), "the handler ran for a body that never arrived")

		res := cgPost(context.Background(), srv, "k1", cgBody)
		require.NoError(t, res.err)
		assert.Equal(t, http.StatusCreated, res.status, "the retry: %s", res.body)
		assert.Empty(t, res.header.Get(ReplayedHeader))
		claimed := srv.next(t, idem.ResultClaimed)
		assert.Equal(t, 1, claimed.Attempt, "the abandoned request never claimed the key")
		srv.next(t, idem.ResultDone)
		assert.EqualValues(t, 1, srv.runs.Load())
	})
}

// TestClientGoneMidRequestIsCanceled reproduces a bug: a client that goes
// away while its body is being sent is answered 400 body-unreadable and
// reported as idem.ResultInvalid ("unexpected EOF"), although its request context
// has ended; the README's table says a client gone before its key was
// checked gets 499 and idem.ResultCanceled. Nothing runs either way; the event
// miscounts a client that left as a client error.
func TestClientGoneMidRequestIsCanceled(t *testing.T) {
	k, _ := cgKeeper(t, redistest.Miniredis(t), time.Minute, nil)
	srv := newCGServer(t, k, func(w http.ResponseWriter, r *http.Request) {})
	require.ErrorIs(t, cgMidBody(t, srv, "k1", "mid-body"), context.Canceled)
	ev := srv.next(t, idem.ResultCanceled, idem.ResultInvalid)
	assert.Equal(t, idem.ResultCanceled, ev.Result, "event for a client gone mid-body: %v", ev.Err)
	assert.Equal(t, StatusClientClosedRequest, ev.Status)
}

// TestClientGoneMidResponse: the handler writes part of its response and
// flushes it, the client reads it and goes away, and the handler finishes.
// A success is stored (its side effect happened; its body was streamed, so
// replays say it was not kept); a handler that panics after the client left
// releases the key, and the retry runs it again as a fresh attempt.
func TestClientGoneMidResponse(t *testing.T) {
	for _, tc := range []struct {
		name   string
		finish func(w http.ResponseWriter) // after the client left
		stored bool
	}{
		{name: "success streamed, then finished", stored: true, finish: func(w http.ResponseWriter) {
			io.WriteString(w, "part 2\n")
		}},
		{name: "success streamed, then written past the response limit", stored: true, finish: func(w http.ResponseWriter) {
			for i := 0; i < 64; i++ {
				if _, err := w.Write(bytes.Repeat([]byte("x"), 1024)); err != nil {
					return
				}
			}
		}},
		{name: "panic after the client left", finish: func(w http.ResponseWriter) {
			panic("the handler fails after its client left")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				k, _ := cgKeeper(t, b, time.Minute, nil)
				flushed := make(chan struct{}, 2)
				srv := newCGServer(t, k, func(w http.ResponseWriter, r *http.Request) {
					w.Header().Set("Content-Type", "text/plain")
					w.WriteHeader(http.StatusCreated)
					io.WriteString(w, "part 1\n")
					w.(http.Flusher).Flush()
					flushed <- struct{}{}
					if r.Header.Get("X-Retry") != "" {
						return
					}
					<-r.Context().Done() // the client went away mid-response
					tc.finish(w)
				}, WithResponseLimit(1024))

				ctx, cancel := context.WithCancel(context.Background())
				r, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/pay", strings.NewReader("a"))
				require.NoError(t, err)
				r.Header.Set(DefaultKeyHeader, "k1")
				resp, err := srv.Client().Do(r)
				require.NoError(t, err)
				first := make([]byte, len("part 1\n"))
				_, err = io.ReadFull(resp.Body, first)
				require.NoError(t, err)
				assert.Equal(t, "part 1\n", string(first))
				cancel()
				resp.Body.Close()

				claimed := srv.next(t, idem.ResultClaimed)
				settled := srv.next(t, idem.ResultDone, idem.ResultReleased, idem.ResultLeaseLost, idem.ResultUnavailable)
				retry, err := http.NewRequest(http.MethodPost, srv.URL+"/pay", strings.NewReader("a"))
				require.NoError(t, err)
				retry.Header.Set(DefaultKeyHeader, "k1")
				retry.Header.Set("X-Retry", "1")
				res := cgDo(srv, retry)
				require.NoError(t, res.err)
				assert.Equal(t, http.StatusCreated, res.status)
				if tc.stored {
					assert.Equal(t, idem.ResultDone, settled.Result, "a success whose client left mid-response: %v", settled.Err)
					assert.Equal(t, http.StatusCreated, settled.Status)
					assert.Equal(t, "true", res.header.Get(ReplayedHeader))
					assert.Equal(t, ProblemBodyNotKept, cgProblemType(res.body), "the replay of a streamed body: %s", res.body)
					assert.EqualValues(t, 1, srv.runs.Load())
					return
				}
				assert.Equal(t, idem.ResultReleased, settled.Result, "a handler that panicked: %v", settled.Err)
				assert.Empty(t, res.header.Get(ReplayedHeader))
				again := srv.next(t, idem.ResultClaimed)
				assert.Equal(t, claimed.Attempt+1, again.Attempt)
				assert.False(t, again.Recovered, "a released key is claimed afresh")
				assert.Greater(t, again.Token, claimed.Token)
				assert.EqualValues(t, 2, srv.runs.Load())
			})
		})
	}
}

// cgDo sends r through srv's client and reads the whole answer.
func cgDo(srv *cgServer, r *http.Request) cgAnswer {
	resp, err := srv.Client().Do(r)
	if err != nil {
		return cgAnswer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return cgAnswer{status: resp.StatusCode, header: resp.Header, body: b, err: err}
}

// TestHandlerOutlivesClient: the client goes away once the handler started;
// the handler goes on for four leases, then answers. Every retry meanwhile
// gets 409 (the lease is renewed whatever became of the client), then the
// stored response; the handler ran once, and its lease was never lost.
//
// The lease passes in steps of half a lease, each followed by a renewal:
// on miniredis the clock is moved and the test waits for the next renewal;
// on redis-server the step is slept (a lease of a second, renewed every
// third of it).
func TestHandlerOutlivesClient(t *testing.T) {
	redistest.Long(t)
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		lease := 300 * time.Millisecond // renewals come in real time; miniredis's clock is moved
		var opts []idem.Option
		advance := b.Advance
		if b.Real {
			lease = time.Second
		} else {
			// A busy machine that pauses a goroutine must not make a lease
			// look lost; renewals still come every third of a lease of real
			// time.
			var clock idem.Option
			clock, advance = redisPacedClock(b)
			opts = append(opts, clock)
		}
		k, counts := cgKeeper(t, b, lease, nil, opts...)
		started, resume := make(chan struct{}), make(chan struct{})
		var run atomic.Int32
		srv := newCGServer(t, k, func(w http.ResponseWriter, r *http.Request) {
			if run.Add(1) > 1 { // a second run, beside the first: the test fails
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, "charged again")
				return
			}
			close(started)
			<-r.Context().Done() // the client left...
			<-resume             // ...and the payment goes on
			c, ok := idem.ClaimFromContext(r.Context())
			assert.True(t, ok)
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "charged by token %d", c.Token())
		})
		var resumeOnce sync.Once
		letGo := func() { resumeOnce.Do(func() { close(resume) }) }
		t.Cleanup(letGo) // before the server closes, should the test stop early
		ctx, cancel := context.WithCancel(context.Background())
		gone := make(chan cgAnswer, 1)
		go func() { gone <- cgPost(ctx, srv, "k1", "a") }()
		select {
		case <-started:
		case a := <-gone:
			require.FailNow(t, "the first request ended before its handler ran", "%d %s %v", a.status, a.body, a.err)
		case <-time.After(10 * time.Second):
			require.FailNow(t, "the handler never started")
		}
		cancel()
		require.ErrorIs(t, (<-gone).err, context.Canceled)
		claimed := srv.next(t, idem.ResultClaimed)

		for step := 0; step < 8; step++ { // four leases
			advance(lease / 2)
			// Two renewals: the second began after the first ended, so
			// after the clock moved, and renewed from the moved clock.
			before := counts.extends.Load()
			require.Eventually(t, func() bool { return counts.extends.Load() >= before+2 }, 10*time.Second, time.Millisecond,
				"no renewal after step %d", step)
			res := cgPost(context.Background(), srv, "k1", "a")
			require.NoError(t, res.err)
			require.Equal(t, http.StatusConflict, res.status, "step %d: a retry while the handler runs: %s", step, res.body)
			assert.Equal(t, ProblemInProgress, cgProblemType(res.body))
		}
		letGo()
		stored := srv.next(t, idem.ResultDone, idem.ResultLeaseLost, idem.ResultReleased, idem.ResultUnavailable)
		assert.Equal(t, idem.ResultDone, stored.Result, "the handler's response after its client left: %v", stored.Err)
		assert.Equal(t, claimed.Token, stored.Token)
		res := cgPost(context.Background(), srv, "k1", "a")
		require.NoError(t, res.err)
		assert.Equal(t, http.StatusCreated, res.status)
		assert.Equal(t, "true", res.header.Get(ReplayedHeader))
		assert.Equal(t, fmt.Sprintf("charged by token %d", claimed.Token), string(res.body))
		assert.EqualValues(t, 1, srv.runs.Load())
		assert.NotContains(t, srv.drain(), idem.ResultLeaseLost)
	})
}

// cgGone ends the context of a request marked with cgLeaveKey at its first
// claim (claim.lua), then goes on with next: as the claim is sent (before),
// answering a reset connection instead, unsent (fail), or once Redis
// answered it (after). A claim answered NOSCRIPT, which the store sends
// again by EVAL at once, is not yet answered.
func cgGone(next cgOn) cgOn {
	return func(ctx context.Context, name string, cmd redis.Cmder, send func() error) error {
		l, _ := ctx.Value(cgLeaveKey{}).(*cgLeave)
		if l == nil || name != "claim" || !l.fired.CompareAndSwap(false, true) {
			return next(ctx, name, cmd, send)
		}
		switch l.how {
		case "fail":
			l.cancel()
			return errors.New("read tcp 127.0.0.1: connection reset by peer")
		case "before":
			l.cancel()
		case "after":
			err := next(ctx, name, cmd, send)
			if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
				l.fired.Store(false) // the EVAL that follows is the first claim
			} else {
				l.cancel()
			}
			return err
		}
		return next(ctx, name, cmd, send)
	}
}

type cgLeaveKey struct{}

type cgLeave struct {
	how    string // "fail", "before" or "after"
	cancel context.CancelFunc
	fired  atomic.Bool
}

// cgLeaving returns a context that ends as l says, at the request's first
// claim.
func cgLeaving(how string) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	return context.WithValue(ctx, cgLeaveKey{}, &cgLeave{how: how, cancel: cancel})
}

// TestClientGoneWhileStoreFails: with WithFailOpen, a store that fails while
// its client is still there runs the handler unguarded (idem.ResultFailOpen); the
// same failure once the client went away answers 499 (idem.ResultCanceled), and
// the handler does not run: a retry would run it again.
func TestClientGoneWhileStoreFails(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var failing atomic.Bool
		k, _ := cgKeeper(t, b, time.Minute, cgGone(cgFail(&failing, cgSend)))
		srv := newCGServer(t, k, func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
		}, WithFailOpen(true))
		h := srv.Config.Handler

		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, cgRequest("k1").WithContext(cgLeaving("fail")))
		assert.Equal(t, StatusClientClosedRequest, rec.Code)
		ev := srv.next(t, idem.ResultCanceled, idem.ResultFailOpen, idem.ResultUnavailable, idem.ResultClaimed)
		assert.Equal(t, idem.ResultCanceled, ev.Result)
		assert.True(t, errors.Is(ev.Err, context.Canceled) && !errors.Is(ev.Err, idem.ErrUnavailable), "the event's error: %v", ev.Err)
		assert.Zero(t, srv.runs.Load(), "fail-open ran the handler for a client that had left")

		failing.Store(true) // the store fails, the client is there
		rec = httptest.NewRecorder()
		h.ServeHTTP(rec, cgRequest("k1"))
		assert.Equal(t, http.StatusCreated, rec.Code)
		assert.Equal(t, idem.ResultFailOpen, srv.next(t, idem.ResultCanceled, idem.ResultFailOpen, idem.ResultUnavailable, idem.ResultClaimed).Result)
		assert.EqualValues(t, 1, srv.runs.Load())

		rec = httptest.NewRecorder()
		h.ServeHTTP(rec, cgRequest("k1").WithContext(cgLeaving("before"))) // the client leaves as the failing store is asked
		assert.Equal(t, StatusClientClosedRequest, rec.Code, "failing store, client gone")
		assert.Equal(t, idem.ResultCanceled, srv.next(t, idem.ResultCanceled, idem.ResultFailOpen, idem.ResultUnavailable, idem.ResultClaimed).Result)
		assert.EqualValues(t, 1, srv.runs.Load())
	})
}

// cgFail fails every claim (claim.lua), unsent, as an unreachable Redis
// would, while failing is set, and goes on with next otherwise.
func cgFail(failing *atomic.Bool, next cgOn) cgOn {
	return func(ctx context.Context, name string, cmd redis.Cmder, send func() error) error {
		if name == "claim" && failing.Load() {
			return errors.New("dial tcp 127.0.0.1:6379: connect: connection refused")
		}
		return next(ctx, name, cmd, send)
	}
}

func cgRequest(key string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader("a"))
	r.Header.Set(DefaultKeyHeader, key)
	return r
}

// TestClientGoneWhileWaiting: with WithWait, a request that finds the key in
// progress waits; its client goes away while it waits. It is answered 499
// (idem.ResultCanceled), not 409, and runs nothing; the first request's response
// is stored and replayed, and the handler ran once.
func TestClientGoneWhileWaiting(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, _ := cgKeeper(t, b, time.Minute, cgGone(cgSend))
		started, resume := make(chan struct{}), make(chan struct{})
		var once sync.Once
		srv := newCGServer(t, k, func(w http.ResponseWriter, r *http.Request) {
			once.Do(func() { close(started) })
			<-resume
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "charged")
		}, WithWait(time.Hour))
		var resumeOnce sync.Once
		letGo := func() { resumeOnce.Do(func() { close(resume) }) }
		t.Cleanup(letGo) // before the server closes, should the test stop early
		h := srv.Config.Handler
		first := make(chan *httptest.ResponseRecorder, 1)
		go func() {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, cgRequest("k1"))
			first <- rec
		}()
		<-started
		srv.next(t, idem.ResultClaimed)

		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, cgRequest("k1").WithContext(cgLeaving("after"))) // told "in progress", it waits, and its client leaves
		assert.Equal(t, StatusClientClosedRequest, rec.Code, "%s", rec.Body)
		ev := srv.next(t, idem.ResultCanceled, idem.ResultInProgress, idem.ResultUnavailable, idem.ResultClaimed)
		assert.Equal(t, idem.ResultCanceled, ev.Result)

		letGo()
		assert.Equal(t, http.StatusCreated, (<-first).Code)
		srv.next(t, idem.ResultDone)
		rec = httptest.NewRecorder()
		h.ServeHTTP(rec, cgRequest("k1"))
		assert.Equal(t, "charged", rec.Body.String())
		assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
		assert.EqualValues(t, 1, srv.runs.Load())
	})
}

// cgSplitRenewals is a go-redis hook that sends the renewals (extend.lua)
// through renew and every other call where it was going: the handlers'
// process renews on time while the requests' own calls meet the faults.
func cgSplitRenewals(renew *redis.Client) redistest.ScriptHook {
	return redistest.ScriptHook{On: func(ctx context.Context, name string, cmd redis.Cmder, send func() error) error {
		if name != "extend" {
			return send()
		}
		return renew.Process(ctx, cmd)
	}}
}

// TestClientGoneStorm: clients send requests on a few keys through the
// middleware, whose Redis calls go through a fault proxy that drops replies
// and cuts connections, and go away at random points: while the body is
// being sent, while the handler runs, while the response is being read, at a
// random moment, or not at all. Handlers answer at once, give up when their
// client leaves, fail with 500, stream their response, or outlive their
// client by a lease and a half. Renewals go around the faults.
//
//   - No handler of a key starts while another of the key runs, nor after a
//     response of the key was stored; a re-run is a takeover (Recovered) or
//     follows a run whose key was released.
//   - Every event is one the scenario allows: never fail-open, never a
//     mismatch, never a lost lease while a success is stored (only a
//     Release that go-redis sent again after the key was claimed anew may
//     answer ErrLeaseLost).
//   - Every answer a client read is 201 (its own run's, or the stored one
//     replayed), 409, 500 (the handler's own failure) or 503.
//   - Once the faults stop and the leases have run out, every key answers
//     201.
func TestClientGoneStorm(t *testing.T) {
	redistest.Long(t)
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		p, err := faultproxy.New(b.Client.Options().Addr, 7)
		require.NoError(t, err)
		t.Cleanup(func() { p.Close() })
		faulty := redis.NewClient(&redis.Options{
			Addr: p.Addr(), ReadTimeout: 50 * time.Millisecond, WriteTimeout: 50 * time.Millisecond,
			PoolSize: 128, MaxRetries: 3, MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 8 * time.Millisecond,
		})
		t.Cleanup(func() { faulty.Close() })
		faulty.AddHook(cgSplitRenewals(b.Client))
		const lease = 1500 * time.Millisecond
		k := tapped(t, func(observe idem.Option) (*idem.Keeper, error) {
			return idem.NewRedis(faulty, idem.WithLease(lease), idem.WithRetention(time.Minute), observe)
		})

		var (
			mu         sync.Mutex
			live       = map[string]int{}
			runs       = map[string]int{}
			released   = map[string]bool{}   // the key's last run ended so that the middleware releases it
			storedBody = map[string]string{} // the body every replay of the key answered
			stored     = map[string]bool{}   // a response of the key was stored (idem.ResultDone)
			claims     int                   // idem.ResultClaimed seen
			settles    int                   // events that end a claimed request
			violations []string
			events     = map[string]int{}
			answers    = map[string]int{}
			handlerIn  = sync.Map{} // X-Cg-Id -> chan struct{}: the handler started
		)
		bad := func(format string, args ...any) {
			mu.Lock()
			defer mu.Unlock()
			if len(violations) < 30 {
				violations = append(violations, fmt.Sprintf(format, args...))
			}
		}
		srv := newCGServer(t, k, func(w http.ResponseWriter, r *http.Request) {
			key := r.Header.Get(DefaultKeyHeader)
			c, _ := idem.ClaimFromContext(r.Context())
			behave := r.Header.Get("X-Behave")
			mu.Lock()
			if live[key] > 0 {
				violations = append(violations, fmt.Sprintf("%s: a handler started while another ran", key))
			}
			if stored[k.RecordID("", key)] {
				violations = append(violations, fmt.Sprintf("%s: a handler started after a response was stored", key))
			}
			if runs[key] > 0 && !c.Recovered() && !released[key] {
				violations = append(violations, fmt.Sprintf("%s: run %d has a fresh claim (attempt %d) although the run before was not released", key, runs[key]+1, c.Attempt()))
			}
			runs[key]++
			live[key]++
			mu.Unlock()
			gaveUp := false
			defer func() {
				mu.Lock()
				live[key]--
				released[key] = gaveUp || behave == "fails"
				mu.Unlock()
			}()
			if ch, ok := handlerIn.Load(r.Header.Get("X-Cg-Id")); ok {
				close(ch.(chan struct{}))
			}
			io.Copy(io.Discard, r.Body)
			body := fmt.Sprintf("run %d", c.Token())
			switch behave {
			case "gives up":
				select {
				case <-r.Context().Done():
					gaveUp = true
					return
				case <-time.After(20 * time.Millisecond):
				}
			case "fails":
				w.WriteHeader(http.StatusInternalServerError)
				return
			case "streams":
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, body)
				w.(http.Flusher).Flush()
				select {
				case <-r.Context().Done():
				case <-time.After(20 * time.Millisecond):
				}
				io.WriteString(w, " and more")
				return
			case "outlives":
				<-r.Context().Done()
				time.Sleep(lease * 3 / 2)
			}
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, body)
		})
		// The events the Keeper's Observer is told.
		allowed := map[idem.Result]bool{idem.ResultClaimed: true, idem.ResultRecovered: true, idem.ResultDone: true, idem.ResultReleased: true, idem.ResultReplayed: true,
			idem.ResultInProgress: true, idem.ResultUnavailable: true, idem.ResultCanceled: true, idem.ResultInvalid: true}
		var evWG sync.WaitGroup
		evStop := make(chan struct{})
		evWG.Add(1)
		go func() {
			defer evWG.Done()
			for {
				var ev idem.Event
				select {
				case ev = <-srv.events:
				case <-evStop:
					return
				}
				mu.Lock()
				events[ev.Result.String()]++
				// A Release whose reply was lost, sent again by go-redis
				// after another request claimed the released key, answers
				// ErrLeaseLost (documented at idem.ErrLeaseLost): allowed
				// on the release path (no success written), never when a
				// success was being stored.
				releaseRetried := ev.Result == idem.ResultLeaseLost && ev.Status != http.StatusCreated
				if !allowed[ev.Result] && !releaseRetried {
					violations = append(violations, fmt.Sprintf("%s: event %s (status %d): %v", ev.ID, ev.Result, ev.Status, ev.Err))
				}
				switch ev.Result {
				case idem.ResultClaimed, idem.ResultRecovered:
					claims++
				case idem.ResultDone, idem.ResultReleased, idem.ResultLeaseLost, idem.ResultUnavailable:
					if ev.Token != 0 { // after a handler, not a 503 before one
						settles++
					}
					if ev.Result == idem.ResultDone {
						stored[ev.ID] = true
					}
				}
				mu.Unlock()
			}
		}()

		p.Set(faultproxy.Faults{DropReply: 0.05, Cut: 0.05})
		const keys, clients, requests = 40, 8, 30
		behaviours := []string{"answers", "answers", "gives up", "fails", "streams", "outlives"}
		var wg sync.WaitGroup
		var seq atomic.Int64
		for c := 0; c < clients; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(uint64(c), 7))
				for i := 0; i < requests; i++ {
					key := "k" + strconv.Itoa(r.IntN(keys))
					id := strconv.FormatInt(seq.Add(1), 10)
					behave := behaviours[r.IntN(len(behaviours))]
					if behave == "outlives" && r.IntN(3) > 0 {
						behave = "answers" // a few only: each takes a lease and a half
					}
					leave := r.IntN(5)
					if behave == "outlives" {
						leave = 2 // its client leaves once it started
					}
					if leave == 1 {
						if err := cgMidBody(t, srv, key, id); !errors.Is(err, context.Canceled) {
							bad("%s: the client gone mid-body got %v", key, err)
						}
						continue
					}
					ctx, cancel := context.WithCancel(context.Background())
					started := make(chan struct{})
					handlerIn.Store(id, started)
					req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/pay", strings.NewReader(cgBody))
					require.NoError(t, err)
					req.Header.Set(DefaultKeyHeader, key)
					req.Header.Set("X-Cg-Id", id)
					req.Header.Set("X-Behave", behave)
					switch leave {
					case 2: // once the handler started (if it does)
						go func() {
							select {
							case <-started:
							case <-time.After(50 * time.Millisecond):
							}
							cancel()
						}()
					case 3: // at a random moment
						time.AfterFunc(time.Duration(r.IntN(int(5*time.Millisecond))), cancel)
					}
					resp, err := srv.Client().Do(req)
					if err != nil {
						cancel()
						if !errors.Is(err, context.Canceled) {
							bad("%s: a client that stayed could not send: %v", key, err)
						}
						continue
					}
					var got []byte
					if leave == 4 { // reads the first bytes, and goes
						got = make([]byte, 3)
						_, err = io.ReadFull(resp.Body, got)
						cancel()
					} else {
						got, err = io.ReadAll(resp.Body)
					}
					resp.Body.Close()
					cancel()
					if err != nil {
						continue // the client left while reading
					}
					mu.Lock()
					answers[strconv.Itoa(resp.StatusCode)]++
					mu.Unlock()
					replayed := resp.Header.Get(ReplayedHeader) == "true"
					switch resp.StatusCode {
					case http.StatusCreated:
						if leave != 4 && !replayed && !strings.HasPrefix(string(got), "run ") {
							bad("%s: a fresh 201 with body %q", key, got)
						}
					case http.StatusConflict, http.StatusServiceUnavailable:
					case http.StatusInternalServerError:
						if behave != "fails" || replayed {
							bad("%s: 500 to a request whose handler does not fail", key)
						}
					default:
						if leave == 0 {
							bad("%s: answered %d: %s", key, resp.StatusCode, got)
						}
					}
					if replayed && leave != 4 && resp.StatusCode == http.StatusCreated {
						mu.Lock()
						want, ok := storedBody[key]
						if !ok {
							storedBody[key] = string(got)
						} else if want != string(got) {
							violations = append(violations, fmt.Sprintf("%s: replays differ: %q, then %q", key, want, got))
						}
						mu.Unlock()
					}
				}
			}()
		}
		wg.Wait()
		p.Set(faultproxy.Faults{})
		// Handlers that outlive their client are still running: wait until
		// every claimed request has settled.
		require.Eventually(t, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return claims == settles
		}, 20*time.Second, time.Millisecond, "claimed requests never settled")

		// Claims abandoned under the faults run out with their lease: then
		// every key answers 201.
		b.Advance(lease + 100*time.Millisecond)
		for n := 0; n < keys; n++ {
			key := "k" + strconv.Itoa(n)
			res := cgPost(context.Background(), srv, key, cgBody)
			require.NoError(t, res.err)
			assert.Equal(t, http.StatusCreated, res.status, "%s once the faults stopped: %s", key, res.body)
		}
		require.Eventually(t, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return claims == settles
		}, 20*time.Second, time.Millisecond, "claimed requests never settled")
		close(evStop)
		evWG.Wait()
		mu.Lock()
		defer mu.Unlock()
		t.Logf("%d requests, %d handler runs; events: %v; answers read: %v; proxy %+v", seq.Load(), srv.runs.Load(), events, answers, p.Stats())
		for _, v := range violations {
			assert.Fail(t, v)
		}
		assert.Positive(t, events[idem.ResultCanceled.String()]+events[idem.ResultInvalid.String()], "no client left before its key was checked")
		assert.Positive(t, events[idem.ResultReleased.String()], "no key was released")
	})
}
