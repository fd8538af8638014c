package idemotel

import (
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Option configures NewObserver.
type Option func(*config)

// config is what the options set.
type config struct {
	meters  metric.MeterProvider
	tracers trace.TracerProvider
}

func newConfig(opts []Option) config {
	var c config
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	if c.meters == nil {
		c.meters = otel.GetMeterProvider()
	}
	if c.tracers == nil {
		c.tracers = otel.GetTracerProvider()
	}
	return c
}

// WithMeterProvider sets where the metrics go. Default (and nil): the global
// MeterProvider, otel.GetMeterProvider(), which records nothing until one is
// set with otel.SetMeterProvider. For spans only, pass
// go.opentelemetry.io/otel/metric/noop.NewMeterProvider().
func WithMeterProvider(p metric.MeterProvider) Option {
	return func(c *config) { c.meters = p }
}

// WithTracerProvider sets where the spans go. Default (and nil): the global
// TracerProvider, otel.GetTracerProvider(), which records nothing until one
// is set with otel.SetTracerProvider. For metrics only, pass
// go.opentelemetry.io/otel/trace/noop.NewTracerProvider().
func WithTracerProvider(p trace.TracerProvider) Option {
	return func(c *config) { c.tracers = p }
}
