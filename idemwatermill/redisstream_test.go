package idemwatermill_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemwatermill"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// redisStreamBroker returns a broker on Redis Streams at addr: watermill's
// redisstream publisher, and a subscriber per consumer group, each closed
// with the test.
func redisStreamBroker(t *testing.T, addr string) broker {
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redistest.NewClient(t, addr)}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { pub.Close() })
	return broker{pub: pub, sub: func(t *testing.T, group string) message.Subscriber {
		return redisStreamSubscriber(t, addr, group, "", 0)
	}}
}

// redisStreamSubscriber returns a subscriber of consumer group group at
// addr, named consumer (a random name when empty), closed with the test.
// It claims messages pending for longer than maxIdle from other consumers
// (never within the test when 0).
func redisStreamSubscriber(t *testing.T, addr, group, consumer string, maxIdle time.Duration) message.Subscriber {
	cfg := redisstream.SubscriberConfig{
		Client: redistest.NewClient(t, addr), ConsumerGroup: group, Consumer: consumer,
		BlockTime: 50 * time.Millisecond, DisableIndefiniteInitialBlock: true,
	}
	if maxIdle > 0 {
		cfg.MaxIdleTime, cfg.ClaimInterval = maxIdle, maxIdle/2
	}
	sub, err := redisstream.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { sub.Close() })
	return sub
}

// TestTarget2000RedisStreams is issue 26's target on a real broker: Redis
// Streams through watermill-redisstream, and the Keeper, on a redis-server
// the test starts.
func TestTarget2000RedisStreams(t *testing.T) {
	addr := redistest.Start(t).Addr
	k, err := idem.NewRedis(redistest.NewClient(t, addr))
	require.NoError(t, err)
	mw, err := idemwatermill.Middleware(k)
	require.NoError(t, err)
	p := plan{events: 2000}
	r := runPlan(t, redisStreamBroker(t, addr), mw, p)
	t.Log(r)
	requireTarget(t, p, r)
}

// TestRedisStreamsTakeover: a consumer's handler ran and its output was
// stored, but the consumer hangs before publishing it (as if it died). The
// broker hands the pending message to another consumer of the group, whose
// delivery publishes the first run's output; the handler ran once.
func TestRedisStreamsTakeover(t *testing.T) {
	addr := redistest.Start(t).Addr
	k, err := idem.NewRedis(redistest.NewClient(t, addr))
	require.NoError(t, err)
	b := redisStreamBroker(t, addr)

	var (
		runs  atomic.Int64
		mu    sync.Mutex
		first []*message.Message
	)
	handler := func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		out := message.NewMessage(watermill.NewUUID(), []byte("shipment of "+string(msg.Payload)))
		out.Metadata.Set("event", msg.Metadata.Get("event"))
		mu.Lock()
		first = []*message.Message{out.Copy()}
		mu.Unlock()
		return []*message.Message{out}, nil
	}
	// startConsumer runs a router of one consumer of group "shipping".
	startConsumer := func(name string, maxIdle time.Duration, pub message.Publisher) {
		mw, err := idemwatermill.Middleware(k)
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddMiddleware(mw)
		router.AddHandler("shipping", eventsTopic, redisStreamSubscriber(t, addr, "shipping", name, maxIdle), outputsTopic, pub, handler)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = router.Run(ctx); close(done) }()
		t.Cleanup(func() { cancel(); router.Close(); <-done })
		<-router.Running()
	}

	outputs, err := b.sub(t, "collector").Subscribe(context.Background(), outputsTopic)
	require.NoError(t, err)

	hung := &hangingPublisher{entered: make(chan struct{}), release: make(chan struct{})}
	startConsumer("a", 0, hung)
	t.Cleanup(hung.Release) // before a's router closes: registered after it
	msg := message.NewMessage(watermill.NewUUID(), []byte("order 7"))
	msg.Metadata.Set("event", strconv.Itoa(7))
	require.NoError(t, b.pub.Publish(eventsTopic, msg))
	<-hung.entered // a's handler ran and its output is stored; a hangs

	startConsumer("b", 200*time.Millisecond, b.pub)
	var got *message.Message
	select {
	case got = <-outputs:
		got.Ack()
	case <-time.After(time.Minute):
		t.Fatal("no output published within a minute of the takeover")
	}
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, first, 1)
	assert.True(t, first[0].Equals(got), "the first run's output: want %s %q, got %s %q", first[0].UUID, first[0].Payload, got.UUID, got.Payload)
	assert.Equal(t, int64(1), runs.Load(), "the handler ran once")
}

// hangingPublisher blocks every Publish until Release, then refuses it.
type hangingPublisher struct {
	entered, release chan struct{}
	enterOnce        sync.Once
	releaseOnce      sync.Once
}

func (p *hangingPublisher) Publish(string, ...*message.Message) error {
	p.enterOnce.Do(func() { close(p.entered) })
	<-p.release
	return errors.New("the consumer is gone")
}

func (p *hangingPublisher) Release() { p.releaseOnce.Do(func() { close(p.release) }) }

func (p *hangingPublisher) Close() error { return nil }
