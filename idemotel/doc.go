// Package idemotel reports what an idem.Keeper does to OpenTelemetry: metrics
// for every step and a span for each, from the Keeper's idem.Observer.
//
//	obs, err := idemotel.NewObserver() // the global MeterProvider and TracerProvider
//	if err != nil { ... }
//	keeper, err := idem.NewRedis(client, idem.WithObserver(obs))
//
// Metrics of the steps (attributes idem.step and idem.result only, so that
// their cardinality stays fixed: never the scope, the key or the token):
//
//	idem.steps                  Int64Counter      {step}  every step, by step and result
//	idem.step.duration          Float64Histogram  s       a claim's whole Begin; the store's round trip otherwise
//	idem.in_progress.duration   Float64Histogram  s       how long a claim was held: on complete, release and lease
//	idem.lease.losses           Int64Counter      {loss}  claims that learned they were no longer the holder
//
// A consumer of a broker's stream (idem.StreamConsumer, idemjetstream's
// Runner) reports its backlog (idem.StepBacklog) as it starts and then
// every 10 seconds (idemjetstream's also after each idle wait); each
// report sets two gauges, whose one attribute is idem.scope, the
// consumer's scope (a Redis stream's "<stream> <group>", the scope given
// to idemjetstream.New): one series per consumer group, however many
// processes run it. idemkafka's Runner reports each partition it holds
// records of, at its first poll that brings records and then at most
// every 10 seconds; its gauges carry idem.partition too ("orders/3"):
// one series per partition.
//
//	idem.consumer.lag           Int64Gauge        {message}  entries not yet delivered to the group (XINFO GROUPS lag; JetStream NumPending)
//	idem.consumer.pending       Int64Gauge        {message}  entries delivered and not acknowledged (the group's pending; JetStream NumAckPending)
//
// A lag the broker does not give (Redis before 7.0, miniredis) is not
// recorded. Dead letters and removed consumer names are counted by
// idem.steps: idem.steps{idem.step="stream", idem.result="dead_lettered"}
// (a Streams entry moved to the dead-letter stream, a JetStream message
// given to the dead-letter hook and terminated) and
// idem.steps{idem.step="stream", idem.result="removed"} (an idle consumer
// name removed from a Streams group).
//
// The share of replays is idem.steps{idem.step="claim", idem.result="replayed"}
// over idem.steps{idem.step="claim"}; the HTTP middleware's 422s are
// idem.steps{idem.step="request", idem.result="mismatch"} (the middleware
// reports one request step per request, after the steps it took).
//
// Spans: one per step but the backlog reports, named idem.claim,
// idem.complete, idem.release, idem.extend, idem.lease, idem.checkpoint,
// idem.inspect, idem.forget, idem.request and idem.stream, a child of the span in the step's context, with
// idem.result, idem.scope, idem.id (the record's digest), idem.token,
// idem.attempt and idem.recovered, and idem.status for a request (the HTTP
// status or gRPC code answered). A step whose result is corrupt,
// unavailable, lease_lost or fail_open ends with status Error and
// error.type set to the result.
//
// TraceAttrs gives idem.SlogObserver the trace and span ids of a call:
//
//	idem.WithObserver(obs, idem.SlogObserver(logger, idemotel.TraceAttrs))
//
// Prometheus users get the metrics through OpenTelemetry's Prometheus
// exporter (go.opentelemetry.io/otel/exporters/prometheus) as a Reader of
// the MeterProvider given to WithMeterProvider; docs/observing.md in the
// repository shows it.
package idemotel
