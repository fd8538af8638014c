package idemhttp

import (
	"bytes"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/require"
)

// FuzzMiddleware sends one request with arbitrary key header, method and body
// through the middleware twice: it never panics, answers only the statuses of
// its contract, and a stored answer is replayed byte for byte without the
// handler running again.
//
// Fuzz it with -fuzztime as a count (-fuzztime 2000x): without a bound it
// never ends, and the miniredis under it keeps growing.
func FuzzMiddleware(f *testing.F) {
	for _, seed := range []struct {
		method, key string
		body        []byte
	}{
		{"POST", "order-1", []byte("amount=10")},
		{"POST", "", nil},
		{"POST", `"quoted"`, []byte("{}")},
		{"POST", "\"unterminated", []byte("x")},
		{"PATCH", strings.Repeat("k", 300), nil},
		{"POST", "ctl\x01", nil},
		{"POST", "big", bytes.Repeat([]byte("b"), 200)},
		{"GET", "k", nil},
		{"PUT", "k", []byte("x")},
	} {
		f.Add(seed.method, seed.key, seed.body)
	}
	k, err := idem.NewRedis(redistest.Miniredis(f).Client, idem.WithLease(time.Minute)) // no tap: nothing reads events here
	require.NoError(f, err)
	var tenant atomic.Int64
	mw, err := New(k, WithBodyLimit(128), WithScope(func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil }))
	require.NoError(f, err)
	var runs atomic.Int64
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, _ := readAllLimit(r)
		w.Header().Set("X-Len", fmt.Sprint(len(b)))
		w.WriteHeader(http.StatusCreated)
		w.Write(b)
	}))
	allowed := map[int]bool{http.StatusCreated: true, http.StatusBadRequest: true, http.StatusRequestEntityTooLarge: true,
		http.StatusUnprocessableEntity: true, http.StatusConflict: true}
	f.Fuzz(func(t *testing.T, method, key string, body []byte) {
		if !validMethod(method) {
			return
		}
		scope := fmt.Sprint(tenant.Add(1))
		send := func() *httptest.ResponseRecorder {
			req := httptest.NewRequest("POST", "/x", bytes.NewReader(body))
			req.Method = method
			req.Header["Idempotency-Key"] = []string{key}
			req.Header.Set("X-Tenant", scope)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			return rec
		}
		before := runs.Load()
		first := send()
		ran := runs.Load() - before
		require.True(t, allowed[first.Code], "%s key %q body %q: status %d %s", method, key, body, first.Code, first.Body)
		if first.Code != http.StatusCreated && ran == 0 {
			require.True(t, strings.HasPrefix(first.Header().Get("Content-Type"), "application/problem+json"),
				"%s key %q: own answer %d without problem+json: %v", method, key, first.Code, first.Header())
		}
		if ran == 0 || first.Code != http.StatusCreated {
			return
		}
		second := send()
		if method != http.MethodPost && method != http.MethodPatch {
			return // not guarded: the handler runs every time
		}
		require.Equal(t, int64(1), runs.Load()-before, "%s key %q: times the handler ran", method, key)
		require.Equal(t, first.Code, second.Code, "%s key %q: replay %d %q %v, first %d %q", method, key, second.Code, second.Body, second.Header(), first.Code, first.Body)
		require.True(t, bytes.Equal(second.Body.Bytes(), first.Body.Bytes()), "%s key %q: replay %d %q %v, first %d %q", method, key, second.Code, second.Body, second.Header(), first.Code, first.Body)
		require.Equal(t, "true", second.Header().Get(ReplayedHeader), "%s key %q: replay %d %q %v, first %d %q", method, key, second.Code, second.Body, second.Header(), first.Code, first.Body)
	})
}

func readAllLimit(r *http.Request) ([]byte, error) {
	var b bytes.Buffer
	_, err := b.ReadFrom(r.Body)
	return b.Bytes(), err
}

// validMethod reports whether m is an HTTP token that net/http would send.
func validMethod(m string) bool {
	if m == "" || !utf8.ValidString(m) {
		return false
	}
	for _, c := range m {
		if c <= ' ' || c >= 0x7f || strings.ContainsRune("()<>@,;:\\\"/[]?={}", c) {
			return false
		}
	}
	return true
}
