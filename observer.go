package idem

import (
	"context"
	"strconv"
	"time"
)

// Observer is told of every step a Keeper takes: each claim (Begin, Do,
// Consume), completion, release, lease extension, lease loss, checkpoint,
// inspection and forget, once per call; of every request a layer on
// top of the Keeper answers (idemhttp, idemgrpc: StepRequest); and of
// what a consumer runner (StreamConsumer, idemjetstream) does on its
// broker: dead letters, removed consumer names, its backlog (StepStream,
// StepBacklog). It runs on the caller's goroutine, so it must be quick and
// safe for concurrent use. Set it with WithObserver; without one, nothing is
// measured or reported.
type Observer interface {
	Observe(ctx context.Context, ev Event)
}

// ObserverFunc is a function that is an Observer.
type ObserverFunc func(ctx context.Context, ev Event)

// Observe implements Observer.
func (f ObserverFunc) Observe(ctx context.Context, ev Event) { f(ctx, ev) }

// WithObserver sets the Observers of a Keeper's steps: each event is told
// to each of obs in turn, nil ones skipped. Default: none. Applies to a
// Keeper.
func WithObserver(obs ...Observer) Option {
	return Option{name: "WithObserver", to: toKeeper, set: func(s *settings) { s.observer = observers(obs) }}
}

// observers returns an Observer that tells each of obs in turn, or nil when
// none of obs is set.
func observers(obs []Observer) Observer {
	var set []Observer
	for _, o := range obs {
		if o != nil {
			set = append(set, o)
		}
	}
	switch len(set) {
	case 0:
		return nil
	case 1:
		return set[0]
	}
	return ObserverFunc(func(ctx context.Context, ev Event) {
		for _, o := range set {
			o.Observe(ctx, ev)
		}
	})
}

// Step names what a Keeper did.
type Step uint8

// The steps an Event reports.
const (
	// StepClaim: Begin (or Do) asked for a key.
	StepClaim Step = iota + 1
	// StepComplete: a claim stored its result.
	StepComplete
	// StepRelease: a claim gave the key up.
	StepRelease
	// StepExtend: a claim renewed its lease (Claim.Extend, KeepAlive).
	StepExtend
	// StepLease: KeepAlive found the lease lost (Result is ResultLeaseLost).
	StepLease
	// StepCheckpoint: a claim recorded a checkpoint (Claim.Checkpoint).
	StepCheckpoint
	// StepInspect: Keeper.Inspect read a record (ResultDone, whatever state
	// the record is in).
	StepInspect
	// StepForget: Keeper.Forget removed a record (ResultDone, also when
	// there was none), or was refused (ResultInProgress).
	StepForget
	// StepRequest: a layer on top of the Keeper (the idemhttp middleware,
	// the idemgrpc interceptor) answered a request. It is reported once per
	// request, after the steps the request took, with the request's
	// outcome as Result, the answer as Status, and the whole request as
	// Took.
	StepRequest
	// StepAbandon: Keeper.AbandonRecord ended the lease of a claim known dead
	// (ResultDone, also when there was nothing of its token to abandon).
	StepAbandon
	// StepStream: a consumer of a broker's stream (a StreamConsumer, or a
	// runner on top of the Keeper such as idemjetstream's) acted on the
	// broker. ResultUnavailable: a StreamConsumer could not read or
	// acknowledge entries (with the error; it pauses and tries again), or
	// read its backlog (StepBacklog).
	// ResultDeadLettered: an entry or message was given up on: moved to
	// the dead-letter stream or given to the dead-letter hook, and
	// acknowledged or terminated; Err says why (wrapping ErrInvalidKey,
	// ErrMismatch or ErrCorrupt for a rejection; the handler's last error
	// for one whose deliveries ran out). ResultRemoved: a StreamConsumer
	// removed the name of another consumer of its group, idle and holding
	// nothing (WithIdleConsumerRemoval); ID is that name.
	StepStream
	// StepBacklog: a consumer of a broker's stream read its backlog as
	// the broker counts it, Lag and Pending (ResultDone), so that an
	// Observer can chart them as gauges. A StreamConsumer reports it as Run
	// starts and then every 10 seconds; idemjetstream's Runner as its doc
	// says. Neither reads it when the Keeper has no Observer.
	StepBacklog
)

var stepNames = [...]string{
	StepClaim: "claim", StepComplete: "complete", StepRelease: "release",
	StepExtend: "extend", StepLease: "lease", StepCheckpoint: "checkpoint",
	StepInspect: "inspect", StepForget: "forget", StepRequest: "request",
	StepAbandon: "abandon", StepStream: "stream", StepBacklog: "backlog",
}

// String returns the step's name, such as "claim".
func (s Step) String() string { return name(stepNames[:], int(s), "Step") }

