package idem

import (
	"context"
)

type claimKey struct{}

// ClaimFromContext returns the Claim that Do or the HTTP middleware put in
// the context of the operation or handler it runs, and whether there is one.
func ClaimFromContext(ctx context.Context) (*Claim, bool) {
	c, ok := ctx.Value(claimKey{}).(*Claim)
	return c, ok
}

// ContextWithClaim returns a copy of ctx that carries c, for
// ClaimFromContext.
func ContextWithClaim(ctx context.Context, c *Claim) context.Context {
	return context.WithValue(ctx, claimKey{}, c)
}
