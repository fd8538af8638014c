// Package idemotel reports what an idem.Keeper does to OpenTelemetry: metrics
// for every step and a span for each, from the Keeper's idem.Observer.
//
//	obs, err := idemotel.NewObserver() // the global MeterProvider and TracerProvider
//	if err != nil { ... }
//	keeper, err := idem.NewRedis(client, idem.WithObserver(obs))
//
// Metrics (attributes idem.step and idem.result only, so that their
// cardinality stays fixed: never the scope, the key or the token):
//
//	idem.steps                  Int64Counter      {step}  every step, by step and result
//	idem.step.duration          Float64Histogram  s       a claim's whole Begin; the store's round trip otherwise
//	idem.in_progress.duration   Float64Histogram  s       how long a claim was held: on complete, release and lease
//	idem.lease.losses           Int64Counter      {loss}  claims that learned they were no longer the holder
//
// The share of replays is idem.steps{idem.step="claim", idem.result="replayed"}
// over idem.steps{idem.step="claim"}; the HTTP middleware's 422s are
// idem.steps{idem.step="request", idem.result="mismatch"} (the middleware
// reports one request step per request, after the steps it took).
//
// Spans: one per step, named idem.claim, idem.complete, idem.release,
// idem.extend, idem.lease, idem.checkpoint, idem.inspect, idem.forget and
// idem.request, a child of the span in the step's context, with
// idem.result, idem.scope, idem.id (the record's digest), idem.token,
// idem.attempt and idem.recovered, and idem.status for a request (the HTTP
// status or gRPC code answered). A step whose result is corrupt,
// unavailable, lease_lost or fail_open ends with status Error and
// error.type set to the result.
//
// TraceAttrs gives idem.SlogObserver the trace and span ids of a call:
//
//	idem.WithObserver(idem.Observers(obs, idem.SlogObserver(logger, idemotel.TraceAttrs)))
//
// Prometheus users get the metrics through OpenTelemetry's Prometheus
// exporter (go.opentelemetry.io/otel/exporters/prometheus) as a Reader of
// the MeterProvider given to WithMeterProvider; docs/observing.md in the
// repository shows it.
package idemotel
