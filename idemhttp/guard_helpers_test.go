package idemhttp

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// guarded is a handler behind the middleware, with its events and how many
// times it ran.
type guarded struct {
	k      *idem.Keeper
	h      http.Handler
	runs   atomic.Int64
	events tap
}

// newGuarded guards handler with opts on a Keeper on b (with keeperOpts);
// the handler's runs are counted before it is called.
func newGuarded(t *testing.T, b *redistest.Backend, keeperOpts []idem.Option, handler http.HandlerFunc, opts ...Option) *guarded {
	t.Helper()
	k := tapped(t, func(observe idem.Option) (*idem.Keeper, error) {
		return idem.NewRedis(b.Client, append(keeperOpts, observe)...)
	})
	g := &guarded{k: k, events: tapOf(t, k)}
	mw, err := New(k, opts...)
	require.NoError(t, err)
	g.h = mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.runs.Add(1)
		handler(w, r)
	}))
	return g
}

// serve answers r.
func (g *guarded) serve(r *http.Request) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	g.h.ServeHTTP(rec, r)
	return rec
}

// next returns the next event of kind, skipping others; it fails the test
// after ten seconds.
func (g *guarded) next(t *testing.T, kind idem.Result) idem.Event {
	t.Helper()
	return awaitEvent(t, g.events, kind)
}

// post is a POST to target with body and header name, value pairs.
func post(target, body string, hdr ...string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, target, strings.NewReader(body))
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Add(hdr[i], hdr[i+1])
	}
	return r
}

// requireProblem asserts that rec is an RFC 9457 answer of the middleware
// with status and type, and returns it.
func requireProblem(t *testing.T, rec *httptest.ResponseRecorder, status int, typ string) problem {
	t.Helper()
	require.Equal(t, status, rec.Code, "body: %s", rec.Body)
	assert.Equal(t, "application/problem+json", rec.Header().Get("Content-Type"))
	var p problem
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &p), "body: %s", rec.Body)
	assert.Equal(t, typ, p.Type)
	assert.Equal(t, status, p.Status)
	assert.NotEmpty(t, p.Title)
	assert.NotEmpty(t, p.Detail)
	return p
}

// redisPacedClock returns a Keeper clock (WithClock) that moves only when
// advance moves b's Redis clock too, so that the Keeper never judges a lease
// by time a busy machine spent pausing a goroutine.
func redisPacedClock(b *redistest.Backend) (clock idem.Option, advance func(time.Duration)) {
	var offset atomic.Int64
	start := time.Now()
	clock = idem.WithClock(func() time.Time { return start.Add(time.Duration(offset.Load())) })
	return clock, func(d time.Duration) {
		offset.Add(int64(d))
		b.Advance(d)
	}
}
