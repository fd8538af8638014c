package idem

import (
	"context"
)

type claimKey struct{}

// ClaimFromContext returns the Claim that Do, Consume, KeepAlive, the HTTP
// middleware or the gRPC interceptor put in the context of the operation or
// handler it runs, and whether there is one. Where there is none (a route
// the middleware does not guard, a request it passed through without a key
// or ran fail-open, a context of the caller's own), it returns nil and
// false; the nil Claim is still safe to call (see Claim).
func ClaimFromContext(ctx context.Context) (*Claim, bool) {
	c, _ := ctx.Value(claimKey{}).(*Claim)
	return c, c != nil
}
