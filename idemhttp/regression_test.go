package idemhttp

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The same through the middleware: the client times out, the handler goes on
// 1.5 leases after it left; the retry gets 409 while it runs, then the
// stored response, and the handler runs once.
func TestClientTimeoutHandlerOutlivesIt(t *testing.T) {
	b := redistest.Real(t)
	const lease = time.Second
	k := newKeeper(t, b, idem.WithLease(lease), idem.WithRetention(time.Minute))
	var charges atomic.Int32
	started, resume := make(chan struct{}), make(chan struct{})
	mw, err := New(k)
	require.NoError(t, err)
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		charges.Add(1)
		close(started)
		<-r.Context().Done() // the client left...
		<-resume             // ...and the payment goes on
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "charged")
	})))
	defer srv.Close()

	ctx, cancel := context.WithCancel(context.Background())
	go send(srv.Client(), clientPost(t, srv.URL, "k1", "a").WithContext(ctx))
	<-started
	cancel() // the client times out
	time.Sleep(lease * 3 / 2)
	res := send(srv.Client(), clientPost(t, srv.URL, "k1", "a"))
	require.NoError(t, res.err)
	assert.Equal(t, http.StatusConflict, res.status, "the retry while the handler runs: %s", res.body)
	close(resume)
	seen := tapOf(t, k).until(t, idem.ResultDone)
	res = send(srv.Client(), clientPost(t, srv.URL, "k1", "a"))
	require.NoError(t, res.err)
	assert.Equal(t, http.StatusCreated, res.status)
	assert.Equal(t, "charged", string(res.body))
	assert.Equal(t, "true", res.header.Get(ReplayedHeader))
	assert.EqualValues(t, 1, charges.Load())
	assert.NotContains(t, seen, idem.ResultLeaseLost)
}

// WithBodyLimit(math.MaxInt64), no limit, works like any other: the handler
// gets the body and the body is fingerprinted.
func TestBodyLimitMaxInt64(t *testing.T) {
	k := newKeeper(t, redistest.Miniredis(t))
	var got []string
	mw, err := New(k, WithBodyLimit(math.MaxInt64))
	require.NoError(t, err)
	a := &app{h: mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		got = append(got, string(body))
		w.WriteHeader(http.StatusCreated)
		w.Write(body)
	}))}
	rec1 := a.do(postKey("k1", `{"amount":100}`))
	rec2 := a.do(postKey("k1", `{"amount":999}`))
	assert.Equal(t, []string{`{"amount":100}`}, got)
	assert.Equal(t, http.StatusCreated, rec1.Code)
	assert.Equal(t, http.StatusUnprocessableEntity, rec2.Code, "same key, other body")
	assert.Equal(t, int64(math.MaxInt64), saturatingAdd(math.MaxInt64, 1))
	assert.Equal(t, int64(11), saturatingAdd(10, 1))
}

// A stored response is never replayed to a request for another resource,
// whatever the fingerprint function reads: here, the body only.
func TestNoCrossResourceReplay(t *testing.T) {
	k := newKeeper(t, redistest.Miniredis(t))
	mw, err := New(k, WithFingerprint(func(r *http.Request, body []byte) []byte { return body }))
	require.NoError(t, err)
	var ran []string
	mux := http.NewServeMux()
	mux.Handle("POST /accounts/{id}/charges", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran = append(ran, r.PathValue("id"))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charged account %s", r.PathValue("id"))
	})))
	do := func(path string) *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, request(http.MethodPost, path, `{"amount":100}`, DefaultKeyHeader, "k1"))
		return rec
	}
	assert.Equal(t, http.StatusCreated, do("/accounts/A/charges").Code)
	rec := do("/accounts/B/charges")
	assert.Equal(t, http.StatusUnprocessableEntity, rec.Code, "B's charge: %s", rec.Body)
	assert.Equal(t, []string{"A"}, ran)
	rec = do("/accounts/A/charges")
	assert.Equal(t, "charged account A", rec.Body.String())
	assert.Equal(t, "true", rec.Header().Get(ReplayedHeader))
}

// A client gone before its key was checked is not the store's failure: the
// middleware answers 499, neither 503 nor, with WithFailOpen, a run of the
// handler unguarded that its retry would run again.
func TestCancelledClientIsNotUnavailable(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		var runs atomic.Int32
		mw, err := New(k, WithFailOpen(true))
		require.NoError(t, err)
		a := &app{h: mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
		}))}
		rec := a.do(postKey("k1", "a").WithContext(ctx)) // the client is gone
		assert.Equal(t, StatusClientClosedRequest, rec.Code)
		a.do(postKey("k1", "a")) // its retry
		assert.EqualValues(t, 1, runs.Load())
		assert.Equal(t, []idem.Result{idem.ResultCanceled, idem.ResultClaimed, idem.ResultDone}, tapOf(t, k).drain())
	})
}
