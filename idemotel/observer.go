package idemotel

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/idem"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// ScopeName is the instrumentation scope of the Meter and the Tracer an
// Observer takes from its providers, for Views and queries that select
// idem's metrics.
const ScopeName = "github.com/idemkit/idem/idemotel"

// Observer is an idem.Observer that records every step of a Keeper as
// metrics and a span; see the package documentation for their names. It is
// safe for concurrent use. Make it with NewObserver; the zero Observer is not
// usable.
type Observer struct {
	metrics instruments
	// tracer makes the spans; nil when the TracerProvider is
	// go.opentelemetry.io/otel/trace/noop's, so that no span is started.
	tracer trace.Tracer
	labels labelTable
}

var _ idem.Observer = (*Observer)(nil)

// NewObserver returns an Observer that records to the MeterProvider and
// TracerProvider the options name, by default the global ones. It returns an
// error wrapping idem.ErrInvalidConfig if the MeterProvider refuses one of
// the instruments.
func NewObserver(opts ...Option) (*Observer, error) {
	c := newConfig(opts)
	o := &Observer{labels: newLabelTable()}
	if err := o.metrics.create(c.meters.Meter(ScopeName)); err != nil {
		return nil, fmt.Errorf("%w: idemotel: %w", idem.ErrInvalidConfig, err)
	}
	if _, off := c.tracers.(tracenoop.TracerProvider); !off {
		o.tracer = c.tracers.Tracer(ScopeName)
	}
	return o, nil
}

// Observe records ev: it implements idem.Observer. The step is taken to have
// ended now and started ev.Took earlier; metrics are recorded with ctx, so
// that exemplars link them to the span in it.
func (o *Observer) Observe(ctx context.Context, ev idem.Event) {
	end := time.Now()
	l := o.labels.get(ev.Step, ev.Result)
	o.metrics.record(ctx, ev, l)
	if o.tracer != nil && ev.Step != idem.StepBacklog {
		o.span(ctx, ev, l, end)
	}
}

// instruments are the metrics an Observer records.
type instruments struct {
	steps        metric.Int64Counter
	stepDuration metric.Float64Histogram
	inProgress   metric.Float64Histogram
	leaseLosses  metric.Int64Counter
	// lag and pending are a consumer's backlog (idem.StepBacklog), by
	// idem.scope, and idem.partition where the consumer reports one.
	lag, pending metric.Int64Gauge
}

// Bucket boundaries, in seconds: a step is a Redis round trip (or a claim's
// wait); an operation in progress runs up to its lease and past it.
var (
	stepBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}
	heldBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}
)

// create makes the instruments on m, and returns the errors m reported.
func (in *instruments) create(m metric.Meter) error {
	var errs [6]error
	in.steps, errs[0] = m.Int64Counter("idem.steps", metric.WithUnit("{step}"),
		metric.WithDescription("Steps of an idem Keeper (claim, complete, release, extend, lease, checkpoint, inspect, forget) and requests of the layers on it, by step and result."))
	in.stepDuration, errs[1] = m.Float64Histogram("idem.step.duration", metric.WithUnit("s"),
		metric.WithDescription("How long a step took: a claim's whole Begin, waits included; the store's round trip for the other steps."),
		metric.WithExplicitBucketBoundaries(stepBuckets...))
	in.inProgress, errs[2] = m.Float64Histogram("idem.in_progress.duration", metric.WithUnit("s"),
		metric.WithDescription("How long a claim was held before it was completed, released or found lost: the time its operation was in progress."),
		metric.WithExplicitBucketBoundaries(heldBuckets...))
	in.leaseLosses, errs[3] = m.Int64Counter("idem.lease.losses", metric.WithUnit("{loss}"),
		metric.WithDescription("Claims that learned they were no longer the holder: a completion or release refused, or a lease KeepAlive found lost."))
	in.lag, errs[4] = m.Int64Gauge("idem.consumer.lag", metric.WithUnit("{message}"),
		metric.WithDescription("Entries of a stream not yet delivered to a consumer's group (Redis Streams: XINFO GROUPS lag; JetStream: NumPending), by idem.scope (and idem.partition: Kafka), as the consumer last read it."))
	in.pending, errs[5] = m.Int64Gauge("idem.consumer.pending", metric.WithUnit("{message}"),
		metric.WithDescription("Entries delivered to a consumer's group and not acknowledged (Redis Streams: the group's pending entries; JetStream: NumAckPending), by idem.scope (and idem.partition: Kafka), as the consumer last read it."))
	return errors.Join(errs[:]...)
}

// record records ev on the instruments, with the attributes of l.
func (in *instruments) record(ctx context.Context, ev idem.Event, l *label) {
	in.steps.Add(ctx, 1, l.add...)
	in.stepDuration.Record(ctx, seconds(ev.Took), l.record...)
	if ends(ev.Step) {
		in.inProgress.Record(ctx, seconds(ev.Held), l.record...)
		if ev.Result == idem.ResultLeaseLost {
			in.leaseLosses.Add(ctx, 1, l.add...)
		}
	}
	if ev.Step == idem.StepBacklog && ev.Result == idem.ResultDone {
		set := attribute.NewSet(keyScope.String(ev.Scope))
		if ev.ID != "" {
			set = attribute.NewSet(keyScope.String(ev.Scope), keyPartition.String(ev.ID))
		}
		scope := metric.WithAttributeSet(set)
		if ev.Lag >= 0 {
			in.lag.Record(ctx, ev.Lag, scope)
		}
		in.pending.Record(ctx, ev.Pending, scope)
	}
}

// ends reports whether step ends a claim's hold, or the claim's knowledge
// of it: a completion, a release, or KeepAlive's finding that the lease was
// lost. A renewal refused (StepExtend) is not counted as a lease loss: under
// KeepAlive (Do, the HTTP middleware) a StepLease follows it, and a claim
// extended by hand is refused again when it completes or releases.
func ends(step idem.Step) bool {
	return step == idem.StepComplete || step == idem.StepRelease || step == idem.StepLease
}

// seconds is d in seconds; a negative d (a clock of WithClock that went
// back) counts as 0.
func seconds(d time.Duration) float64 { return max(d, 0).Seconds() }
