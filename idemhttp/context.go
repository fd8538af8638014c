package idemhttp

import (
	"context"
	"net/http"

	"github.com/idemkit/idem"
)

// RequestKey returns the tenant and the key under which the middleware
// guards the handler of r: the tenant its scope function named (WithScope;
// "" by default) and the key it read (the key header's value, unquoted, or
// what the key function returned: WithKeyFunc), so that a handler need not
// read them again. ok is false for a request the middleware did not guard:
// a method it does not guard, a request without a key that WithKeyRequired
// false let through, a handler it does not wrap.
//
// A handler run fail-open (WithFailOpen) gets the tenant and the key too,
// although it holds no claim (idem.ClaimFromContext reports none): it may
// still pass the key on to a downstream API's own idempotency. Otherwise
// they are those of the claim in r's context (idem.Claim's Scope and Key),
// so call RequestKey with the request the handler was given, or one with
// its context.
func RequestKey(r *http.Request) (tenant, key string, ok bool) {
	ctx := r.Context()
	if k, found := ctx.Value(failOpenKey{}).(*requestKey); found {
		return k.tenant, k.key, true
	}
	if c, found := idem.ClaimFromContext(ctx); found {
		return c.Scope(), c.Key(), true
	}
	return "", "", false
}

// failOpenKey is the context key of the tenant and key of a request whose
// handler runs fail-open, without a claim.
type failOpenKey struct{}

// requestKey is what a record of the middleware is named by.
type requestKey struct{ tenant, key string }

// withRequestKey returns r with tenant and key in its context, for
// RequestKey in a handler that runs without a claim.
func withRequestKey(r *http.Request, tenant, key string) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), failOpenKey{}, &requestKey{tenant: tenant, key: key}))
}
