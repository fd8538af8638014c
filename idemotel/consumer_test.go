package idemotel_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// gauges returns a gauge's last value by idem.scope, its only attribute;
// nil when nothing was recorded.
func gauges(t *testing.T, m metricdata.Metrics) map[string]int64 {
	t.Helper()
	if m.Data == nil {
		return nil
	}
	g, ok := m.Data.(metricdata.Gauge[int64])
	require.True(t, ok, "%s is a %T", m.Name, m.Data)
	out := map[string]int64{}
	for _, dp := range g.DataPoints {
		require.Equal(t, 1, dp.Attributes.Len(), "%s carries idem.scope only", m.Name)
		scope, ok := dp.Attributes.Value("idem.scope")
		require.True(t, ok, m.Name)
		out[scope.AsString()] = dp.Value
	}
	return out
}

// A consumer's backlog is two gauges, by scope, holding the last report; a
// lag of -1 (the broker does not say) is not recorded. Backlog reports are
// counted among the steps, and are not spans.
func TestObserverRecordsTheBacklog(t *testing.T) {
	tm := newTelemetry(t)
	ctx := context.Background()
	for _, ev := range []idem.Event{
		{Step: idem.StepBacklog, Result: idem.ResultDone, Scope: "s g", Lag: 6, Pending: 4},
		{Step: idem.StepBacklog, Result: idem.ResultDone, Scope: "orders", Lag: -1, Pending: 2},
		{Step: idem.StepBacklog, Result: idem.ResultDone, Scope: "s g", Lag: 0, Pending: 3},
	} {
		tm.obs.Observe(ctx, ev)
	}
	ms := tm.metrics(t)
	assert.Equal(t, map[string]int64{"s g": 0}, gauges(t, ms["idem.consumer.lag"]), "the last lag; none where the broker does not say")
	assert.Equal(t, map[string]int64{"s g": 3, "orders": 2}, gauges(t, ms["idem.consumer.pending"]))
	assert.Equal(t, map[string]int64{"backlog:done": 3}, sums(t, ms["idem.steps"]))
	assert.Empty(t, tm.spans.Ended(), "a backlog report is not a span")
}

// A backlog reported by partition (idemkafka) is a series per partition:
// idem.partition beside idem.scope, each holding its own last report.
func TestObserverRecordsTheBacklogByPartition(t *testing.T) {
	tm := newTelemetry(t)
	ctx := context.Background()
	for _, ev := range []idem.Event{
		{Step: idem.StepBacklog, Result: idem.ResultDone, Scope: "orders", ID: "orders/0", Lag: 40, Pending: 10},
		{Step: idem.StepBacklog, Result: idem.ResultDone, Scope: "orders", ID: "orders/1", Lag: 7, Pending: 2},
		{Step: idem.StepBacklog, Result: idem.ResultDone, Scope: "orders", ID: "orders/0", Lag: 0, Pending: 3},
	} {
		tm.obs.Observe(ctx, ev)
	}
	byPartition := func(m metricdata.Metrics) map[string]int64 {
		g, ok := m.Data.(metricdata.Gauge[int64])
		require.True(t, ok, "%s is a %T", m.Name, m.Data)
		out := map[string]int64{}
		for _, dp := range g.DataPoints {
			scope, _ := dp.Attributes.Value("idem.scope")
			part, ok := dp.Attributes.Value("idem.partition")
			require.True(t, ok, "%s carries idem.partition", m.Name)
			out[scope.AsString()+" "+part.AsString()] = dp.Value
		}
		return out
	}
	ms := tm.metrics(t)
	assert.Equal(t, map[string]int64{"orders orders/0": 0, "orders orders/1": 7}, byPartition(ms["idem.consumer.lag"]))
	assert.Equal(t, map[string]int64{"orders orders/0": 3, "orders orders/1": 2}, byPartition(ms["idem.consumer.pending"]))
}

// A StreamConsumer's backlog, dead letters and removed consumer names
// reach the metrics: a stream of 10 entries, 4 of them held by another
// consumer, one of the other 6 with an invalid key.
func TestObserverRecordsAStreamConsumer(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		c := b.Client
		tm := newTelemetry(t)
		k, err := idem.NewRedis(c, idem.WithObserver(tm.obs))
		require.NoError(t, err)
		for i := range 10 {
			id := fmt.Sprint("e", i)
			if i == 9 {
				id = "" // an invalid key: dead-lettered
			}
			require.NoError(t, c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": id}}).Err())
		}
		require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())
		got, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "other", Streams: []string{"s", ">"}, Count: 4}).Result()
		require.NoError(t, err)
		require.Len(t, got[0].Messages, 4)

		sc, err := idem.NewStreamConsumer(k, c, "s", "g", "c")
		require.NoError(t, err)
		rctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			done <- sc.Run(rctx, func(m redis.XMessage) string { return m.Values["id"].(string) },
				func(ctx context.Context, m redis.XMessage) error { return nil })
		}()
		deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
		for {
			p, err := c.XPending(ctx, "s", "g").Result()
			require.NoError(t, err)
			n, err := c.XLen(ctx, "s:dead-letter").Result()
			require.NoError(t, err)
			if p.Count == 4 && n == 1 {
				break
			}
			require.True(t, time.Now().Before(deadline), "pending %d, dead letters %d", p.Count, n)
			time.Sleep(5 * time.Millisecond)
		}
		stop()
		require.ErrorIs(t, <-done, context.Canceled)

		ms := tm.metrics(t)
		steps := sums(t, ms["idem.steps"])
		assert.EqualValues(t, 1, steps["stream:dead_lettered"], "%v", steps)
		assert.EqualValues(t, 1, steps["backlog:done"], "one report as Run started: %v", steps)
		assert.EqualValues(t, 5, steps["complete:done"], "%v", steps)
		assert.Equal(t, map[string]int64{"s g": 4}, gauges(t, ms["idem.consumer.pending"]))
		if b.Real {
			assert.Equal(t, map[string]int64{"s g": 6}, gauges(t, ms["idem.consumer.lag"]))
		} else {
			assert.Nil(t, gauges(t, ms["idem.consumer.lag"]), "miniredis does not give the group's lag")
		}
	})
}
