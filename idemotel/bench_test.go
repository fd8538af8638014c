package idemotel_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// BenchmarkObserve measures one Observe call: with the global providers and
// none set (what NewObserver() gives a service that has not set up
// OpenTelemetry), with the no-op providers, with the SDK recording metrics
// only, and with the SDK recording metrics and sampled spans.
func BenchmarkObserve(b *testing.B) {
	ev := idem.Event{
		Step: idem.StepComplete, Result: idem.ResultDone, Scope: "tenant", ID: "0123456789abcdefghijkl",
		Token: 42, Attempt: 1, Took: 300 * time.Microsecond, Held: 20 * time.Millisecond,
	}
	for _, c := range []struct {
		name string
		opts []idemotel.Option
	}{
		{"global-unset", nil},
		{"noop", []idemotel.Option{idemotel.WithMeterProvider(noop.NewMeterProvider()), idemotel.WithTracerProvider(tracenoop.NewTracerProvider())}},
		{"sdk-metrics", []idemotel.Option{idemotel.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))), idemotel.WithTracerProvider(tracenoop.NewTracerProvider())}},
		{"sdk-metrics-spans", []idemotel.Option{idemotel.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))), idemotel.WithTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewNoopExporter())))}},
	} {
		b.Run(c.name, func(b *testing.B) {
			obs, err := idemotel.NewObserver(c.opts...)
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				obs.Observe(ctx, ev)
			}
		})
	}
}
