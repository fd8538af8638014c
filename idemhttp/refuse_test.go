package idemhttp

import (
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var errNoTenant = errors.New("no tenant: token for 10.0.0.5 expired")

// A scope function that cannot place a request refuses it: the status its
// error names, default 400; the handler does not run and Redis is not
// touched, so "no tenant" never shares a key space.
func TestScopeRefusal(t *testing.T) {
	for _, tc := range []struct {
		name      string
		err       error
		status    int
		detail    string // "": the generic detail, which never shows the error's text
		wantErrIs error
	}{
		{name: "any error answers 400", err: errNoTenant, status: 400, wantErrIs: errNoTenant},
		{name: "Refuse names the status and detail", err: Refuse(http.StatusUnauthorized, "Sign in first."), status: 401, detail: "Sign in first."},
		{name: "a RefusedError with a cause", err: &RefusedError{Status: http.StatusForbidden, Err: errNoTenant}, status: 403, wantErrIs: errNoTenant},
		{name: "wrapped", err: fmt.Errorf("auth: %w", Refuse(http.StatusServiceUnavailable, "Accounts are down.")), status: 503, detail: "Accounts are down."},
		{name: "a status that is not an error answers 400", err: Refuse(http.StatusOK, "no"), status: 400, detail: "no"},
		{name: "no status answers 400", err: &RefusedError{}, status: 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := redistest.Miniredis(t)
			g := newGuarded(t, b, nil, func(w http.ResponseWriter, r *http.Request) {}, WithScope(func(r *http.Request) (string, error) {
				return "", tc.err
			}))
			rec := g.serve(post("/pay", "a", DefaultKeyHeader, "k"))
			p := requireProblem(t, rec, tc.status, ProblemScopeRefused)
			if tc.detail != "" {
				assert.Equal(t, tc.detail, p.Detail)
			} else {
				assert.NotContains(t, p.Detail, "10.0.0.5", "the error's own text is not shown")
			}
			ev := g.next(t, idem.ResultRefused)
			assert.Equal(t, tc.status, ev.Status)
			assert.Empty(t, ev.Scope)
			assert.Empty(t, ev.ID, "a refused request names no record")
			assert.ErrorIs(t, ev.Err, tc.err)
			if tc.wantErrIs != nil {
				assert.ErrorIs(t, ev.Err, tc.wantErrIs)
			}
			assert.Zero(t, g.runs.Load(), "the handler does not run")
			assert.Empty(t, b.Mini.Keys(), "Redis is not touched")
		})
	}
}

// The scope function is asked only of requests the middleware guards: not of
// a method it does not guard, nor of a request without a key when none is
// required, nor of one refused for its key.
func TestScopeAskedOnlyOfGuardedRequests(t *testing.T) {
	b := redistest.Miniredis(t)
	var asked atomic.Int32
	g := newGuarded(t, b, nil, func(w http.ResponseWriter, r *http.Request) {}, WithKeyRequired(false),
		WithScope(func(r *http.Request) (string, error) {
			asked.Add(1)
			return r.Header.Get("X-Tenant"), nil
		}))
	assert.Equal(t, http.StatusOK, g.serve(post("/pay", "a")).Code, "no key, none required: passed through")
	get := post("/pay", "")
	get.Method = http.MethodGet
	assert.Equal(t, http.StatusOK, g.serve(get).Code)
	requireProblem(t, g.serve(post("/pay", "a", DefaultKeyHeader, "bad\x01key")), http.StatusBadRequest, ProblemKeyInvalid)
	assert.Zero(t, asked.Load())

	assert.Equal(t, http.StatusOK, g.serve(post("/pay", "a", DefaultKeyHeader, "k", "X-Tenant", "acme")).Code)
	assert.Equal(t, int32(1), asked.Load())
	ev := g.next(t, idem.ResultDone)
	assert.Equal(t, "acme", ev.Scope)
}

func TestRefusedErrorMessage(t *testing.T) {
	err := &RefusedError{Status: http.StatusUnauthorized, Detail: "Sign in first.", Err: errNoTenant}
	assert.Equal(t, "idemhttp: request refused (401): Sign in first.: "+errNoTenant.Error(), err.Error())
	assert.Equal(t, "idemhttp: request refused (400)", (&RefusedError{Status: 99}).Error())
	var re *RefusedError
	require.ErrorAs(t, Refuse(http.StatusConflict, "x"), &re)
	assert.Equal(t, http.StatusConflict, re.Status)
}
