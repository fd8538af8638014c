package idemotel_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/idemtest"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
)

// Every step of every path is counted once by step and result, timed, and
// recorded as a span; lease losses count once per lost claim.
func TestObserverRecordsEveryStep(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		tm := newTelemetry(t)
		last := &lastID{}
		observer := idem.WithObserver(tm.obs, last)
		k, err := idem.NewRedis(b.Client, observer, idem.WithLease(time.Minute), idem.WithRetention(time.Minute))
		require.NoError(t, err)
		// A lease short enough for KeepAlive to renew it during a Do.
		short, err := idem.NewRedis(b.Client, observer, idem.WithLease(300*time.Millisecond), idem.WithRetention(time.Minute))
		require.NoError(t, err)

		// First call, replay, mismatch.
		out, err := k.Begin(ctx, "s", "a", idem.WithFingerprint([]byte("1")))
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))
		_, err = k.Begin(ctx, "s", "a", idem.WithFingerprint([]byte("1")))
		require.NoError(t, err)
		_, err = k.Begin(ctx, "s", "a", idem.WithFingerprint([]byte("2")))
		require.ErrorIs(t, err, idem.ErrMismatch)

		// In progress, then released.
		out, err = k.Begin(ctx, "s", "b")
		require.NoError(t, err)
		_, err = k.Begin(ctx, "s", "b")
		require.ErrorIs(t, err, idem.ErrInProgress)
		require.NoError(t, out.Claim.Release(ctx))

		// A claim whose record is gone: its renewal and its completion are
		// refused; one lease loss.
		out, err = k.Begin(ctx, "s", "c")
		require.NoError(t, err)
		require.NoError(t, b.Client.Del(ctx, last.key()).Err())
		require.ErrorIs(t, out.Claim.Extend(ctx), idem.ErrLeaseLost)
		require.ErrorIs(t, out.Claim.Complete(ctx, []byte("late"), 0), idem.ErrLeaseLost)

		// A Do, then its replay.
		for range 2 {
			v, err := idem.Do(ctx, k, "s", "d", func(context.Context) (int, error) { return 7, nil })
			require.NoError(t, err)
			require.Equal(t, 7, v)
		}

		// A Do whose KeepAlive finds the lease lost: one lease loss.
		_, err = idem.Do(ctx, short, "s", "lost", func(ctx context.Context) (int, error) {
			if err := b.Client.Del(ctx, last.key()).Err(); err != nil {
				return 0, err
			}
			select { // cancelled at the next renewal, a third of the lease on
			case <-ctx.Done():
			case <-time.After(30 * time.Second):
			}
			return 0, nil
		})
		require.ErrorIs(t, err, idem.ErrLeaseLost)

		// Refused before Redis, by the caller, and by Redis.
		_, err = k.Begin(ctx, "s", "")
		require.ErrorIs(t, err, idem.ErrInvalidKey)
		canceled, cancel := context.WithCancel(ctx)
		cancel()
		_, err = k.Begin(canceled, "s", "e")
		require.ErrorIs(t, err, context.Canceled)
		_, err = k.Begin(ctx, "s", "f")
		require.NoError(t, err)
		require.NoError(t, b.Client.Set(ctx, last.key(), "garbage", 0).Err())
		_, err = k.Begin(ctx, "s", "f")
		require.ErrorIs(t, err, idem.ErrCorrupt)
		b.Stop()
		_, err = k.Begin(ctx, "s", "g")
		require.ErrorIs(t, err, idem.ErrUnavailable)

		steps := map[string]int64{
			"claim:claimed": 6, "claim:replayed": 2, "claim:mismatch": 1, "claim:in_progress": 1,
			"claim:invalid": 1, "claim:canceled": 1, "claim:corrupt": 1, "claim:unavailable": 1,
			"complete:done": 2, "complete:lease_lost": 1, "release:done": 1,
			"extend:lease_lost": 2, "lease:lease_lost": 1,
		}
		m := tm.metrics(t)
		assert.Equal(t, steps, sums(t, m["idem.steps"]))
		assert.Equal(t, steps, counts(histogram(t, m["idem.step.duration"])))
		assert.Equal(t, map[string]int64{"complete:done": 2, "complete:lease_lost": 1, "release:done": 1, "lease:lease_lost": 1},
			counts(histogram(t, m["idem.in_progress.duration"])))
		assert.Equal(t, map[string]int64{"complete:lease_lost": 1, "lease:lease_lost": 1}, sums(t, m["idem.lease.losses"]))
		for name, unit := range map[string]string{"idem.steps": "{step}", "idem.step.duration": "s", "idem.in_progress.duration": "s", "idem.lease.losses": "{loss}"} {
			assert.Equal(t, unit, m[name].Unit, name)
			assert.NotEmpty(t, m[name].Description, name)
		}

		spans := tm.spans.Ended()
		var total int64
		for _, n := range steps {
			total += n
		}
		require.Len(t, spans, int(total), "one span per step")
		assert.Equal(t, []string{"idem.claim:claimed", "idem.complete:done", "idem.claim:replayed", "idem.claim:mismatch"}, spanNames(spans[:4]))
		for _, s := range spans {
			attrs := spanAttrs(s)
			result := attrs["idem.result"].(string)
			assert.Equal(t, "s", attrs["idem.scope"], s.Name())
			switch result {
			case "corrupt", "unavailable", "lease_lost":
				assert.Equal(t, codes.Error, s.Status().Code, s.Name())
				assert.NotEmpty(t, s.Status().Description, s.Name())
				assert.Equal(t, result, attrs["error.type"], s.Name())
			default:
				assert.Equal(t, codes.Unset, s.Status().Code, s.Name()+":"+result)
				assert.NotContains(t, attrs, "error.type", s.Name())
			}
			assert.False(t, s.EndTime().Before(s.StartTime()), s.Name())
			assert.False(t, s.Parent().IsValid(), "no span in the context: a root span")
		}
	})
}

