package idemwatermill_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/idemkit/idem/idemwatermill"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestEachHandlerIsItsOwnScope: two handlers of one topic each handle a
// message once, redelivered or not; neither answers for the other.
func TestEachHandlerIsItsOwnScope(t *testing.T) {
	k, _ := newMiniKeeper(t)
	mw, err := idemwatermill.Middleware(k)
	require.NoError(t, err)
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { ps.Close() })
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(mw)
	var billing, shipping atomic.Int64
	handler := func(name string, runs *atomic.Int64) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			runs.Add(1)
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte(name))}, nil
		}
	}
	router.AddHandler("billing", "orders", ps, "billed", ps, handler("billing", &billing))
	router.AddHandler("shipping", "orders", ps, "shipped", ps, handler("shipping", &shipping))
	ctx := context.Background()
	billed, err := ps.Subscribe(ctx, "billed")
	require.NoError(t, err)
	shipped, err := ps.Subscribe(ctx, "shipped")
	require.NoError(t, err)
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() { router.Close() })
	<-router.Running()

	order := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
	for range 2 {
		require.NoError(t, ps.Publish("orders", order.Copy()))
		for _, out := range []<-chan *message.Message{billed, shipped} {
			select {
			case m := <-out:
				m.Ack()
			case <-time.After(time.Minute):
				t.Fatal("no output within a minute")
			}
		}
	}
	assert.Equal(t, int64(1), billing.Load())
	assert.Equal(t, int64(1), shipping.Load())
}

// TestDeduplicatorDropsAFailedHandlersRedelivery shows why the middleware
// is not watermill's Deduplicator: that one marks a message before its
// handler runs, so the redelivery of a message whose handler failed is
// acknowledged unhandled. The middleware runs it again.
func TestDeduplicatorDropsAFailedHandlersRedelivery(t *testing.T) {
	k, _ := newMiniKeeper(t)
	handlerOf := func(handled *atomic.Int64) message.HandlerFunc {
		var calls atomic.Int64
		return func(msg *message.Message) ([]*message.Message, error) {
			if calls.Add(1) == 1 {
				return nil, errors.New("transient failure")
			}
			handled.Add(1)
			return nil, nil
		}
	}
	msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))

	var dedupHandled atomic.Int64
	dedup := (&middleware.Deduplicator{}).Middleware(handlerOf(&dedupHandled))
	_, err := dedup(delivery(msg))
	require.Error(t, err)
	_, err = dedup(delivery(msg))
	require.NoError(t, err, "the redelivery is acknowledged")
	assert.Zero(t, dedupHandled.Load(), "and the message never handled")

	var handled atomic.Int64
	h := wrap(t, k, handlerOf(&handled))
	_, err = h(delivery(msg))
	require.Error(t, err)
	_, err = h(delivery(msg))
	require.NoError(t, err)
	assert.Equal(t, int64(1), handled.Load(), "the redelivery is handled")
}

// TestPoisonQueueTakesPermanentErrors: behind a poison queue filtered with
// IsPermanent, a message whose key was used with another payload goes to
// the poison topic and is acknowledged, instead of coming back forever.
func TestPoisonQueueTakesPermanentErrors(t *testing.T) {
	k, _ := newMiniKeeper(t)
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { ps.Close() })
	poisoned, err := ps.Subscribe(context.Background(), "poison")
	require.NoError(t, err)
	poison, err := middleware.PoisonQueueWithFilter(ps, "poison", idemwatermill.IsPermanent)
	require.NoError(t, err)
	once, err := idemwatermill.Middleware(k)
	require.NoError(t, err)
	h := poison(once(func(*message.Message) ([]*message.Message, error) { return nil, nil }))

	_, err = h(message.NewMessage("order-1", []byte("order 1")))
	require.NoError(t, err)
	_, err = h(message.NewMessage("order-1", []byte("order 1, edited")))
	require.NoError(t, err, "acknowledged: it went to the poison topic")
	select {
	case m := <-poisoned:
		m.Ack()
		assert.Equal(t, "order-1", m.UUID)
		assert.Contains(t, m.Metadata.Get(middleware.ReasonForPoisonedKey), "different request")
	case <-time.After(time.Minute):
		t.Fatal("nothing on the poison topic within a minute")
	}
}
