package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// answerRow is one answer of the middleware's own: the request that earns
// it, after what, and the Refusal it is.
type answerRow struct {
	name    string
	opts    []Option
	keeper  func(t *testing.T, b *redistest.Backend) *idem.Keeper // nil: a Keeper on b
	handler http.HandlerFunc                                      // nil: 201 {"ok":true}
	before  func(t *testing.T, b *redistest.Backend, a *answerApp)
	req     func() *http.Request

	status     int
	typ        string
	result     idem.Result
	errIs      error  // nil: not checked
	retryAfter string // "": no Retry-After
}

// answerRows are every kind of answer the middleware gives itself. Each
// call makes fresh rows: the in-progress row holds a gate of its own.
func answerRows() []answerRow {
	gate := make(chan struct{})
	var gateOnce sync.Once
	return []answerRow{
		{name: "key missing", req: func() *http.Request { return post("/x", "a") },
			status: 400, typ: ProblemKeyMissing, result: idem.ResultInvalid},
		{name: "key invalid", req: func() *http.Request { return postKey("a\tb", "a") },
			status: 400, typ: ProblemKeyInvalid, result: idem.ResultInvalid, errIs: idem.ErrInvalidKey},
		{name: "body unreadable", req: func() *http.Request {
			r := postKey("k1", "")
			r.Body, r.ContentLength = io.NopCloser(io.MultiReader(strings.NewReader("ab"), errReader{})), -1
			return r
		}, status: 400, typ: ProblemBodyUnreadable, result: idem.ResultInvalid, errIs: errBrokenBody},
		{name: "body too large", opts: []Option{WithBodyLimit(4)}, req: func() *http.Request { return postKey("k1", "123456789") },
			status: 413, typ: ProblemBodyTooLarge, result: idem.ResultTooLarge},
		{name: "key refused", opts: []Option{WithKeyFunc(func(*http.Request, []byte) (string, error) {
			return "", Refuse(http.StatusUnauthorized, "The signature does not verify.")
		})}, req: func() *http.Request { return post("/x", "a") },
			status: 401, typ: ProblemKeyRefused, result: idem.ResultRefused},
		{name: "scope refused", opts: []Option{WithScope(func(*http.Request) (string, error) { return "", errNoTenant })},
			req: func() *http.Request { return postKey("k1", "a") }, status: 400, typ: ProblemScopeRefused, result: idem.ResultRefused, errIs: errNoTenant},
		{name: "in progress",
			handler: func(w http.ResponseWriter, r *http.Request) {
				<-gate
				w.WriteHeader(http.StatusCreated)
			},
			before: func(t *testing.T, b *redistest.Backend, a *answerApp) {
				done := make(chan struct{})
				go func() { defer close(done); a.serve(postKey("k1", "a")) }()
				awaitEvent(t, a.events, idem.ResultClaimed)
				t.Cleanup(func() { gateOnce.Do(func() { close(gate) }); <-done })
			},
			req:    func() *http.Request { return postKey("k1", "a") },
			status: 409, typ: ProblemInProgress, result: idem.ResultInProgress, retryAfter: "1"},
		{name: "key reused", before: first(postKey("k1", "a")), req: func() *http.Request { return postKey("k1", "b") },
			status: 422, typ: ProblemMismatch, result: idem.ResultMismatch, errIs: idem.ErrMismatch},
		{name: "store unavailable", before: func(t *testing.T, b *redistest.Backend, a *answerApp) { b.Stop() },
			req:    func() *http.Request { return postKey("k1", "a") },
			status: 503, typ: ProblemUnavailable, result: idem.ResultUnavailable, errIs: idem.ErrUnavailable, retryAfter: "1"},
		{name: "record corrupt", before: func(t *testing.T, b *redistest.Backend, a *answerApp) {
			ctx := context.Background()
			a.serve(postKey("k1", "a"))
			keys, err := b.Client.Keys(ctx, idem.DefaultPrefix+"{*").Result()
			require.NoError(t, err)
			require.Len(t, keys, 1)
			require.NoError(t, b.Client.Set(ctx, keys[0], "garbage", 0).Err())
		}, req: func() *http.Request { return postKey("k1", "a") },
			status: 500, typ: ProblemCorrupt, result: idem.ResultCorrupt, errIs: idem.ErrCorrupt},
		{name: "result expired", keeper: func(t *testing.T, b *redistest.Backend) *idem.Keeper {
			markKey(t, b, postKey("k1", "a"), true)
			return tapped(t, func(observe idem.Option) (*idem.Keeper, error) { return idem.NewRedis(b.Client, observe) })
		}, req: func() *http.Request { return postKey("k1", "a") },
			status: 410, typ: ProblemResultExpired, result: idem.ResultExpired, errIs: idem.ErrResultExpired},
		{name: "client gone", req: func() *http.Request {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			return postKey("k1", "a").WithContext(ctx)
		}, status: StatusClientClosedRequest, typ: ProblemCanceled, result: idem.ResultCanceled, errIs: context.Canceled},
		{name: "replay whose body was not kept", opts: []Option{WithResponseLimit(4)},
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/plain")
				w.Header().Set("X-Charge", "ch_1")
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, "charged ch_1")
			},
			before: first(postKey("k1", "a")), req: func() *http.Request { return postKey("k1", "a") },
			status: 201, typ: ProblemBodyNotKept, result: idem.ResultReplayed},
	}
}