// The attributes of a claim's span, a replay's and a completion's.
func TestSpanAttributes(t *testing.T) {
	tm := newTelemetry(t)
	k, _ := idemtest.New(t, idem.WithObserver(tm.obs))
	ctx := context.Background()
	out, err := k.Begin(ctx, "tenant", "k")
	require.NoError(t, err)
	require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))
	_, err = k.Begin(ctx, "tenant", "k")
	require.NoError(t, err)

	spans := tm.spans.Ended()
	require.Equal(t, []string{"idem.claim:claimed", "idem.complete:done", "idem.claim:replayed"}, spanNames(spans))
	claimed := spanAttrs(spans[0])
	id := claimed["idem.id"]
	assert.Len(t, id, 22, "the record's digest, never the key")
	token := out.Claim.Token()
	assert.Equal(t, map[string]any{
		"idem.result": "claimed", "idem.scope": "tenant", "idem.id": id,
		"idem.token": token, "idem.attempt": int64(1), "idem.recovered": false,
	}, claimed)
	assert.Equal(t, map[string]any{
		"idem.result": "done", "idem.scope": "tenant", "idem.id": id,
		"idem.token": token, "idem.attempt": int64(1), "idem.recovered": false,
	}, spanAttrs(spans[1]))
	assert.Equal(t, map[string]any{
		"idem.result": "replayed", "idem.scope": "tenant", "idem.id": id, "idem.token": token,
		"idem.attempt": int64(1), "idem.recovered": false,
	}, spanAttrs(spans[2]), "a replay names the completing claim: its token and attempt")
}

// A claim taken over after its lease ran out says so on its span.
func TestSpanOfARecoveredClaim(t *testing.T) {
	tm := newTelemetry(t)
	k, clock := idemtest.New(t, idem.WithObserver(tm.obs), idem.WithLease(10*time.Second))
	ctx := context.Background()
	_, err := k.Begin(ctx, "tenant", "k")
	require.NoError(t, err)
	clock.Advance(10*time.Second + time.Millisecond)
	out, err := k.Begin(ctx, "tenant", "k")
	require.NoError(t, err)
	require.True(t, out.Claim.Recovered())

	spans := tm.spans.Ended()
	require.Equal(t, []string{"idem.claim:claimed", "idem.claim:recovered"}, spanNames(spans))
	attrs := spanAttrs(spans[1])
	assert.Equal(t, int64(2), attrs["idem.attempt"])
	assert.Equal(t, true, attrs["idem.recovered"])
	assert.Equal(t, out.Claim.Token(), attrs["idem.token"])
}

