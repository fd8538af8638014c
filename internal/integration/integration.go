// Package integration is what idem's own layers on top of a Keeper
// (idemhttp, idemgrpc, idemjetstream, idemkafka, cmd/idembench) read of it
// beyond its public API: its lease and retentions, its Observer, and the
// StepRequest event of a request a layer answers. Only idem's own modules
// can import it, so it may change with the Keeper.
//
// Package idem sets the hooks of internal/keeperhook in its init; this
// package, which imports idem, asserts them to their types once.
package integration

import (
	"context"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/keeperhook"
)

// The hooks, typed. idem is initialized before this package, so they are
// set by then; a missing or mistyped one panics at initialization.
var (
	lease          = keeperhook.Lease.(func(*idem.Keeper) time.Duration)
	retention      = keeperhook.Retention.(func(*idem.Keeper) time.Duration)
	errorRetention = keeperhook.ErrorRetention.(func(*idem.Keeper) time.Duration)
	observer       = keeperhook.Observer.(func(*idem.Keeper) idem.Observer)
	now            = keeperhook.Now.(func(*idem.Keeper) time.Time)
	markRequest    = keeperhook.MarkRequest
)

// Lease returns the lease a claim of k gets (idem.WithLease).
func Lease(k *idem.Keeper) time.Duration { return lease(k) }

// Retention returns how long k keeps completed results
// (idem.WithRetention).
func Retention(k *idem.Keeper) time.Duration { return retention(k) }

// ErrorRetention returns how long k keeps stored errors
// (idem.WithErrorRetention).
func ErrorRetention(k *idem.Keeper) time.Duration { return errorRetention(k) }

// Observer returns k's Observer (idem.WithObserver), or nil when it has
// none. A runner on top of the Keeper (idemjetstream, idemkafka) reports
// its own steps to it (StepStream, StepBacklog), so that one Observer sees
// all, and leaves out what costs something to measure when it is nil.
func Observer(k *idem.Keeper) idem.Observer { return observer(k) }

// Request is the StepRequest event of one request that a layer on top of a
// Keeper answers (idemhttp, idemgrpc), so that one Observer sees every step:
// the Keeper's own as they happen, then the request's. StartRequest begins
// it; the layer claims the request's key with Context (so that the claim's
// steps are told InRequest), fills in Event's Scope, ID, Token, Attempt,
// Recovered and LeaseLeft as it learns them, calls Running when the
// operation starts, and End once it has answered. Without an Observer it
// measures nothing and End does nothing.
type Request struct {
	// Event is the request's event, told to the Observer by End.
	Event        idem.Event
	k            *idem.Keeper // nil: k has no Observer
	ctx          context.Context
	started, ran time.Time
}

// StartRequest begins the StepRequest event of a request to k with ctx,
// the context the Observer is given.
func StartRequest(ctx context.Context, k *idem.Keeper) Request {
	if observer(k) == nil {
		return Request{ctx: ctx}
	}
	return Request{Event: idem.Event{Step: idem.StepRequest}, k: k, ctx: markRequest(ctx), started: now(k)}
}

// Context returns the context to claim the request's key with (Begin): the
// one StartRequest was given, marked, when there is an Observer, so that
// the claim and every later step of it are told InRequest. Give the
// operation a context of its own (Claim.KeepAlive's, from the request's),
// so that calls it makes of a Keeper are not marked.
func (r *Request) Context() context.Context { return r.ctx }

// Observed reports whether End will tell an Observer: what costs something
// to fill in (a record id) need only be filled in then.
func (r *Request) Observed() bool { return r.k != nil }

// Running marks the start of the operation: End reports how long it ran as
// Held.
func (r *Request) Running() {
	if r.k != nil {
		r.ran = now(r.k)
	}
}

// End tells the Observer the request's outcome: result, the status it was
// answered (an HTTP status, a gRPC code; 0 when unknown), and the error
// behind it. Took is the whole request, by the Keeper's clock.
func (r *Request) End(result idem.Result, status int, err error) {
	if r.k == nil {
		return
	}
	ev := r.Event
	ev.Result, ev.Status, ev.Err = result, status, err
	t := now(r.k)
	ev.Took = t.Sub(r.started)
	if !r.ran.IsZero() {
		ev.Held = t.Sub(r.ran)
	}
	observer(r.k).Observe(r.ctx, ev)
}
