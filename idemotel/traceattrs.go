package idemotel

import (
	"context"
	"log/slog"

	"go.opentelemetry.io/otel/trace"
)

// TraceAttrs returns trace_id and span_id, in hex, of the span in ctx, or
// nil when ctx holds no valid span context. Give it to idem.SlogObserver so
// that each line of a step carries the ids of the trace it belongs to:
//
//	idem.SlogObserver(logger, idemotel.TraceAttrs)
func TraceAttrs(ctx context.Context) []slog.Attr {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return nil
	}
	return []slog.Attr{
		slog.String("trace_id", sc.TraceID().String()),
		slog.String("span_id", sc.SpanID().String()),
	}
}