// first sends r once before the row's request.
func first(r *http.Request) func(*testing.T, *redistest.Backend, *answerApp) {
	return func(t *testing.T, _ *redistest.Backend, a *answerApp) { a.serve(r) }
}

var errBrokenBody = errors.New("connection reset while reading the body")

// errReader fails every read with errBrokenBody.
type errReader struct{}

func (errReader) Read([]byte) (int, error) { return 0, errBrokenBody }

// answerApp is a handler behind the middleware, with the Keeper's events.
type answerApp struct {
	h      http.Handler
	events tap
	runs   atomic.Int64
}

func (a *answerApp) serve(r *http.Request) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	a.h.ServeHTTP(rec, r)
	return rec
}

// answer sets row up on b with opts besides the row's, and answers its
// request.
func (row answerRow) answer(t *testing.T, b *redistest.Backend, opts ...Option) (*httptest.ResponseRecorder, *answerApp) {
	t.Helper()
	var k *idem.Keeper
	if row.keeper != nil {
		k = row.keeper(t, b)
	} else {
		k = tapped(t, func(observe idem.Option) (*idem.Keeper, error) { return idem.NewRedis(b.Client, observe) })
	}
	handler := row.handler
	if handler == nil {
		handler = func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, `{"ok":true}`)
		}
	}
	mw, err := New(k, append(append([]Option(nil), row.opts...), opts...)...)
	require.NoError(t, err)
	a := &answerApp{events: tapOf(t, k)}
	a.h = mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.runs.Add(1)
		handler(w, r)
	}))
	if row.before != nil {
		row.before(t, b, a)
	}
	return a.serve(row.req()), a
}

// Every answer the middleware gives itself goes through the error writer,
// once, with the status, type and result the middleware chose, the cause,
// and the headers it set (Retry-After, nosniff, a replay's) already on w.
func TestErrorWriterRendersEveryAnswer(t *testing.T) {
	for i, row := range answerRows() {
		t.Run(row.name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				row := answerRows()[i] // its own gate
				var (
					mu   sync.Mutex
					refs []Refusal
					seen http.Header // the headers on w when the writer was called
				)
				writer := WithErrorWriter(func(w http.ResponseWriter, r *http.Request, ref Refusal) {
					mu.Lock()
					refs = append(refs, ref)
					seen = w.Header().Clone()
					mu.Unlock()
					assert.Equal(t, "/x", r.URL.Path, "the writer is given the request")
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(ref.Status)
					fmt.Fprintf(w, `{"error":{"kind":%q}}`, ref.Type)
				})
				rec, a := row.answer(t, b, writer)

				mu.Lock()
				defer mu.Unlock()
				require.Len(t, refs, 1, "the writer is called once per answer of the middleware's own")
				ref := refs[0]
				assert.Equal(t, row.status, ref.Status)
				assert.Equal(t, row.typ, ref.Type)
				assert.Equal(t, row.result, ref.Result)
				assert.NotEmpty(t, ref.Title)
				assert.NotEmpty(t, ref.Detail)
				if row.errIs != nil {
					assert.ErrorIs(t, ref.Err, row.errIs)
				}

				assert.Equal(t, row.status, rec.Code)
				assert.Equal(t, fmt.Sprintf(`{"error":{"kind":%q}}`, row.typ), rec.Body.String())
				assert.Equal(t, "application/json", rec.Header().Get("Content-Type"))
				assert.Equal(t, "nosniff", seen.Get("X-Content-Type-Options"), "set before the writer is called")
				assert.Equal(t, "nosniff", rec.Header().Get("X-Content-Type-Options"))
				assert.Equal(t, row.retryAfter, seen.Get("Retry-After"), "Retry-After is on w when the writer is called")
				assert.Equal(t, row.retryAfter, rec.Header().Get("Retry-After"))
				if row.typ == ProblemBodyNotKept {
					assert.Equal(t, "true", seen.Get(ReplayedHeader))
					assert.Equal(t, "ch_1", seen.Get("X-Charge"), "the stored headers are replayed")
					assert.Empty(t, seen.Get("Content-Type"), "the stored body's headers are not")
					assert.EqualValues(t, 1, a.runs.Load())
				} else {
					assert.Empty(t, seen.Get(ReplayedHeader))
				}

				ev := awaitEvent(t, a.events, row.result)
				assert.Equal(t, row.status, ev.Status, "the Observer is told the status the writer was given")
			})
		})
	}
}

