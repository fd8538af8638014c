package idem

import (
	"bytes"
	"errors"
	"time"
)

// Compact claims and markers: a batch's claims kept without a Redis key
// each, and what a message handled that way leaves, a marker. This file
// holds the Keeper's options for them (the result a marker's record keeps
// is codec.go's markerEnvelope, beside the other envelopes); the
// redisStore keeps them as redis_compact.go, redis_v3.go and format.go
// ("The v3 layout") say.

// DefaultMarkerRetention is how long a marker answers for a handled
// message unless WithMarkerRetention says otherwise: 7 days.
const DefaultMarkerRetention = 7 * 24 * time.Hour

// WithMarkerRetention sets how long a message handled by Consume is
// remembered: for that long a redelivery is answered "handled before"
// (MessageReplayed) instead of running again. Such a message leaves a
// marker, about 22 bytes in Redis, instead of a record. For as long as the
// retention, Begin and Do answer such a key as completed with an empty
// result; after the retention and within the marker retention they answer
// ErrResultExpired: the operation ran, its result is not kept. It must be at least the retention and at
// most MaxDuration. Default: 7 days (DefaultMarkerRetention), or the
// retention if that is longer. Applies to a Keeper.
func WithMarkerRetention(d time.Duration) Option {
	return Option{name: "WithMarkerRetention", to: toKeeper, set: func(s *settings) { s.policy.markerRetention, s.policy.markerSet = d, true }}
}

// WithoutMarkers turns compact claims off: Consume keeps each message's
// claim and outcome in a record of its own, as Begin does, kept for the
// retention, and a Keeper made with it never claims compactly. It still
// reads the markers and compact claims others left on its prefix, and
// answers them as a Keeper with markers does, so that Keepers with and
// without markers can share a prefix.
// Default: markers on. Applies to a Keeper (NewRedis).
func WithoutMarkers() Option {
	return Option{name: "WithoutMarkers", to: toKeeper | toStore, set: func(s *settings) { s.noMarkers = true }}
}

// withCompactClaims makes batchBegin claim the keys compactly, as Consume
// does: a claim of a key that has no record is kept as an entry in an index
// and a place in one record of the call, and completing it with an empty
// result leaves a marker (see WithMarkerRetention) instead of a record.
// Claims made so share one lease: renewing one renews every one of them the
// call still holds. Completing one with a value, or recording a
// Checkpoint, first moves it to a record of its own (one round trip more).
// Without it (the default) batchBegin keeps each claim in a record of its
// own. It has no effect on a Keeper made WithoutMarkers.
func withCompactClaims() Option {
	return Option{name: "withCompactClaims", to: toBatch, set: func(s *settings) { s.compact = true }}
}

// ErrResultExpired reports a key whose operation completed and whose result
// is no longer kept: all that is left of it is a marker (see
// WithMarkerRetention), past the retention and within the marker retention.
// The operation must not run again, and there is nothing to replay.
var ErrResultExpired = errors.New("idem: the operation completed; its result is no longer kept")

// isEmptyResult reports whether env is the envelope of an empty result of
// Claim.Complete, which a compact claim keeps as a marker.
func isEmptyResult(env []byte) bool { return bytes.Equal(env, emptyBytes) }
