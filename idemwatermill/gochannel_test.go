package idemwatermill_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemwatermill"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// goChannelBroker returns a broker on one gochannel pub/sub, closed with the
// test: every subscriber gets every message, as a consumer group of its own.
func goChannelBroker(t *testing.T) broker {
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { ps.Close() })
	return broker{pub: ps, sub: func(*testing.T, string) message.Subscriber { return ps }}
}

// TestTarget2000GoChannel is issue 26's target on gochannel and miniredis:
// 2,000 events, a tenth redelivered, some handlers failing once and some
// outputs' publish failing once; no output lost, no side effect twice.
func TestTarget2000GoChannel(t *testing.T) {
	k, _ := newMiniKeeper(t)
	// A redelivery that arrives while the first delivery runs waits for its
	// output rather than being nacked and resent at once by gochannel.
	mw, err := idemwatermill.Middleware(k, idemwatermill.WithCallOptions(idem.WithWait(time.Minute)))
	require.NoError(t, err)
	p := plan{events: 2000}
	r := runPlan(t, goChannelBroker(t), mw, p)
	t.Log(r)
	requireTarget(t, p, r)
}

// requireTarget fails unless r meets the target: every delivery
// acknowledged, every output published as the first run produced it for
// every delivery, every event's side effect once, and the injected
// failures happened.
func requireTarget(t *testing.T, p plan, r report) {
	t.Helper()
	wantDeliveries, wantFailures, wantPublishFailures := 0, 0, 0
	for i := range p.events {
		wantDeliveries += p.deliveries(i)
		if p.failsFirst(i) {
			wantFailures++
		}
		if p.publishFailsFirst(i) && p.outputs(i) > 0 {
			wantPublishFailures++
		}
	}
	assert.Equal(t, p.events/10, wantDeliveries-p.events, "a tenth redelivered")
	assert.Equal(t, wantDeliveries, r.deliveries)
	assert.Equal(t, wantDeliveries, r.acked)
	assert.Equal(t, wantFailures, r.handlerFailures, "handler failures retried")
	assert.Equal(t, wantPublishFailures, r.publishFailures, "publishes failed")
	assert.Zero(t, r.lostOutputs, "lost outputs")
	assert.Zero(t, r.wrongOutputs, "outputs that no first run produced")
	assert.Zero(t, r.eventsWithoutOutput)
	assert.Zero(t, r.doubleSideEffects, "double side effects")
	assert.Zero(t, r.unhandled, "events never handled")
}

// TestConsumeAdapterLosesOutputs runs the same plan behind an adapter built
// on idem.Consume, which stores no output: its redeliveries publish
// nothing. It shows what the middleware fixes, and that runPlan sees lost
// outputs.
func TestConsumeAdapterLosesOutputs(t *testing.T) {
	k, _ := newMiniKeeper(t)
	p := plan{events: 2000}
	r := runPlan(t, goChannelBroker(t), consumeAdapter(k), p)
	t.Log(r)
	assert.Zero(t, r.doubleSideEffects)
	assert.Positive(t, r.lostOutputs)
	assert.Positive(t, r.eventsWithoutOutput, "events whose only output publish failed")
}

// consumeAdapter is a middleware built on idem.Consume, as issue 26
// describes it: a message handled before is acknowledged with no output.
func consumeAdapter(k *idem.Keeper) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			var out []*message.Message
			results, err := idem.Consume(msg.Context(), k, "consume-adapter", []*message.Message{msg},
				func(m *message.Message) string { return m.UUID },
				func(ctx context.Context, m *message.Message) error {
					produced, err := h(m)
					out = produced
					return err
				})
			if err != nil {
				return nil, err
			}
			if !results[0].Ack {
				return nil, results[0].Err
			}
			return out, nil
		}
	}
}
