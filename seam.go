package idem

import (
	"context"
	"time"

	"github.com/idemkit/idem/internal/keeperhook"
)

// The seam of idem's own layers (idemhttp, idemgrpc, the consumer runners):
// what of a Keeper they read, through internal/integration, without its
// being part of the package's API.
func init() {
	keeperhook.Lease = func(k *Keeper) time.Duration { return k.policy.lease }
	keeperhook.Retention = func(k *Keeper) time.Duration { return k.policy.retention }
	keeperhook.ErrorRetention = func(k *Keeper) time.Duration { return k.policy.errorRetention }
	keeperhook.Observer = func(k *Keeper) Observer { return k.observer }
	keeperhook.Now = func(k *Keeper) time.Time { return k.now() }
	keeperhook.MarkRequest = markRequest
}

// inRequestKey marks the context of a request's claim (markRequest).
type inRequestKey struct{}

// markRequest returns ctx marked as a request's: the claim Begin makes with
// it, and that claim's later steps, are told to the Observer InRequest.
func markRequest(ctx context.Context) context.Context {
	return context.WithValue(ctx, inRequestKey{}, true)
}

// inRequest reports whether ctx is a request's (markRequest).
func inRequest(ctx context.Context) bool { return ctx.Value(inRequestKey{}) != nil }
