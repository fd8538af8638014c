package idemhttp

import (
	"net/http"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// seen is what a handler learnt of its request from RequestKey and
// ClaimFromContext.
type seen struct {
	tenant, key string
	ok          bool
	claim       bool
	token       int64
}

// seeKey is a handler that records what it sees into *s and answers 201.
func seeKey(s *seen) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s.tenant, s.key, s.ok = RequestKey(r)
		c, ok := idem.ClaimFromContext(r.Context())
		s.claim, s.token = ok, c.Token() // a nil claim is safe to ask
		w.WriteHeader(http.StatusCreated)
	}
}

func tenantHeader(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil }

// The handler learns the tenant and the key its request is guarded under,
// however the middleware read them.
func TestRequestKey(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []Option
		req  *http.Request
		want seen
	}{
		{name: "key header", opts: []Option{WithScope(tenantHeader)},
			req:  post("/payments", "10 EUR", DefaultKeyHeader, "pay-1", "X-Tenant", "acme"),
			want: seen{tenant: "acme", key: "pay-1", ok: true, claim: true}},
		{name: "quoted key header", opts: []Option{WithScope(tenantHeader)},
			req:  post("/payments", "10 EUR", DefaultKeyHeader, `"pay-2"`, "X-Tenant", "acme"),
			want: seen{tenant: "acme", key: "pay-2", ok: true, claim: true}},
		{name: "key function, default tenant", opts: []Option{WithKeyFunc(eventID)},
			req:  post("/webhooks", `{"id":"evt_1"}`),
			want: seen{key: "evt_1", ok: true, claim: true}},
		{name: "method not guarded", opts: []Option{WithScope(tenantHeader)},
			req:  reqWith(http.MethodGet, "/payments", DefaultKeyHeader, "pay-3", "X-Tenant", "acme"),
			want: seen{}},
		{name: "no key, not required", opts: []Option{WithKeyRequired(false)},
			req:  post("/payments", "10 EUR"),
			want: seen{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got seen
			g := newGuarded(t, redistest.Miniredis(t), nil, seeKey(&got), tc.opts...)
			rec := g.serve(tc.req)
			require.Equal(t, http.StatusCreated, rec.Code, "body: %s", rec.Body)
			if tc.want.claim {
				assert.Positive(t, got.token, "the claim's fencing token")
				got.token = 0
			}
			assert.Equal(t, tc.want, got)
		})
	}
}

// A handler run fail-open holds no claim, but still learns its tenant and
// key.
func TestRequestKeyFailOpen(t *testing.T) {
	b := redistest.Miniredis(t)
	var got seen
	g := newGuarded(t, b, nil, seeKey(&got), WithScope(tenantHeader), WithFailOpen(true))
	b.Stop()
	rec := g.serve(post("/payments", "10 EUR", DefaultKeyHeader, "pay-1", "X-Tenant", "acme"))
	require.Equal(t, http.StatusCreated, rec.Code, "body: %s", rec.Body)
	g.next(t, idem.ResultFailOpen)
	assert.Equal(t, seen{tenant: "acme", key: "pay-1", ok: true}, got)
}

// reqWith is a request of method to target, without a body, with header
// name, value pairs.
func reqWith(method, target string, hdr ...string) *http.Request {
	r := post(target, "", hdr...)
	r.Method = method
	return r
}
