package idem

import (
	"fmt"
	"math"
	"time"
)

// policy holds the durations a Keeper works with. Every field is a whole
// number of milliseconds, at least one, once New has checked it.
type policy struct {
	// lease is how long a claim stays in progress without proof of life.
	lease time.Duration
	// retention is how long a completed result is kept; it is also how long
	// a pending record is kept after its lease ends, so that an abandoned
	// claim can be recovered (see pendingKeep). Never shorter than lease.
	retention time.Duration
	// errorRetention is how long a final error (Do) or a stored error
	// response is kept. Zero means retention.
	errorRetention time.Duration
	// markerRetention is how long a marker answers (WithMarkerRetention),
	// at least the retention; zero until validate, when WithMarkerRetention
	// was not given (markerSet), for the longer of DefaultMarkerRetention
	// and the retention.
	markerRetention time.Duration
	markerSet       bool
}

func defaultPolicy() policy {
	return policy{lease: DefaultLease, retention: DefaultRetention}
}

// WithLease sets how long a claim may stay in progress without renewal.
// Do renews it in the background every third of the lease while the operation
// runs, so the lease bounds how long a crashed process blocks its key, not how
// long an operation may take. Default: 30s (DefaultLease). It must be at least
// one millisecond, no longer than the retention, and at most MaxDuration.
// Applies to a Keeper, and to one call of Consume, whose claims then have
// this lease instead of the Keeper's (a batch whose handlers take longer,
// say, on a Keeper shared with quick requests), and to a StreamConsumer.
func WithLease(d time.Duration) Option {
	return Option{name: "WithLease", to: toKeeper | toConsume | toStream, set: func(s *settings) { s.policy.lease = d }}
}

// WithRetention sets how long a completed result is kept and replayed.
// An abandoned claim (its holder crashed) is remembered for as long after its
// lease ran out, so that the attempt that takes it over is told so
// (Claim.Recovered). Default: 24h (DefaultRetention). It must be at least the
// lease and at most MaxDuration. Applies to a Keeper.
func WithRetention(d time.Duration) Option {
	return Option{name: "WithRetention", to: toKeeper, set: func(s *settings) { s.policy.retention = d }}
}

// WithErrorRetention sets how long a stored error is kept: a FinalError from
// Do, or what a caller of Claim.Complete classes as an error. Default: the
// retention. It must be at least one millisecond and at most MaxDuration.
// Applies to a Keeper.
func WithErrorRetention(d time.Duration) Option {
	return Option{name: "WithErrorRetention", to: toKeeper, set: func(s *settings) { s.policy.errorRetention = d }}
}

func (p *policy) validate() error {
	for _, d := range [...]struct {
		name string
		d    time.Duration
	}{{"lease", p.lease}, {"retention", p.retention}, {"error retention", p.errorRetention}, {"marker retention", p.markerRetention}} {
		if d.d > MaxDuration {
			return fmt.Errorf("%w: %s %s is longer than MaxDuration (%s)", ErrInvalidConfig, d.name, d.d, MaxDuration)
		}
	}
	if p.lease < time.Millisecond {
		return fmt.Errorf("%w: lease %s is shorter than 1ms", ErrInvalidConfig, p.lease)
	}
	if p.retention < p.lease {
		return fmt.Errorf("%w: retention %s is shorter than the lease %s", ErrInvalidConfig, p.retention, p.lease)
	}
	if !p.markerSet {
		p.markerRetention = max(DefaultMarkerRetention, p.retention)
	}
	if p.markerRetention < p.retention {
		return fmt.Errorf("%w: marker retention %s is shorter than the retention %s", ErrInvalidConfig, p.markerRetention, p.retention)
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

// pendingKeep is how long a pending record is kept from its claim or last
// renewal: its lease, then the retention, so that whatever the settings, an
// abandoned claim is still there to be recovered (Recovered, Attempt) when
// its lease has run out. Both are at most MaxDuration, so the sum fits.
func (p *policy) pendingKeep() time.Duration { return p.lease + p.retention }

// millis rounds d up to whole milliseconds, the unit the store works in. It
// saturates instead of overflowing: the longest duration there is stays the
// longest.
func millis(d time.Duration) int64 {
	if d > math.MaxInt64-time.Millisecond {
		return math.MaxInt64 / int64(time.Millisecond)
	}
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}
