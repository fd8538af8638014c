package idemwatermill_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

// Topics of the scenario.
const (
	eventsTopic  = "events"
	outputsTopic = "outputs"
)

// broker is a pub/sub the scenario runs on.
type broker struct {
	// pub publishes the events and the handler's output.
	pub message.Publisher
	// sub returns a subscriber of consumer group group: each group gets
	// every message of a topic once (and again when it nacks it).
	sub func(t *testing.T, group string) message.Subscriber
}

// plan says what happens to each event of a run: every tenth is delivered
// twice (a redelivery), some handlers fail on their first call, and some
// outputs' first publish fails (the router nacks the event: its
// redelivery must publish the output the first run produced).
type plan struct {
	events int
}

func (plan) deliveries(i int) int {
	if i%10 == 0 {
		return 2
	}
	return 1
}

func (plan) failsFirst(i int) bool        { return i%7 == 3 }
func (plan) publishFailsFirst(i int) bool { return i%13 == 5 }

// outputs is how many messages the handler produces for event i: 0, 1 or
// 2.
func (plan) outputs(i int) int { return i % 3 }

// report is what a run of a plan gave.
type report struct {
	// deliveries is how many events the broker was asked to deliver,
	// redeliveries included; acked how many deliveries were acknowledged.
	deliveries, acked int
	// handlerFailures and publishFailures are the failures injected.
	handlerFailures, publishFailures int
	// lostOutputs counts, over every event and every delivery of it that
	// was acknowledged, the first run's output messages not published;
	// wrongOutputs the published messages that are not one of them.
	lostOutputs, wrongOutputs int
	// eventsWithoutOutput counts events that produced output but of which
	// none was published.
	eventsWithoutOutput int
	// doubleSideEffects counts side effects beyond the first, per event;
	// unhandled the events whose side effect never happened.
	doubleSideEffects, unhandled int
}

func (r report) String() string {
	return fmt.Sprintf("deliveries %d (acknowledged %d), handler failures %d, publish failures %d: "+
		"lost outputs %d, wrong outputs %d, events without output %d, double side effects %d, unhandled %d",
		r.deliveries, r.acked, r.handlerFailures, r.publishFailures,
		r.lostOutputs, r.wrongOutputs, r.eventsWithoutOutput, r.doubleSideEffects, r.unhandled)
}

// eventOf returns the event number in msg's metadata.
func eventOf(msg *message.Message) int {
	i, err := strconv.Atoi(msg.Metadata.Get("event"))
	if err != nil {
		panic(fmt.Sprintf("message %s carries no event number", msg.UUID))
	}
	return i
}

