package idemhttp

import (
	"context"
	"net/http"
	"sync/atomic"

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

// ExecutionBegan tells the middleware that the request whose handler was
// given ctx (its Request.Context, or a context made from it) has begun
// executing: its side effect has happened or is about to (the charge is
// sent, the row is written). Call it from the handler, once the request is
// validated and just before the first effect that a second run would
// repeat. From then on the request's response is stored and replayed,
// whatever its status and whatever the store policy (WithStorePolicy)
// says: a 5xx (kept for the Keeper's retention), a 401 or a 409 too, and a
// response written after the client went away. A handler that panics after
// it, or that returns after its client went away without having written a
// status, stores a 500 answer of the middleware's own (ProblemExecutionFailed,
// rendered by the error writer, WithErrorWriter) in place of its response;
// a panic still goes on once it is stored, as before ExecutionBegan, so the
// first client sees what net/http does with a panic (the connection ends),
// and its retry gets the stored 500. The handler is not run again for the
// key: the client learns that the request failed, and what to reconcile is
// the API's to say.
//
// Before ExecutionBegan, nothing changes: the store policy
// (WithStorePolicy) decides. Under DefaultStorePolicy a 5xx, a 401, 403,
// 407, 408, 409, 425 or 429 releases the key, and so does a panic or a
// client gone, while a 4xx such as a failed validation's 400 is stored.
// Under SuccessStorePolicy (Stripe's rule) every 4xx before ExecutionBegan
// is released too, so that a request that failed before it began never
// holds its key and the corrected request may use it.
//
// It reports whether ctx belongs to a request the middleware guards and
// runs under a claim; it does nothing and reports false otherwise (a
// method not guarded, a request without a key let through, a handler run
// fail-open, a context not made from a guarded handler's). It may be
// called more than once, and from any goroutine, while the handler runs;
// a call after the handler returned may come too late to count.
func ExecutionBegan(ctx context.Context) bool {
	began, ok := ctx.Value(beganKey{}).(*atomic.Bool)
	if !ok {
		return false
	}
	began.Store(true)
	return true
}

// beganKey is the context key of the flag ExecutionBegan sets.
type beganKey struct{}

// beganContext is a guarded handler's context: the claim's, with the flag
// ExecutionBegan sets. It is a field of the request's capture, so that it
// costs the request no allocation of its own.
type beganContext struct {
	context.Context
	began atomic.Bool
}

// Value returns the flag for beganKey, and asks the claim's context for
// any other key.
func (c *beganContext) Value(key any) any {
	if key == (beganKey{}) {
		return &c.began
	}
	return c.Context.Value(key)
}
