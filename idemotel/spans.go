package idemotel

import (
	"context"
	"time"

	"github.com/idemkit/idem"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// span records ev as a span that ended at end and started ev.Took before,
// a child of the span in ctx. Attributes and the end time are given only
// to a span that records.
func (o *Observer) span(ctx context.Context, ev idem.Event, l *label, end time.Time) {
	_, span := o.tracer.Start(ctx, l.span, trace.WithTimestamp(end.Add(-max(ev.Took, 0))))
	if !span.IsRecording() {
		span.End()
		return
	}
	span.SetAttributes(spanAttributes(ev, l)...)
	if failed(ev.Result) {
		span.SetAttributes(keyErrorType.String(ev.Result.String()))
		span.SetStatus(codes.Error, errorText(ev))
	}
	span.End(trace.WithTimestamp(end))
}

// spanAttributes are the attributes of ev's span: the result, scope and
// record id always; the status a request was answered (StepRequest); the token when there is one (for a replay, the
// completing claim's); the attempt and whether it recovered when the call
// held a claim; idem.marker for an answer from a marker.
func spanAttributes(ev idem.Event, l *label) []attribute.KeyValue {
	attrs := []attribute.KeyValue{l.result, keyScope.String(ev.Scope), keyID.String(ev.ID)}
	if ev.Token != 0 {
		attrs = append(attrs, keyToken.Int64(ev.Token))
	}
	if ev.Attempt != 0 {
		attrs = append(attrs, keyAttempt.Int(ev.Attempt), keyRecovered.Bool(ev.Recovered))
	}
	if ev.Status != 0 {
		attrs = append(attrs, keyStatus.Int(ev.Status))
	}
	if ev.Marker {
		attrs = append(attrs, keyMarker.Bool(true))
	}
	return attrs
}

// failed reports whether a result is a failure of the system, whose span
// ends with status Error: a corrupt record, an unavailable store (also
// when a request ran unguarded for it), a lost lease. A client's error (mismatch, invalid key), an answer (in progress)
// and the caller's own cancellation are not.
func failed(r idem.Result) bool {
	return r == idem.ResultCorrupt || r == idem.ResultUnavailable || r == idem.ResultLeaseLost || r == idem.ResultFailOpen
}

// errorText is the status description of a failed step.
func errorText(ev idem.Event) string {
	if ev.Err != nil {
		return ev.Err.Error()
	}
	return ev.Result.String()
}
