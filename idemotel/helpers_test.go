package idemotel_test

import (
	"context"
	"sync"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// telemetry is an Observer on the SDK's in-memory reader and span recorder.
type telemetry struct {
	obs    *idemotel.Observer
	reader *sdkmetric.ManualReader
	spans  *tracetest.SpanRecorder
	tracer *sdktrace.TracerProvider
}

func newTelemetry(t *testing.T) *telemetry {
	t.Helper()
	tm := &telemetry{reader: sdkmetric.NewManualReader(), spans: tracetest.NewSpanRecorder()}
	tm.tracer = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tm.spans))
	obs, err := idemotel.NewObserver(
		idemotel.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(tm.reader))),
		idemotel.WithTracerProvider(tm.tracer),
	)
	require.NoError(t, err)
	tm.obs = obs
	return tm
}

// metrics collects the metrics, by name.
func (tm *telemetry) metrics(t *testing.T) map[string]metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, tm.reader.Collect(context.Background(), &rm))
	out := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, idemotel.ScopeName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			out[m.Name] = m
		}
	}
	return out
}

// label is "step:result" from a data point's attributes, which must be
// exactly idem.step and idem.result: nothing of higher cardinality.
func label(t *testing.T, set attribute.Set) string {
	t.Helper()
	var keys []string
	for _, kv := range set.ToSlice() {
		keys = append(keys, string(kv.Key))
	}
	require.Equal(t, []string{"idem.result", "idem.step"}, keys)
	step, _ := set.Value("idem.step")
	result, _ := set.Value("idem.result")
	return step.AsString() + ":" + result.AsString()
}

// sums returns a counter's value by step and result.
func sums(t *testing.T, m metricdata.Metrics) map[string]int64 {
	t.Helper()
	sum, ok := m.Data.(metricdata.Sum[int64])
	require.True(t, ok, "%s is a %T", m.Name, m.Data)
	require.True(t, sum.IsMonotonic, m.Name)
	out := map[string]int64{}
	for _, dp := range sum.DataPoints {
		out[label(t, dp.Attributes)] = dp.Value
	}
	return out
}

// histogram returns a histogram's data points by step and result.
func histogram(t *testing.T, m metricdata.Metrics) map[string]metricdata.HistogramDataPoint[float64] {
	t.Helper()
	h, ok := m.Data.(metricdata.Histogram[float64])
	require.True(t, ok, "%s is a %T", m.Name, m.Data)
	out := map[string]metricdata.HistogramDataPoint[float64]{}
	for _, dp := range h.DataPoints {
		out[label(t, dp.Attributes)] = dp
	}
	return out
}

// counts returns each histogram data point's count.
func counts(points map[string]metricdata.HistogramDataPoint[float64]) map[string]int64 {
	out := map[string]int64{}
	for k, dp := range points {
		out[k] = int64(dp.Count)
	}
	return out
}

// spanAttrs returns a span's attributes by key.
func spanAttrs(s sdktrace.ReadOnlySpan) map[string]any {
	out := map[string]any{}
	for _, kv := range s.Attributes() {
		out[string(kv.Key)] = kv.Value.AsInterface()
	}
	return out
}

// spanNames returns the names of spans, with their result, in order.
func spanNames(spans []sdktrace.ReadOnlySpan) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Name()+":"+spanAttrs(s)["idem.result"].(string))
	}
	return out
}

// lastID is an Observer that keeps the record id of the last event, so that
// a test can reach the record in Redis.
type lastID struct {
	mu sync.Mutex
	id string
}

func (l *lastID) Observe(_ context.Context, ev idem.Event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.id = ev.ID
}

// key returns the Redis key of the last event's record.
func (l *lastID) key() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return idem.DefaultPrefix + "{" + l.id + "}"
}
