package idemotel_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sort"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// Count a Keeper's steps with OpenTelemetry. A ManualReader collects the
// metrics here; in a service the MeterProvider's reader is an exporter
// (OTLP, Prometheus), and spans go to the SDK's TracerProvider.
func ExampleNewObserver() {
	client, done := newClient()
	defer done()

	reader := sdkmetric.NewManualReader()
	obs, err := idemotel.NewObserver(
		idemotel.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))),
		idemotel.WithTracerProvider(tracenoop.NewTracerProvider()), // metrics only
	)
	if err != nil {
		panic(err)
	}
	keeper, err := idem.NewRedis(client, idem.WithObserver(obs))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	for range 3 {
		_, _ = idem.Do(ctx, keeper, "tenant-1", "order-7", func(context.Context) (string, error) { return "shipped", nil })
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		panic(err)
	}
	for _, m := range rm.ScopeMetrics[0].Metrics {
		for _, p := range points(m) {
			fmt.Println(m.Name, p)
		}
	}
	// Output:
	// idem.steps claim:claimed 1
	// idem.steps claim:replayed 2
	// idem.steps complete:done 1
	// idem.step.duration claim:claimed 1 in s
	// idem.step.duration claim:replayed 2 in s
	// idem.step.duration complete:done 1 in s
	// idem.in_progress.duration complete:done 1 in s
}

// Log every step with log/slog, with the trace and span ids of the call's
// context: here a span context as a tracing middleware (otelhttp) puts in a
// request's context.
func ExampleTraceAttrs() {
	client, done := newClient()
	defer done()

	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		Level: slog.LevelDebug,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			switch a.Key { // keep the example's output short and fixed
			case "level", "msg", "idem.result", "trace_id", "span_id":
				return a
			}
			return slog.Attr{}
		},
	}))
	keeper, err := idem.NewRedis(client, idem.WithObserver(idem.SlogObserver(logger, idemotel.TraceAttrs)))
	if err != nil {
		panic(err)
	}
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36},
		SpanID:     trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
		TraceFlags: trace.FlagsSampled,
	}))
	for range 2 {
		_, _ = idem.Do(ctx, keeper, "tenant-1", "order-8", func(context.Context) (int, error) { return 42, nil })
	}
	// Output:
	// level=DEBUG msg="idem claim: claimed" idem.result=claimed trace_id=4bf92f3577b34da6a3ce929d0e0e4736 span_id=00f067aa0ba902b7
	// level=DEBUG msg="idem complete: done" idem.result=done trace_id=4bf92f3577b34da6a3ce929d0e0e4736 span_id=00f067aa0ba902b7
	// level=DEBUG msg="idem claim: replayed" idem.result=replayed trace_id=4bf92f3577b34da6a3ce929d0e0e4736 span_id=00f067aa0ba902b7
}

// newClient returns a client of an embedded Redis (in a service: your
// Redis), and a function that closes both.
func newClient() (*redis.Client, func()) {
	server, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	client := redis.NewClient(&redis.Options{Addr: server.Addr()})
	return client, func() {
		client.Close()
		server.Close()
	}
}

// points describes a metric's data points: step and result, and the count
// (for a histogram, how many values were recorded, and their unit).
func points(m metricdata.Metrics) []string {
	var out []string
	switch data := m.Data.(type) {
	case metricdata.Sum[int64]:
		for _, dp := range data.DataPoints {
			out = append(out, fmt.Sprintf("%s %d", stepResult(dp.Attributes), dp.Value))
		}
	case metricdata.Histogram[float64]:
		for _, dp := range data.DataPoints {
			out = append(out, fmt.Sprintf("%s %d in %s", stepResult(dp.Attributes), dp.Count, m.Unit))
		}
	}
	sort.Strings(out)
	return out
}

// stepResult is "step:result" from a data point's attributes.
func stepResult(set attribute.Set) string {
	step, _ := set.Value("idem.step")
	result, _ := set.Value("idem.result")
	return step.AsString() + ":" + result.AsString()
}
