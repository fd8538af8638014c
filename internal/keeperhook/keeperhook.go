// Package keeperhook is the seam between package idem and its own layers
// (idemhttp, idemgrpc, the consumer runners): what of a Keeper they read
// that is no part of idem's public API. Package idem sets every variable
// here in its init, so they are set before any package that imports idem
// runs; nothing else sets them.
//
// This package cannot import idem (idem imports it), so a hook whose
// signature names idem's types is held as any, its type given in its
// comment, as grpc-go's internal package does. Do not call these hooks:
// package internal/integration asserts them to their types once and is the
// typed API the layers use.
package keeperhook

import "context"

var (
	// Lease is func(*idem.Keeper) time.Duration: the lease a claim of the
	// Keeper gets (WithLease).
	Lease any
	// Retention is func(*idem.Keeper) time.Duration: how long the Keeper
	// keeps completed results (WithRetention).
	Retention any
	// ErrorRetention is func(*idem.Keeper) time.Duration: how long the
	// Keeper keeps stored errors (WithErrorRetention).
	ErrorRetention any
	// Observer is func(*idem.Keeper) idem.Observer: the Keeper's Observer
	// (WithObserver), nil when it has none.
	Observer any
	// Now is func(*idem.Keeper) time.Time: the time by the Keeper's clock
	// (WithClock).
	Now any
	// MarkRequest returns ctx marked as the context of a request a layer
	// answers: the steps a Keeper takes with it (a claim, and that claim's
	// later steps) are told to its Observer with Event.InRequest set.
	MarkRequest func(ctx context.Context) context.Context
)
