package idemhttp

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// deleteAPI answers DELETE /v1/customers/{id} as a Stripe-shaped API:
// 200 the first time a customer is deleted, 404 after; POST creates.
type deleteAPI struct {
	runs    atomic.Int64
	deleted map[string]bool
}

func (a *deleteAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.runs.Add(1)
	w.Header().Set("Content-Type", "application/json")
	if r.Method != http.MethodDelete {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d}`, a.runs.Load())
		return
	}
	if a.deleted[r.URL.Path] {
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprint(w, `{"error":{"type":"invalid_request_error","message":"No such customer"}}`)
		return
	}
	a.deleted[r.URL.Path] = true
	fmt.Fprintf(w, `{"deleted":true,"run":%d}`, a.runs.Load())
}

// Under the default methods, a key on DELETE, PUT or GET is ignored: the
// request passes through, runs every time, gets a fresh answer (a DELETE
// run again answers 404), and nothing is claimed, stored nor reported.
func TestKeyOnAnUnguardedMethodIsIgnored(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		api := &deleteAPI{deleted: map[string]bool{}}
		g := newGuarded(t, b, nil, api.ServeHTTP)
		del := func() *httptest.ResponseRecorder {
			return g.serve(request(http.MethodDelete, "/v1/customers/cus_1", "", DefaultKeyHeader, "del-1"))
		}
		assert.Equal(t, http.StatusOK, del().Code)
		rec := del()
		assert.Equal(t, http.StatusNotFound, rec.Code, "the DELETE ran again")
		assert.Empty(t, rec.Header().Get(ReplayedHeader))
		for _, method := range []string{http.MethodPut, http.MethodGet} {
			for range 2 {
				rec := g.serve(request(method, "/v1/customers/cus_2", "", DefaultKeyHeader, "put-1"))
				assert.Equal(t, http.StatusCreated, rec.Code, method)
				assert.Empty(t, rec.Header().Get(ReplayedHeader), method)
			}
		}
		// Nor is a key too long to be valid looked at.
		long := string(make([]byte, idem.MaxKeyLen+1))
		assert.Equal(t, http.StatusCreated, g.serve(request(http.MethodPut, "/x", "", DefaultKeyHeader, long)).Code)
		assert.EqualValues(t, 7, api.runs.Load())

		keys, err := b.Client.Keys(context.Background(), idem.DefaultPrefix+"*").Result()
		require.NoError(t, err)
		assert.Empty(t, keys, "nothing was claimed")
		select {
		case ev := <-g.events:
			t.Fatalf("an unguarded request was reported: %+v", ev)
		default:
		}
	})
}

// WithMethods guards DELETE when it is listed: a DELETE retried with its
// key gets the first answer replayed instead of a 404, and runs once; the
// key on another resource, or on a POST, answers 422; a DELETE without a
// key answers 400, as a POST does.
func TestWithMethodsGuardsDelete(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		api := &deleteAPI{deleted: map[string]bool{}}
		g := newGuarded(t, b, nil, api.ServeHTTP, WithMethods(http.MethodPost, http.MethodPatch, http.MethodDelete))
		del := func(path, key string) *httptest.ResponseRecorder {
			return g.serve(request(http.MethodDelete, path, "", DefaultKeyHeader, key))
		}
		first := del("/v1/customers/cus_1", "del-1")
		require.Equal(t, http.StatusOK, first.Code)
		assert.Equal(t, http.StatusOK, g.next(t, idem.ResultDone).Status)
		for i := range 3 {
			rec := del("/v1/customers/cus_1", "del-1")
			assert.Equal(t, http.StatusOK, rec.Code, "retry %d", i+1)
			assert.Equal(t, first.Body.String(), rec.Body.String(), "retry %d", i+1)
			assert.Equal(t, "true", rec.Header().Get(ReplayedHeader), "retry %d", i+1)
		}
		assert.EqualValues(t, 1, api.runs.Load())

		requireProblem(t, del("/v1/customers/cus_2", "del-1"), http.StatusUnprocessableEntity, ProblemMismatch)
		requireProblem(t, g.serve(request(http.MethodPost, "/v1/customers/cus_1", "", DefaultKeyHeader, "del-1")),
			http.StatusUnprocessableEntity, ProblemMismatch)
		requireProblem(t, g.serve(request(http.MethodDelete, "/v1/customers/cus_1", "")), http.StatusBadRequest, ProblemKeyMissing)
		// A method is matched exactly: "delete" is another method.
		assert.Empty(t, g.serve(request("delete", "/v1/customers/cus_1", "", DefaultKeyHeader, "del-1")).Header().Get(ReplayedHeader))
		assert.EqualValues(t, 2, api.runs.Load())
	})
}

// Two middlewares, one inside the other, make the key required on POST and
// optional on DELETE: a DELETE with a key is guarded, one without runs
// unguarded, and a POST without a key is refused. They share one key
// space: a key of a POST reused on a DELETE answers 422.
func TestKeyOptionalOnDeleteOnly(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, err := idem.NewRedis(b.Client)
		require.NoError(t, err)
		posts, err := New(k) // POST and PATCH, key required
		require.NoError(t, err)
		deletes, err := New(k, WithMethods(http.MethodDelete), WithKeyRequired(false))
		require.NoError(t, err)
		api := &deleteAPI{deleted: map[string]bool{}}
		h := posts(deletes(api))
		serve := func(r *http.Request) *httptest.ResponseRecorder {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, r)
			return rec
		}

		requireProblem(t, serve(request(http.MethodPost, "/v1/customers", "")), http.StatusBadRequest, ProblemKeyMissing)
		assert.Equal(t, http.StatusCreated, serve(request(http.MethodPost, "/v1/customers", "", DefaultKeyHeader, "k1")).Code)

		assert.Equal(t, http.StatusOK, serve(request(http.MethodDelete, "/v1/customers/cus_1", "")).Code)
		assert.Equal(t, http.StatusNotFound, serve(request(http.MethodDelete, "/v1/customers/cus_1", "")).Code,
			"without a key a DELETE is not guarded")

		first := serve(request(http.MethodDelete, "/v1/customers/cus_2", "", DefaultKeyHeader, "k2"))
		require.Equal(t, http.StatusOK, first.Code)
		again := serve(request(http.MethodDelete, "/v1/customers/cus_2", "", DefaultKeyHeader, "k2"))
		assert.Equal(t, http.StatusOK, again.Code)
		assert.Equal(t, "true", again.Header().Get(ReplayedHeader))
		assert.Equal(t, first.Body.String(), again.Body.String())

		requireProblem(t, serve(request(http.MethodDelete, "/v1/customers", "", DefaultKeyHeader, "k1")),
			http.StatusUnprocessableEntity, ProblemMismatch)
		assert.EqualValues(t, 4, api.runs.Load())
	})
}
