package idem

import (
	"context"
	"log/slog"
)

// SlogObserver returns an Observer that logs every step through logger,
// with the attributes idem.step, idem.result, idem.scope, idem.id (the
// record's digest: client keys are never logged), idem.token, idem.attempt,
// idem.recovered, idem.took, and when they are set idem.held,
// idem.lease_left, idem.status (a request's answer), idem.marker (an answer
// from a marker), idem.lag and idem.pending (StepBacklog) and the error.
// Durations (idem.took, idem.held, idem.lease_left) are logged as Go
// duration strings, such as "1.5ms", by every handler alike (JSONHandler
// would print a time.Duration as integer nanoseconds); time.ParseDuration
// reads them back.
//
// Levels: replays, claims, in-progress answers, cancellations and steps
// that went through at Debug; mismatches, invalid keys, bodies over the
// limit and refused requests (client errors), and a consumer name removed
// from its group, at Info; a recovered claim (an earlier attempt may have
// partly run), a lost lease, an unavailable store, a request run unguarded
// for it (fail open) and a dead-lettered entry at Warn; a corrupt record at
// Error. A consumer's backlog (StepBacklog) is logged at Debug.
//
// A request that a layer answers (idemhttp, idemgrpc) writes one line at
// Debug, its own (idem.step "request"): it carries the outcome, the status
// answered, the attempt and the whole request's duration, which the lines
// of its claim and completion would only repeat in part, so those
// (Event.InRequest) are not logged at Debug. At Info and above every step
// is logged, a request's steps too: a recovered claim or a lost lease
// within a request still warns.
//
// The call's context is handed to the logger (Logger.LogAttrs), so a handler
// that reads trace ids from the context (an OpenTelemetry bridge) correlates
// the lines with the trace. contextAttrs, when not nil, adds attributes of
// its own from the context, such as a trace id (idemotel.TraceAttrs) or a
// request id. A nil logger means slog.Default().
func SlogObserver(logger *slog.Logger, contextAttrs func(context.Context) []slog.Attr) Observer {
	if logger == nil {
		logger = slog.Default()
	}
	return ObserverFunc(func(ctx context.Context, ev Event) {
		level := slogLevel(ev)
		if level == slog.LevelDebug && ev.InRequest || !logger.Enabled(ctx, level) {
			return
		}
		attrs := []slog.Attr{
			slog.String("idem.step", ev.Step.String()),
			slog.String("idem.result", ev.Result.String()),
			slog.String("idem.scope", ev.Scope),
			slog.String("idem.id", ev.ID),
			slog.Int64("idem.token", ev.Token),
			slog.Int("idem.attempt", ev.Attempt),
			slog.Bool("idem.recovered", ev.Recovered),
			slog.String("idem.took", ev.Took.String()),
		}
		if ev.Held > 0 {
			attrs = append(attrs, slog.String("idem.held", ev.Held.String()))
		}
		if ev.LeaseLeft > 0 {
			attrs = append(attrs, slog.String("idem.lease_left", ev.LeaseLeft.String()))
		}
		if ev.Status != 0 {
			attrs = append(attrs, slog.Int("idem.status", ev.Status))
		}
		if ev.Marker {
			attrs = append(attrs, slog.Bool("idem.marker", true))
		}
		if ev.Step == StepBacklog {
			attrs = append(attrs, slog.Int64("idem.lag", ev.Lag), slog.Int64("idem.pending", ev.Pending))
		}
		if ev.Err != nil {
			attrs = append(attrs, slog.String("error", ev.Err.Error()))
		}
		if contextAttrs != nil {
			attrs = append(attrs, contextAttrs(ctx)...)
		}
		logger.LogAttrs(ctx, level, "idem "+ev.Step.String()+": "+ev.Result.String(), attrs...)
	})
}

// slogLevel is the level SlogObserver logs ev at.
func slogLevel(ev Event) slog.Level {
	switch ev.Result {
	case ResultCorrupt:
		return slog.LevelError
	case ResultRecovered, ResultLeaseLost, ResultUnavailable, ResultFailOpen, ResultDeadLettered:
		return slog.LevelWarn
	case ResultMismatch, ResultInvalid, ResultTooLarge, ResultRefused, ResultExpired, ResultRemoved:
		return slog.LevelInfo
	}
	return slog.LevelDebug
}