// Result is what a step came to.
type Result uint8

// The results of the steps.
const (
	// ResultClaimed: the caller holds the key, attempt 1 or after a release.
	ResultClaimed Result = iota + 1
	// ResultRecovered: the caller holds the key, taken over from an attempt
	// whose lease ran out (Claim.Recovered).
	ResultRecovered
	// ResultReplayed: the operation had completed; its result was answered.
	ResultReplayed
	// ResultInProgress: another attempt holds a live lease.
	ResultInProgress
	// ResultMismatch: the key was used with another fingerprint.
	ResultMismatch
	// ResultInvalid: the key or an argument was refused; the store was not
	// asked.
	ResultInvalid
	// ResultCorrupt: the record could not be read; nothing was written.
	ResultCorrupt
	// ResultUnavailable: the store could not answer.
	ResultUnavailable
	// ResultCanceled: the caller's context ended first.
	ResultCanceled
	// ResultDone: a completion, release, extension, checkpoint, inspection
	// or forget went through; for StepRequest, the operation ran and its
	// result was stored.
	ResultDone
	// ResultLeaseLost: the claim is no longer the holder.
	ResultLeaseLost
	// ResultReleased (StepRequest): the operation ran and the key was
	// released, so that a retry runs it again.
	ResultReleased
	// ResultFailOpen (StepRequest): the store could not answer and the
	// operation ran unguarded, as the layer was told to (idemhttp's
	// WithFailOpen).
	ResultFailOpen
	// ResultTooLarge (StepRequest): the request was over the layer's size
	// limit; the store was not asked.
	ResultTooLarge
	// ResultRefused: for StepRequest, the layer's scope or key function
	// refused the request; for StepForget, Forget refused to remove a
	// record that holds checkpoints (a *ForgetRefusedError). Err is the
	// error.
	ResultRefused
	// ResultExpired: the operation had completed and its result is no
	// longer kept (ErrResultExpired): only a marker is left.
	ResultExpired
	// ResultDuplicate: the key was given earlier in the same batch
	// (ErrDuplicate); its answer is that of its first place.
	ResultDuplicate
	// ResultDeadLettered (StepStream): an entry or message was given up on
	// and kept aside (a dead-letter stream, a dead-letter hook); Err says
	// why.
	ResultDeadLettered
	// ResultRemoved (StepStream): the name of an idle consumer that held
	// nothing was removed from its group; ID is the name.
	ResultRemoved
)

var resultNames = [...]string{
	ResultClaimed: "claimed", ResultRecovered: "recovered", ResultReplayed: "replayed",
	ResultInProgress: "in_progress", ResultMismatch: "mismatch", ResultInvalid: "invalid",
	ResultCorrupt: "corrupt", ResultUnavailable: "unavailable", ResultCanceled: "canceled",
	ResultDone: "done", ResultLeaseLost: "lease_lost", ResultReleased: "released",
	ResultFailOpen: "fail_open", ResultTooLarge: "too_large", ResultRefused: "refused",
	ResultExpired: "result_expired", ResultDuplicate: "duplicate",
	ResultDeadLettered: "dead_lettered", ResultRemoved: "removed",
}

// String returns the result's name, such as "replayed".
func (r Result) String() string { return name(resultNames[:], int(r), "Result") }

func name(names []string, i int, typ string) string {
	if i > 0 && i < len(names) && names[i] != "" {
		return names[i]
	}
	return typ + "(" + strconv.Itoa(i) + ")"
}