// runPlan publishes p's events on b, handles them with a router whose
// handler is behind mw, and reports what was published and done.
func runPlan(t *testing.T, b broker, mw message.HandlerMiddleware, p plan) report {
	t.Helper()
	var (
		attempts    = make([]atomic.Int64, p.events)
		sideEffects = make([]atomic.Int64, p.events)
		acked       = make([]atomic.Int64, p.events)
		firstMu     sync.Mutex
		firstRun    = make([][]*message.Message, p.events)
		recvMu      sync.Mutex
		received    = make([][]*message.Message, p.events)
		recvCount   atomic.Int64
	)
	handler := func(msg *message.Message) ([]*message.Message, error) {
		i := eventOf(msg)
		if p.failsFirst(i) && attempts[i].Add(1) == 1 {
			return nil, errors.New("transient failure before the side effect")
		}
		sideEffects[i].Add(1)
		// New UUIDs and a nonce each run: a second run's output differs.
		nonce := watermill.NewShortUUID()
		out := make([]*message.Message, p.outputs(i))
		for j := range out {
			m := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "output %d of event %d, run %s", j, i, nonce))
			m.Metadata.Set("event", strconv.Itoa(i))
			m.Metadata.Set("run", nonce)
			out[j] = m
		}
		firstMu.Lock()
		if firstRun[i] == nil {
			firstRun[i] = make([]*message.Message, len(out))
			for j, m := range out {
				firstRun[i][j] = m.Copy()
			}
		}
		firstMu.Unlock()
		return out, nil
	}

	outPub := &flakyPublisher{Publisher: b.pub, failFirst: p.publishFailsFirst, failed: map[int]bool{}}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	done := make(chan struct{})
	router.AddSubscriberDecorators(message.MessageTransformSubscriberDecorator(func(m *message.Message) {
		go func() {
			select {
			case <-m.Acked():
				acked[eventOf(m)].Add(1)
			case <-m.Nacked():
			case <-done:
			}
		}()
	}))
	router.AddMiddleware(mw)
	router.AddHandler("events", eventsTopic, b.sub(t, "handler"), outputsTopic, outPub, handler)

	outputs, err := b.sub(t, "collector").Subscribe(context.Background(), outputsTopic)
	require.NoError(t, err)
	go func() {
		for m := range outputs {
			i := eventOf(m)
			recvMu.Lock()
			received[i] = append(received[i], m.Copy())
			recvMu.Unlock()
			recvCount.Add(1)
			m.Ack()
		}
	}()

	ctx, cancel := context.WithCancel(context.Background())
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	t.Cleanup(func() {
		close(done)
		cancel()
		require.NoError(t, router.Close())
		require.NoError(t, <-routerDone)
	})
	<-router.Running()

	// Publish: each event, and a redelivery of every tenth fifty events
	// later (or at the end).
	event := func(i int) *message.Message {
		m := message.NewMessage(fmt.Sprintf("evt-%04d", i), fmt.Appendf(nil, "event %d", i))
		m.Metadata.Set("event", strconv.Itoa(i))
		return m
	}
	var r report
	publish := func(i int) {
		require.NoError(t, b.pub.Publish(eventsTopic, event(i)))
		r.deliveries++
	}
	const lag = 50
	for i := range p.events + lag {
		if i < p.events {
			publish(i)
		}
		if j := i - lag; j >= 0 && p.deliveries(j) == 2 {
			publish(j)
		}
	}

	// Wait until every delivery is acknowledged and every output
	// published has been received: both only grow.
	settled := func() bool {
		for i := range p.events {
			if acked[i].Load() < int64(p.deliveries(i)) {
				return false
			}
		}
		return recvCount.Load() == outPub.published.Load()
	}
	for deadline := time.Now().Add(3 * time.Minute); !settled(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not settled after 3 minutes: %d outputs published, %d received", outPub.published.Load(), recvCount.Load())
		}
	}

	recvMu.Lock()
	defer recvMu.Unlock()
	firstMu.Lock()
	defer firstMu.Unlock()
	for i := range p.events {
		r.acked += int(acked[i].Load())
		if p.failsFirst(i) && attempts[i].Load() > 1 {
			r.handlerFailures++
		}
		switch se := sideEffects[i].Load(); {
		case se == 0:
			r.unhandled++
		case se > 1:
			r.doubleSideEffects += int(se - 1)
		}
		want := int(acked[i].Load())
		matched := 0
		for _, first := range firstRun[i] {
			n := 0
			for _, got := range received[i] {
				if got.UUID == first.UUID && got.Equals(first) {
					n++
				}
			}
			matched += n
			r.lostOutputs += max(0, want-n)
		}
		r.wrongOutputs += len(received[i]) - matched
		if len(firstRun[i]) > 0 && len(received[i]) == 0 {
			r.eventsWithoutOutput++
		}
	}
	r.publishFailures = outPub.failures()
	return r
}

// flakyPublisher publishes through Publisher, but fails the first publish
// of the output of each event that failFirst names, and counts the
// messages it published. Close leaves Publisher open: the scenario closes
// its broker itself.
type flakyPublisher struct {
	message.Publisher
	failFirst func(event int) bool
	published atomic.Int64

	mu     sync.Mutex
	failed map[int]bool // guarded by mu
}

func (p *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) > 0 {
		i := eventOf(msgs[0])
		p.mu.Lock()
		fail := p.failFirst(i) && !p.failed[i]
		if fail {
			p.failed[i] = true
		}
		p.mu.Unlock()
		if fail {
			return errors.New("the broker refused the publish")
		}
	}
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	p.published.Add(int64(len(msgs)))
	return nil
}

func (p *flakyPublisher) Close() error { return nil }

// failures is how many publishes p failed.
func (p *flakyPublisher) failures() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.failed)
}