// The in-progress time is the Keeper's: the time between the claim and its
// completion by the Keeper's clock. Spans are children of the span in the
// call's context, one after the other.
func TestObserverTimesAHeldClaim(t *testing.T) {
	tm := newTelemetry(t)
	k, clock := idemtest.New(t, idem.WithObserver(tm.obs))
	ctx, parent := tm.tracer.Tracer("test").Start(context.Background(), "request")
	out, err := k.Begin(ctx, "tenant", "k")
	require.NoError(t, err)
	clock.Advance(5 * time.Second)
	require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))
	parent.End()

	held := histogram(t, tm.metrics(t)["idem.in_progress.duration"])
	require.Contains(t, held, "complete:done")
	assert.Equal(t, uint64(1), held["complete:done"].Count)
	assert.Equal(t, 5.0, held["complete:done"].Sum)

	spans := tm.spans.Ended()
	require.Equal(t, []string{"idem.claim:claimed", "idem.complete:done"}, spanNames(spans[:2]))
	for _, s := range spans[:2] {
		assert.Equal(t, parent.SpanContext().TraceID(), s.SpanContext().TraceID(), s.Name())
		assert.Equal(t, parent.SpanContext().SpanID(), s.Parent().SpanID(), s.Name())
		assert.False(t, s.EndTime().Before(s.StartTime()), s.Name())
	}
	assert.False(t, spans[1].StartTime().Before(spans[0].EndTime()), "the completion after the claim")
}

// A span starts ev.Took before it is observed and ends when it is; the
// durations are recorded in seconds.
func TestSpanCoversTheStep(t *testing.T) {
	tm := newTelemetry(t)
	tm.obs.Observe(context.Background(), idem.Event{
		Step: idem.StepRelease, Result: idem.ResultDone, Scope: "s", ID: "id",
		Token: 3, Attempt: 1, Took: 2 * time.Second, Held: 1500 * time.Millisecond,
	})
	spans := tm.spans.Ended()
	require.Len(t, spans, 1)
	assert.Equal(t, "idem.release", spans[0].Name())
	assert.Equal(t, 2*time.Second, spans[0].EndTime().Sub(spans[0].StartTime()))

	m := tm.metrics(t)
	assert.Equal(t, 2.0, histogram(t, m["idem.step.duration"])["release:done"].Sum)
	assert.Equal(t, 1.5, histogram(t, m["idem.in_progress.duration"])["release:done"].Sum)

	// A clock of WithClock that went back: no negative duration.
	tm = newTelemetry(t)
	tm.obs.Observe(context.Background(), idem.Event{Step: idem.StepComplete, Result: idem.ResultDone, Took: -time.Second, Held: -time.Second})
	spans = tm.spans.Ended()
	require.Len(t, spans, 1)
	assert.Equal(t, spans[0].StartTime(), spans[0].EndTime())
	m = tm.metrics(t)
	assert.Equal(t, 0.0, histogram(t, m["idem.step.duration"])["complete:done"].Sum)
	assert.Equal(t, 0.0, histogram(t, m["idem.in_progress.duration"])["complete:done"].Sum)
}

// TraceAttrs gives the ids of a valid span, and nothing without one.
func TestTraceAttrs(t *testing.T) {
	assert.Nil(t, idemotel.TraceAttrs(context.Background()))

	tm := newTelemetry(t)
	ctx, span := tm.tracer.Tracer("test").Start(context.Background(), "request")
	defer span.End()
	attrs := idemotel.TraceAttrs(ctx)
	require.Len(t, attrs, 2)
	assert.Equal(t, "trace_id", attrs[0].Key)
	assert.Equal(t, span.SpanContext().TraceID().String(), attrs[0].Value.String())
	assert.Equal(t, "span_id", attrs[1].Key)
	assert.Equal(t, span.SpanContext().SpanID().String(), attrs[1].Value.String())
}

// refusingMeter refuses every counter.
type refusingMeter struct{ noop.Meter }

func (refusingMeter) Int64Counter(string, ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	return noop.Int64Counter{}, errors.New("no counters here")
}

type refusingProvider struct{ noop.MeterProvider }

func (refusingProvider) Meter(string, ...metric.MeterOption) metric.Meter { return refusingMeter{} }

// An instrument the MeterProvider refuses is a configuration error.
func TestNewObserverRefusedInstrument(t *testing.T) {
	obs, err := idemotel.NewObserver(idemotel.WithMeterProvider(refusingProvider{}))
	require.ErrorIs(t, err, idem.ErrInvalidConfig)
	assert.ErrorContains(t, err, "no counters here")
	assert.Nil(t, obs)
}

// Without options, or with nil providers, the global ones are used: with
// none set, observing records nothing and fails nothing.
func TestNewObserverDefaults(t *testing.T) {
	for _, opts := range [][]idemotel.Option{nil, {idemotel.WithMeterProvider(nil), idemotel.WithTracerProvider(nil), nil}} {
		obs, err := idemotel.NewObserver(opts...)
		require.NoError(t, err)
		k, _ := idemtest.New(t, idem.WithObserver(obs))
		_, err = idem.Do(context.Background(), k, "s", "k", func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
	}
}