// Event is one step of a Keeper, as an Observer is told of it.
type Event struct {
	Step   Step
	Result Result
	// Scope is the call's scope. ID is the record's id, a digest of (scope,
	// key): the client's key itself is never reported. For StepStream,
	// ResultRemoved, ID is the name of the consumer removed; for
	// StepBacklog, the part of the source the backlog counts where a
	// runner reports one per part (idemkafka: a partition, "orders/3");
	// for the other StepStream and StepBacklog events it is empty.
	Scope, ID string
	// Token, Attempt and Recovered describe the claim (see Claim); for a
	// replay, Token and Attempt are the completing claim's. Zero when there
	// is none.
	Token     int64
	Attempt   int
	Recovered bool
	// LeaseLeft is, for ResultInProgress, the time left on the holder's
	// lease as the store reported it; zero otherwise.
	LeaseLeft time.Duration
	// Marker is set, for a claim, when the answer came from a marker: what
	// a compact claim completed with an empty result leaves (a replay of
	// the empty result, or ResultExpired; see WithMarkerRetention).
	Marker bool
	// Status is, for StepRequest, what the request was answered: an HTTP
	// status (idemhttp), a gRPC code (idemgrpc); for an operation that
	// ran, the status it answered. Zero for the other steps, and for a
	// request whose handler panicked.
	Status int
	// Took is how long the step took: for a claim, the whole of Begin
	// (waits included; a caller coalesced in the process waits for the
	// leader's answer instead of a round trip); for the other steps, the
	// store's round trip.
	Took time.Duration
	// Held is how long the claim had been held, for a completion, a
	// release, a lease loss, and a StepRequest whose operation ran: the
	// time the operation was in progress.
	Held time.Duration
	// Err is the error behind the result, if any.
	Err error
	// Lag and Pending are, for StepBacklog, the consumer's backlog as its
	// broker counts it; zero for the other steps. Lag is how many entries
	// of the stream the consumer group (or JetStream consumer) has not
	// been delivered yet: a Redis stream group's lag (XINFO GROUPS), a
	// JetStream consumer's NumPending, a Kafka partition's records past
	// the runner's last poll of it. It is -1 when the broker does not
	// say: Redis before 7.0, a group whose lag Redis cannot count (entries
	// deleted within its range), miniredis once the group has read. Pending
	// is how many were delivered and are not acknowledged yet: the group's
	// pending entries (XINFO GROUPS' pending, XPENDING's count), a JetStream
	// consumer's NumAckPending, the records of a Kafka partition its
	// runner holds not settled.
	Lag, Pending int64
	// InRequest is set on the steps a Keeper takes for a request that a
	// layer on top of it answers (idemhttp, idemgrpc): the request's claim,
	// its completion or release, its renewals. The request's StepRequest
	// event follows them, with the outcome, the status answered and the
	// whole request's duration, so an Observer that wants one line per
	// request can leave these out at a quiet level (SlogObserver does, at
	// Debug). False for the StepRequest event itself, and for the steps of
	// direct calls (Do, Begin, Consume).
	InRequest bool
}

// CallInfo tells the caller of Do or Begin how its call went: set it with
// WithCallInfo.
type CallInfo struct {
	// Replayed is true when the result was a stored one: the operation did
	// not run in this call.
	Replayed bool
	// Token, Attempt and Recovered describe the claim this call held, or,
	// for a replay, the token of the claim that completed the record.
	Token     int64
	Attempt   int
	Recovered bool
}

// WithCallInfo makes a call of Do or Begin fill in *info once it has its
// answer, so that a caller that cares can tell a replay from a run without
// another signature. Applies to a call.
func WithCallInfo(info *CallInfo) Option {
	return Option{name: "WithCallInfo", to: toCall, call: callValue{field: callInfo, info: info}}
}

// reportRecord tells the Observer, if any, how an Inspect, a Forget or an
// Abandon of the record of (scope, key) went; r is the record as the step
// found it.
func (k *Keeper) reportRecord(ctx context.Context, step Step, scope string, started time.Time, r Record, err error) {
	if k.observer == nil {
		return
	}
	ev := Event{
		Step: step, Result: ResultDone, Scope: scope, ID: r.ID,
		Token: r.Token, Attempt: r.Attempt, Recovered: r.Recovered,
		Took: k.now().Sub(started), Err: err,
	}
	if err != nil {
		ev.Result = errorResult(err)
	}
	if ev.Result == ResultInProgress {
		ev.LeaseLeft = r.LeaseLeft
	}
	k.observer.Observe(ctx, ev)
}

// startStep returns the time a step starts when there is an Observer to
// tell how long it took, else the zero time: without one, nothing is
// measured.
func (k *Keeper) startStep() time.Time {
	if k.observer == nil {
		return time.Time{}
	}
	return k.now()
}

// report tells the Observer, if any, how a step of c went.
func (c *Claim) report(ctx context.Context, step Step, started time.Time, err error) {
	k := c.k
	if k.observer == nil {
		return
	}
	now := k.now()
	ev := Event{
		Step: step, Result: ResultDone, Scope: c.scope, ID: c.id,
		Token: c.token, Attempt: c.attempt, Recovered: c.recovered,
		Took: now.Sub(started), Err: err, InRequest: c.inRequest,
	}
	if err != nil {
		ev.Result = errorResult(err)
	}
	if step == StepComplete || step == StepRelease || step == StepLease {
		ev.Held = now.Sub(c.claimedAt)
	}
	k.observer.Observe(ctx, ev)
}

// ResultOf is the Result an Observer is told for err, an error of a
// Keeper's call (Begin, Do, Complete, Release, Extend, Checkpoint, Inspect,
// Forget): ResultDone for nil. A layer on top of a Keeper uses it to report
// its requests (StepRequest) in the Keeper's own terms.
func ResultOf(err error) Result {
	if err == nil {
		return ResultDone
	}
	return errorResult(err)
}