// Without WithErrorWriter, every answer is RFC 9457 problem+json, and
// WithErrorWriter(WriteProblem) answers the same, byte for byte.
func TestWriteProblemIsTheDefault(t *testing.T) {
	for i, row := range answerRows() {
		t.Run(row.name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				def, _ := answerRows()[i].answer(t, b)
				requireProblem(t, def, row.status, row.typ)
				assert.Equal(t, "nosniff", def.Header().Get("X-Content-Type-Options"))
				assert.Equal(t, row.retryAfter, def.Header().Get("Retry-After"))

				// The same answer on a Redis of its own, through the option.
				exp, _ := answerRows()[i].answer(t, freshLike(t, b), WithErrorWriter(WriteProblem))
				assert.Equal(t, def.Code, exp.Code)
				def.Header().Del("Date")
				exp.Header().Del("Date")
				assert.Equal(t, def.Header(), exp.Header())
				assert.Equal(t, def.Body.String(), exp.Body.String())
			})
		})
	}
}

// freshLike returns a new Backend of b's kind.
func freshLike(t *testing.T, b *redistest.Backend) *redistest.Backend {
	if b.Real {
		return redistest.Real(t)
	}
	return redistest.Miniredis(t)
}

// The writer cannot change what the middleware decided: the Observer is
// told the status the writer was given, whatever it answers, and a writer
// that writes no status answers that status, never an implicit 200.
func TestErrorWriterCannotChangeTheOutcome(t *testing.T) {
	for _, tc := range []struct {
		name     string
		write    func(w http.ResponseWriter, r *http.Request, ref Refusal)
		wantCode int
		wantBody string
	}{
		{name: "another status", write: func(w http.ResponseWriter, r *http.Request, ref Refusal) {
			w.WriteHeader(http.StatusBadRequest) // as Stripe answers a reused key
			io.WriteString(w, "reused")
		}, wantCode: 400, wantBody: "reused"},
		{name: "a body alone", write: func(w http.ResponseWriter, r *http.Request, ref Refusal) {
			io.WriteString(w, "reused")
		}, wantCode: 422, wantBody: "reused"},
		{name: "nothing written", write: func(http.ResponseWriter, *http.Request, Refusal) {},
			wantCode: 422},
	} {
		t.Run(tc.name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				g := newGuarded(t, b, nil, func(w http.ResponseWriter, r *http.Request) {
					w.WriteHeader(http.StatusCreated)
				}, WithErrorWriter(tc.write))
				require.Equal(t, http.StatusCreated, g.serve(postKey("k1", "a")).Code)
				g.next(t, idem.ResultDone)

				rec := g.serve(postKey("k1", "b"))
				assert.Equal(t, tc.wantCode, rec.Code)
				assert.Equal(t, tc.wantBody, rec.Body.String())
				ev := g.next(t, idem.ResultMismatch)
				assert.Equal(t, http.StatusUnprocessableEntity, ev.Status)
				assert.EqualValues(t, 1, g.runs.Load())

				rec = g.serve(postKey("k1", "a"))
				assert.Equal(t, http.StatusCreated, rec.Code, "the first request's response is still replayed")
				assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
			})
		})
	}
}

// A writer that panics panics in the server's goroutine; the Observer is
// told of the request all the same.
func TestErrorWriterPanicIsReported(t *testing.T) {
	g := newGuarded(t, redistest.Miniredis(t), nil, func(http.ResponseWriter, *http.Request) {},
		WithErrorWriter(func(http.ResponseWriter, *http.Request, Refusal) { panic("writer bug") }))
	assert.PanicsWithValue(t, "writer bug", func() { g.serve(post("/x", "a")) })
	ev := g.next(t, idem.ResultInvalid)
	assert.Equal(t, http.StatusBadRequest, ev.Status)
}

func TestErrorWriterMustNotBeNil(t *testing.T) {
	k, err := idem.NewRedis(redistest.Miniredis(t).Client)
	require.NoError(t, err)
	_, err = New(k, WithErrorWriter(nil))
	assert.ErrorIs(t, err, idem.ErrInvalidConfig)
}
