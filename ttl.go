package idem

import (
	"fmt"
	"time"
)

// Defaults of a Keeper's durations.
const (
	// DefaultLease is how long a claim may run without renewing its lease.
	DefaultLease = 30 * time.Second
	// DefaultRetention is how long a completed result is kept.
	DefaultRetention = 24 * time.Hour
)

// policy holds the durations a Keeper works with. Every field is a whole
// number of milliseconds, at least one, once New has checked it.
type policy struct {
	// lease is how long a claim stays in progress without proof of life.
	lease time.Duration
	// retention is how long a completed result is kept; it is also how long a
	// pending record is kept, so that an abandoned claim can be recovered.
	// Never shorter than lease.
	retention time.Duration
	// errorRetention is how long a final error (Do) or a stored error
	// response is kept. Zero means retention.
	errorRetention time.Duration
}

func defaultPolicy() policy {
	return policy{lease: DefaultLease, retention: DefaultRetention}
}

// WithLease sets how long a claim may stay in progress without renewal.
// Do renews it in the background every third of the lease while the operation
// runs, so the lease bounds how long a crashed process blocks its key, not how
// long an operation may take. Default: 30s (DefaultLease). It must be at least
// one millisecond and no longer than the retention.
func WithLease(d time.Duration) Option {
	return func(c *config) { c.policy.lease = d }
}

// WithRetention sets how long a completed result is kept and replayed.
// Default: 24h (DefaultRetention). It must be at least the lease.
func WithRetention(d time.Duration) Option {
	return func(c *config) { c.policy.retention = d }
}

// WithErrorRetention sets how long a stored error is kept: a FinalError from
// Do, or what a caller of Claim.Complete classes as an error. Default: the
// retention. It must be at least one millisecond.
func WithErrorRetention(d time.Duration) Option {
	return func(c *config) { c.policy.errorRetention = d }
}

func (p *policy) validate() error {
	if p.lease < time.Millisecond {
		return fmt.Errorf("%w: lease %s is shorter than 1ms", ErrInvalidConfig, p.lease)
	}
	if p.retention < p.lease {
		return fmt.Errorf("%w: retention %s is shorter than the lease %s", ErrInvalidConfig, p.retention, p.lease)
	}
	if p.errorRetention == 0 {
		p.errorRetention = p.retention
	}
	if p.errorRetention < time.Millisecond {
		return fmt.Errorf("%w: error retention %s is shorter than 1ms", ErrInvalidConfig, p.errorRetention)
	}
	return nil
}

// tombstoneTTL is how long a released record keeps its token and attempt
// count: long enough for a retried Release to find it.
func (p *policy) tombstoneTTL() time.Duration { return p.lease }

// millis rounds d up to whole milliseconds, the unit the store works in.
func millis(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}
