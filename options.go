package idem

import (
	"fmt"
	"time"
)

// Option configures a Keeper (NewRedis) or one call (Begin, Do). Each option says in its documentation
// what it applies to; given where it does not apply, it is refused with
// ErrInvalidConfig (by a call, before the store is touched).
type Option struct {
	name string
	to   target
	set  func(*settings)
	// call holds the value of an option of a call, which a call reads
	// without a settings: through set, a settings escapes to the heap.
	call callValue
}

// callValue is the value of WithFingerprint, WithWait or WithCallInfo.
type callValue struct {
	field       callField
	fingerprint []byte
	wait        time.Duration
	info        *CallInfo
}

// callField names the field of a callValue an option sets.
type callField uint8

const (
	callNone callField = iota
	callFingerprint
	callWait
	callInfo
)

// setOn sets v on c.
func (v *callValue) setOn(c *call) {
	switch v.field {
	case callFingerprint:
		c.fingerprint = v.fingerprint
	case callWait:
		c.wait = v.wait
	case callInfo:
		c.info = v.info
	}
}

// target is the set of things an Option applies to.
type target uint8

const (
	toKeeper target = 1 << iota
	toStore
	toCall
	toBatch   // batchBegin and Consume
	toConsume // Consume only
	toStream  // a StreamConsumer
)

// settings gathers what options set; each constructor or call reads its own
// part.
type settings struct {
	// Keeper.
	policy   policy
	codec    Codec
	coalesce bool
	now      func() time.Time
	observer Observer
	// replayCache is WithReplayCache's bounds; nil: no cache.
	replayCache *replayCacheConfig
	// redisStore.
	prefix   string
	replicas *durability
	// noMarkers is set by WithoutMarkers, for a Keeper and a redisStore.
	noMarkers bool
	// A call; its wait is also a Keeper's default for its calls.
	call
	// scopeShards is WithScopeShards' n, for a Keeper, when scopeShardsSet;
	// else the Keeper takes its store's default (see defaultScopeShards).
	scopeShards    int
	scopeShardsSet bool
	waitSet        bool
	// A batch call (batch.go, consume.go). compact is withCompactClaims.
	fingerprints [][]byte
	concurrency  int
	compact      bool
	// Consume's settle window, when settleSet (WithSettleWindow).
	settleDelay time.Duration
	settleCount int
	settleSet   bool
	// A StreamConsumer (stream.go); maxDeliveriesSet tells a
	// WithMaxDeliveries, idleConsumersSet a WithIdleConsumerRemoval.
	batchSize        int
	deadLetter       string
	maxDeliveries    int
	maxDeliveriesSet bool
	idleConsumers    time.Duration
	idleConsumersSet bool
	// panicAsError, set by a StreamConsumer and by no Option, makes a
	// handler's panic in Consume its message's failure (an error holding
	// the panic's value and stack) instead of the batch's, raised again.
	panicAsError bool
}

func defaultSettings() settings {
	return settings{policy: defaultPolicy(), codec: msgpackCodec{}, now: time.Now, prefix: DefaultPrefix}
}

// apply sets opts on s, refusing an option that does not apply to what
// (the constructor or call named by who).
func (s *settings) apply(what target, who string, opts []Option) error {
	for i := range opts {
		o := &opts[i]
		if apply, err := o.appliesTo(what, who); !apply {
			if err != nil {
				return err
			}
			continue
		}
		if o.set != nil {
			o.set(s)
		}
		o.call.setOn(&s.call)
		s.waitSet = s.waitSet || o.call.field == callWait
	}
	return nil
}

// appliesTo reports whether o applies to what (the constructor or call
// named by who): false and nil for the zero Option, which sets nothing;
// false and an error wrapping ErrInvalidConfig for an option of something
// else.
func (o *Option) appliesTo(what target, who string) (bool, error) {
	switch {
	case o.to == 0:
		return false, nil
	case o.to&what == 0:
		return false, fmt.Errorf("%w: %s does not apply to %s", ErrInvalidConfig, o.name, who)
	}
	return true, nil
}

// WithFingerprint binds one call of Begin or Do to a digest of its request
// (for example a hash of the body). A later call with the same key and
// another fingerprint gets ErrMismatch instead of a replay. Default: none,
// and every call with the key matches every other call without one.
// Applies to a call.
func WithFingerprint(fp []byte) Option {
	return Option{name: "WithFingerprint", to: toCall, call: callValue{field: callFingerprint, fingerprint: fp}}
}

// WithWait makes a call that finds the operation in progress wait for its
// result, up to d and within the context, instead of returning
// ErrInProgress at once. If the other attempt releases its claim or loses its
// lease meanwhile, the waiting call claims the key and runs the operation
// itself. Given to New or NewRedis it is the default of every call, which a
// call's own WithWait replaces (WithWait(0): no waiting). Default: 0, no
// waiting. It must not be negative. Applies to a Keeper and to a call; to
// Consume, whose wait is its own (see Consume); and to a StreamConsumer
// (default there: its lease).
func WithWait(d time.Duration) Option {
	return Option{name: "WithWait", to: toKeeper | toCall | toConsume | toStream, call: callValue{field: callWait, wait: d}}
}

// WithClock sets the clock the Keeper reads: when a claim's lease runs out by
// this process's view (KeepAlive, WithCoalescing) and how long a call waits.
// Redis's own clock still decides leases and expiry in Redis. Tests use it
// with a clock they move together with Redis's (see package idemtest).
// Default: time.Now. Applies to a Keeper.
func WithClock(now func() time.Time) Option {
	return Option{name: "WithClock", to: toKeeper, set: func(s *settings) { s.now = now }}
}
