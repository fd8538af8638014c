package idem

import "time"

// The defaults of the root package's options, its bounds, and the timings
// its calls keep to, in one place (DefaultMarkerRetention, beside the
// marker options in compact.go, is the one elsewhere; the other modules
// keep theirs in their options.go). Prose names a default by its constant
// beside the value it spells, the constant in parentheses after it or the
// value after the constant, or is listed in the docs check
// (internal/doccheck, TestDefaultsSpelled), which fails when a value written
// in README.md, docs/ or a doc comment is not its constant's: changing a
// default flags every mention.

// Defaults of a Keeper's durations.
const (
	// DefaultLease is how long a claim may run without renewing its lease.
	//
	// It must stay well above the longest a failed Redis command takes on
	// the client: a renewal (every third of the lease) that fails is tried
	// again within the lease left, and a claim whose answer came late has
	// only the rest of its lease. With go-redis's defaults, a command whose
	// reply does not come fails after ReadTimeout (5s) on each of its 1 +
	// MaxRetries (3) tries, with up to MaxRetryBackoff (1s) between them:
	// about 23s. A client with longer timeouts or more retries needs a
	// longer lease (WithLease).
	DefaultLease = 30 * time.Second
	// DefaultRetention is how long a completed result is kept.
	DefaultRetention = 24 * time.Hour
	// MaxDuration is the longest lease, retention or error retention a
	// Keeper accepts, and the longest retention Claim.Complete accepts: 100
	// years (of 365 days). Longer settings are refused with ErrInvalidConfig.
	// The bound keeps every lease end Redis computes, in microseconds since
	// 1970, exact in a Lua number until the year 2200, and every expiry
	// within Redis's range.
	MaxDuration = 100 * 365 * 24 * time.Hour
)

// DefaultPrefix starts every Redis key of a Keeper unless WithPrefix says
// otherwise.
const DefaultPrefix = "idem:"

// ClusterScopeShards is how many shards a Keeper on a Redis Cluster places
// each scope's keys in when it is made without WithScopeShards: a batch of
// a scope costs a script call a shard a step (at most 16, not one a
// message), and the keys of a hot scope, such as the one scope of an HTTP
// API without tenants, are in 16 slots, which a Cluster of three masters
// spreads over all of them 99.5% of the time (88% with 8 shards). Fewer
// shards cost less a message: batches of 100 ran at 0.59x the hand-written
// loop's messages/s with 8, 0.37x with 16, batches of 500 at 0.63x and
// 0.49x (docs/consumers.md has the figures).
const ClusterScopeShards = 16

// Bounds of ScanOptions.Batch.
const (
	// DefaultScanBatch is the Batch of a Scan that sets none.
	DefaultScanBatch = 100
	// MaxScanBatch is the largest Batch a Scan accepts.
	MaxScanBatch = 1000
)

// The defaults of WithSettleWindow: ten milliseconds is a few round trips
// on a local network, so storing as handlers return costs a batch of quick
// handlers a few store calls more, and a crash re-runs at most what
// returned in that time, or the last 128.
const (
	defaultSettleDelay = 10 * time.Millisecond
	defaultSettleCount = 128
)

// The defaults of a StreamConsumer (NewStreamConsumer).
const (
	// defaultStreamBatch is WithBatchSize's default.
	defaultStreamBatch = 100
	// deadLetterSuffix, after the stream's name, names WithDeadLetter's
	// default stream.
	deadLetterSuffix = ":dead-letter"
	// defaultMaxDeliveries is WithMaxDeliveries' default.
	defaultMaxDeliveries = 5
	// The default of WithIdleConsumerRemoval: the longer of
	// defaultIdleConsumers and idleConsumerLeases leases.
	defaultIdleConsumers = time.Hour
	idleConsumerLeases   = 10
)

// backlogEvery is how often a StreamConsumer reports its backlog
// (StepBacklog), by the Keeper's clock.
const backlogEvery = 10 * time.Second

// streamBlock is how long one XREADGROUP waits for entries: it bounds how
// long Run takes to notice that its context is done while the stream is
// idle.
const streamBlock = time.Second

// A StreamConsumer's Run pauses after a stream command or a Consume that
// failed with ErrUnavailable: runPauseFirst, then twice as long each time,
// up to runPauseCap.
const (
	runPauseFirst = 10 * time.Millisecond
	runPauseCap   = time.Second
)

// cleanupTimeout bounds how long Do spends storing or releasing a claim after
// the operation returned when the caller's context is done by then: the
// operation's side effect has happened, so its outcome is still recorded.
// While the caller's context is live, its deadline does not cut the store
// short either; the Redis client's own timeouts bound it.
const cleanupTimeout = 5 * time.Second

// The patience of a settling the store could not take for want of the
// store (see patientUntil and settleLast): it is tried again
// settleRetryFirst later, then twice as late each time, up to a tenth of
// the lease and at most settleRetryCap, so that an outage costs a batch at
// most a few tries a second and its end is seen within a tenth of the
// lease. A message's patience ends a twentieth of the lease, at most
// settleMarginCap, before its lease does by this process's clock: a try
// started later could hardly have its reply back in time. The try after
// that is its last.
const (
	settleRetryFirst = 10 * time.Millisecond
	settleRetryCap   = time.Second
	settleMarginCap  = 100 * time.Millisecond
)

// Consume with WithWait claims the messages whose key another consumer
// holds again after holderRetryFirst, then twice as long each time, up to
// holderRetryCap (and never later than the holder's hint or the wait's
// end).
const (
	holderRetryFirst = 5 * time.Millisecond
	holderRetryCap   = 250 * time.Millisecond
)

// A batch's script call that a Cluster refused before it ran (TRYAGAIN,
// MOVED, ASK, CLUSTERDOWN) is sent again after tryAgainFirst, then twice as
// long each time up to tryAgainCap, for up to tryAgainPatience
// (resendRedirected).
const (
	tryAgainFirst    = 10 * time.Millisecond
	tryAgainCap      = 200 * time.Millisecond
	tryAgainPatience = 2 * time.Second
)
