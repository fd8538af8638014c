package idemjetstream_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemjetstream"
	"github.com/nats-io/nats.go/jetstream"
)

// publish publishes one message on subject, with the id id unless it is
// empty, and says whether JetStream dropped it as a duplicate.
func publish(tb testing.TB, js jetstream.JetStream, subject, id string) bool {
	tb.Helper()
	var opts []jetstream.PublishOpt
	if id != "" {
		opts = append(opts, jetstream.WithMsgID(id))
	}
	ack, err := js.Publish(context.Background(), subject, []byte(id), opts...)
	if err != nil {
		tb.Fatal(err)
	}
	return ack.Duplicate
}

// run starts r.Run in a goroutine; stop cancels it and returns its error.
func run(tb testing.TB, r *idemjetstream.Runner) (stop func() error) {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				err = errors.New("Run did not return within 30s of its context's end")
			}
		})
		return err
	}
	tb.Cleanup(func() { _ = stop() })
	return stop
}

// waitSettled waits until the consumer has nothing pending nor
// unacknowledged, and returns its info.
func waitSettled(tb testing.TB, c jetstream.Consumer, within time.Duration) *jetstream.ConsumerInfo {
	tb.Helper()
	deadline := time.Now().Add(within)
	for {
		info, err := c.Info(context.Background())
		if err != nil {
			tb.Fatal(err)
		}
		if info.NumPending == 0 && info.NumAckPending == 0 && info.NumRedelivered == 0 {
			return info
		}
		if time.Now().After(deadline) {
			tb.Fatalf("after %s the consumer still has %d pending, %d unacknowledged, %d to redeliver",
				within, info.NumPending, info.NumAckPending, info.NumRedelivered)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// counter counts the handler's runs by message id.
type counter struct {
	mu   sync.Mutex
	runs map[string]int
}

func (c *counter) add(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.runs == nil {
		c.runs = map[string]int{}
	}
	c.runs[id]++
}

func (c *counter) get(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[id]
}

func (c *counter) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.runs)
}

func TestRunHandlesEachIDOnce(t *testing.T) {
	_, js := connect(t, startNATS(t))
	keeper, _ := miniKeeper(t)
	cons := stream(t, js, "ONCE", jetstream.StreamConfig{Duplicates: 300 * time.Millisecond}, jetstream.ConsumerConfig{})
	const ids = 100
	for i := range ids {
		publish(t, js, "ONCE.x", fmt.Sprint("id-", i))
		if i%10 == 0 && !publish(t, js, "ONCE.x", fmt.Sprint("id-", i)) {
			t.Fatal("a duplicate within the Duplicates window was stored")
		}
	}
	time.Sleep(400 * time.Millisecond) // past the window: JetStream stores the duplicates
	for i := 0; i < ids; i += 5 {
		if publish(t, js, "ONCE.x", fmt.Sprint("id-", i)) {
			t.Fatal("a duplicate after the Duplicates window was dropped")
		}
	}

	var c counter
	r, err := idemjetstream.New(keeper, "orders", cons, func(ctx context.Context, m jetstream.Msg) error {
		c.add(m.Headers().Get(jetstream.MsgIDHeader))
		return nil
	}, idemjetstream.WithBatch(16), idemjetstream.WithConcurrency(4))
	if err != nil {
		t.Fatal(err)
	}
	stop := run(t, r)
	info := waitSettled(t, cons, 20*time.Second)
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
	if c.len() != ids {
		t.Fatalf("%d ids handled, want %d", c.len(), ids)
	}
	for i := range ids {
		if n := c.get(fmt.Sprint("id-", i)); n != 1 {
			t.Errorf("id-%d handled %d times", i, n)
		}
	}
	if want := uint64(ids + ids/5); info.AckFloor.Stream != want {
		t.Errorf("acknowledged up to stream sequence %d, want %d (every stored message)", info.AckFloor.Stream, want)
	}
}

func TestRunSettlesEachResult(t *testing.T) {
	_, js := connect(t, startNATS(t))
	keeper, _ := miniKeeper(t)
	cons := stream(t, js, "SETTLE", jetstream.StreamConfig{}, jetstream.ConsumerConfig{})
	publish(t, js, "SETTLE.ok", "ok")
	publish(t, js, "SETTLE.fail", "fail-once")
	publish(t, js, "SETTLE.reject", "rejected")

	const retry = 300 * time.Millisecond
	var c counter
	var mu sync.Mutex
	var failedAt time.Time
	var delivered []uint64
	r, err := idemjetstream.New(keeper, "settle", cons, func(ctx context.Context, m jetstream.Msg) error {
		id := m.Headers().Get(jetstream.MsgIDHeader)
		c.add(id)
		if id != "fail-once" {
			return nil
		}
		md, err := m.Metadata()
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		delivered = append(delivered, md.NumDelivered)
		if len(delivered) == 1 {
			failedAt = time.Now()
			return errors.New("the first attempt fails")
		}
		if waited := time.Since(failedAt); waited < retry*2/3 {
			t.Errorf("redelivered %s after the failure, want about the retry delay %s", waited, retry)
		}
		return nil
	},
		idemjetstream.WithRetryDelay(retry),
		idemjetstream.WithKey(func(m jetstream.Msg) string {
			if m.Subject() == "SETTLE.reject" {
				return "" // an invalid key: rejected
			}
			return idemjetstream.MsgID(m)
		}))
	if err != nil {
		t.Fatal(err)
	}
	stop := run(t, r)
	info := waitSettled(t, cons, 20*time.Second)
	time.Sleep(2 * retry) // a Nak instead of a Term would come again by now
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	if c.get("ok") != 1 {
		t.Errorf("ok handled %d times, want 1", c.get("ok"))
	}
	if c.get("rejected") != 0 {
		t.Errorf("the rejected message was handled %d times (Term, never handled)", c.get("rejected"))
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(delivered) != "[1 2]" {
		t.Errorf("fail-once was handled at deliveries %v, want [1 2] (NakWithDelay, then handled)", delivered)
	}
	if info.AckFloor.Stream != 3 {
		t.Errorf("ack floor %d, want 3: the Term'ed message settled too", info.AckFloor.Stream)
	}
	after, err := cons.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if after.NumAckPending != 0 || after.NumRedelivered != 0 {
		t.Errorf("after Term, %d unacknowledged and %d to redeliver, want none", after.NumAckPending, after.NumRedelivered)
	}
}

func TestRunStopsGracefully(t *testing.T) {
	_, js := connect(t, startNATS(t))
	keeper, _ := miniKeeper(t)
	cons := stream(t, js, "STOP", jetstream.StreamConfig{}, jetstream.ConsumerConfig{AckWait: 30 * time.Second})
	for i := range 5 {
		publish(t, js, "STOP.x", fmt.Sprint("m", i))
	}
	var c counter
	started, release := make(chan struct{}), make(chan struct{})
	var blockedErr error
	r, err := idemjetstream.New(keeper, "stop", cons, func(ctx context.Context, m jetstream.Msg) error {
		id := m.Headers().Get(jetstream.MsgIDHeader)
		if id == "m1" {
			close(started)
			<-release
			blockedErr = ctx.Err() // a running handler is not cancelled by Run's end
		}
		c.add(id)
		return nil
	}, idemjetstream.WithBatch(5))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-started
	cancel()
	select {
	case err := <-done:
		t.Fatalf("Run returned %v while a handler was running", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
	if blockedErr != nil {
		t.Errorf("the running handler's context ended: %v", blockedErr)
	}
	if c.len() != 2 || c.get("m0") != 1 || c.get("m1") != 1 {
		t.Fatalf("handled %v before the stop, want m0 and m1", c.runs)
	}

	// m2 to m4 were Nak'ed at once: a new runner has them long before the
	// 30s AckWait.
	r2, err := idemjetstream.New(keeper, "stop", cons, func(ctx context.Context, m jetstream.Msg) error {
		c.add(m.Headers().Get(jetstream.MsgIDHeader))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := run(t, r2)
	waitSettled(t, cons, 10*time.Second)
	_ = stop()
	for i := range 5 {
		if n := c.get(fmt.Sprint("m", i)); n != 1 {
			t.Errorf("m%d handled %d times, want 1", i, n)
		}
	}
}

func TestRunKeepsABatchInProgress(t *testing.T) {
	_, js := connect(t, startNATS(t))
	keeper, _ := miniKeeper(t)
	const ackWait = 600 * time.Millisecond
	cons := stream(t, js, "SLOW", jetstream.StreamConfig{}, jetstream.ConsumerConfig{AckWait: ackWait})
	for i := range 3 {
		publish(t, js, "SLOW.x", fmt.Sprint("s", i))
	}
	var c counter
	r, err := idemjetstream.New(keeper, "slow", cons, func(ctx context.Context, m jetstream.Msg) error {
		md, err := m.Metadata()
		if err != nil {
			return err
		}
		if md.NumDelivered != 1 {
			t.Errorf("%s delivered %d times", m.Headers().Get(jetstream.MsgIDHeader), md.NumDelivered)
		}
		time.Sleep(ackWait) // the batch takes three AckWaits
		c.add(m.Headers().Get(jetstream.MsgIDHeader))
		return nil
	}, idemjetstream.WithBatch(3), idemjetstream.WithLease(ackWait))
	if err != nil {
		t.Fatal(err)
	}
	stop := run(t, r)
	waitSettled(t, cons, 20*time.Second)
	_ = stop()
	info, err := cons.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.Delivered.Consumer != 3 {
		t.Errorf("the consumer delivered %d times for 3 messages: redelivered while the batch ran", info.Delivered.Consumer)
	}
}

func TestRunReportsToTheObserver(t *testing.T) {
	_, js := connect(t, startNATS(t))
	var mu sync.Mutex
	seen := map[string]int{}
	keeper, _ := miniKeeper(t, idem.WithObserver(idem.ObserverFunc(func(ctx context.Context, ev idem.Event) {
		mu.Lock()
		defer mu.Unlock()
		seen[ev.Step.String()+"/"+ev.Result.String()]++
	})))
	cons := stream(t, js, "OBS", jetstream.StreamConfig{Duplicates: time.Millisecond * 100}, jetstream.ConsumerConfig{})
	for i := range 10 {
		publish(t, js, "OBS.x", fmt.Sprint("o", i))
	}
	r, err := idemjetstream.New(keeper, "obs", cons, func(ctx context.Context, m jetstream.Msg) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	stop := run(t, r)
	waitSettled(t, cons, 20*time.Second)
	time.Sleep(150 * time.Millisecond)
	publish(t, js, "OBS.x", "o3") // stored again, past the window: a redelivery for idem
	waitSettled(t, cons, 20*time.Second)
	_ = stop()
	mu.Lock()
	defer mu.Unlock()
	if seen["claim/claimed"] != 10 || seen["claim/replayed"] != 1 || seen["complete/done"] == 0 {
		t.Errorf("the Observer saw %v, want 10 claim/claimed, 1 claim/replayed and completions", seen)
	}
}

// TestRunReportsTheBacklog: a stream of 10 messages, 4 of them delivered
// to another client of the consumer and held: as Run starts, before it
// fetches, the Observer is told the consumer's backlog, 6 not delivered
// (NumPending) and 4 not acknowledged (NumAckPending); once Run has
// handled the 6 and the other client acknowledged its 4, the report after
// a wait that brought nothing says 0 and 0.
func TestRunReportsTheBacklog(t *testing.T) {
	_, js := connect(t, startNATS(t))
	var mu sync.Mutex
	var backlog []idem.Event
	events := func() []idem.Event {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(backlog)
	}
	keeper, _ := miniKeeper(t, idem.WithObserver(idem.ObserverFunc(func(ctx context.Context, ev idem.Event) {
		if ev.Step == idem.StepBacklog {
			mu.Lock()
			defer mu.Unlock()
			backlog = append(backlog, ev)
		}
	})))
	cons := stream(t, js, "LAG", jetstream.StreamConfig{}, jetstream.ConsumerConfig{AckWait: 30 * time.Second})
	for i := range 10 {
		publish(t, js, "LAG.x", fmt.Sprint("m", i))
	}
	b, err := cons.Fetch(4, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var held []jetstream.Msg
	for m := range b.Messages() {
		held = append(held, m)
	}
	if len(held) != 4 {
		t.Fatalf("the other client fetched %d messages, want 4", len(held))
	}
	var c counter
	r, err := idemjetstream.New(keeper, "lag", cons, func(ctx context.Context, m jetstream.Msg) error {
		c.add(m.Headers().Get(jetstream.MsgIDHeader))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := run(t, r)
	deadline := time.Now().Add(20 * time.Second) // a bound, not a margin
	for c.len() < 6 {
		if time.Now().After(deadline) {
			t.Fatalf("Run handled %d messages, want 6", c.len())
		}
		time.Sleep(5 * time.Millisecond)
	}
	first := events()
	if len(first) == 0 {
		t.Fatal("no backlog reported as Run started")
	}
	if ev := first[0]; ev.Result != idem.ResultDone || ev.Scope != "lag" || ev.Lag != 6 || ev.Pending != 4 {
		t.Errorf("the first backlog report is %+v, want done, scope lag, Lag 6, Pending 4", ev)
	}
	for _, m := range held {
		if err := m.DoubleAck(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	for {
		evs := events()
		if ev := evs[len(evs)-1]; ev.Lag == 0 && ev.Pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no backlog report of 0 and 0: %+v", evs)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
}

func TestRunReturnsWhenTheConsumerIsDeleted(t *testing.T) {
	_, js := connect(t, startNATS(t))
	keeper, _ := miniKeeper(t)
	for _, busy := range []bool{false, true} {
		// Deleted while Run waits for a message, or while it handles one
		// (its next pull request then gets no answer at all).
		name := fmt.Sprint("GONE", busy)
		cons := stream(t, js, name, jetstream.StreamConfig{}, jetstream.ConsumerConfig{})
		started, release := make(chan struct{}), make(chan struct{})
		if busy {
			publish(t, js, name+".x", "one")
		}
		r, err := idemjetstream.New(keeper, "gone", cons, func(ctx context.Context, m jetstream.Msg) error {
			close(started)
			<-release
			return nil
		}, idemjetstream.WithRetryDelay(50*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- r.Run(context.Background()) }()
		if busy {
			<-started
		} else {
			time.Sleep(100 * time.Millisecond)
		}
		if err := js.DeleteConsumer(context.Background(), name, "worker"); err != nil {
			t.Fatal(err)
		}
		close(release)
		select {
		case err := <-done:
			if !errors.Is(err, jetstream.ErrConsumerDeleted) && !errors.Is(err, jetstream.ErrConsumerNotFound) {
				t.Errorf("busy %v: Run returned %v, want the consumer deleted or not found", busy, err)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("busy %v: Run still runs 20s after its consumer was deleted", busy)
		}
	}
}

func TestNewRefusesMisuse(t *testing.T) {
	_, js := connect(t, startNATS(t))
	keeper, _ := miniKeeper(t)
	cons := stream(t, js, "MISUSE", jetstream.StreamConfig{}, jetstream.ConsumerConfig{})
	noAck, err := js.CreateOrUpdateConsumer(context.Background(), "MISUSE", jetstream.ConsumerConfig{Durable: "noack", AckPolicy: jetstream.AckNonePolicy})
	if err != nil {
		t.Fatal(err)
	}
	ordered, err := js.OrderedConsumer(context.Background(), "MISUSE", jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	shortAckWait, err := js.CreateOrUpdateConsumer(context.Background(), "MISUSE", jetstream.ConsumerConfig{Durable: "short", AckWait: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	shortBackOff, err := js.CreateOrUpdateConsumer(context.Background(), "MISUSE", jetstream.ConsumerConfig{
		Durable: "backoff", BackOff: []time.Duration{40 * time.Second, time.Second}, MaxDeliver: 5})
	if err != nil {
		t.Fatal(err)
	}
	h := func(ctx context.Context, m jetstream.Msg) error { return nil }
	for _, tc := range []struct {
		name string
		new  func() (*idemjetstream.Runner, error)
	}{
		{"nil keeper", func() (*idemjetstream.Runner, error) { return idemjetstream.New(nil, "s", cons, h) }},
		{"nil consumer", func() (*idemjetstream.Runner, error) { return idemjetstream.New(keeper, "s", nil, h) }},
		{"nil handler", func() (*idemjetstream.Runner, error) { return idemjetstream.New(keeper, "s", cons, nil) }},
		{"AckNone", func() (*idemjetstream.Runner, error) { return idemjetstream.New(keeper, "s", noAck, h) }},
		{"ordered", func() (*idemjetstream.Runner, error) { return idemjetstream.New(keeper, "s", ordered, h) }},
		{"batch 0", func() (*idemjetstream.Runner, error) {
			return idemjetstream.New(keeper, "s", cons, h, idemjetstream.WithBatch(0))
		}},
		{"concurrency 0", func() (*idemjetstream.Runner, error) {
			return idemjetstream.New(keeper, "s", cons, h, idemjetstream.WithConcurrency(0))
		}},
		{"lease 0", func() (*idemjetstream.Runner, error) {
			return idemjetstream.New(keeper, "s", cons, h, idemjetstream.WithLease(0))
		}},
		{"negative retry delay", func() (*idemjetstream.Runner, error) {
			return idemjetstream.New(keeper, "s", cons, h, idemjetstream.WithRetryDelay(-time.Second))
		}},
		{"nil key", func() (*idemjetstream.Runner, error) {
			return idemjetstream.New(keeper, "s", cons, h, idemjetstream.WithKey(nil))
		}},
		{"AckWait 1s, the Keeper's lease 30s", func() (*idemjetstream.Runner, error) {
			return idemjetstream.New(keeper, "s", shortAckWait, h)
		}},
		{"AckWait 1s, WithLease 2s", func() (*idemjetstream.Runner, error) {
			return idemjetstream.New(keeper, "s", shortAckWait, h, idemjetstream.WithLease(2*time.Second))
		}},
		{"a BackOff of 1s", func() (*idemjetstream.Runner, error) {
			return idemjetstream.New(keeper, "s", shortBackOff, h, idemjetstream.WithLease(30*time.Second))
		}},
	} {
		if _, err := tc.new(); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%s: New returned %v, want idem.ErrInvalidConfig", tc.name, err)
		}
	}
	// An AckWait as long as the lease, or longer, is accepted.
	for _, tc := range []struct {
		name  string
		cons  jetstream.Consumer
		lease time.Duration
	}{
		{"AckWait 1s, WithLease 1s", shortAckWait, time.Second},
		{"AckWait 1s, WithLease 500ms", shortAckWait, 500 * time.Millisecond},
		{"the default AckWait and lease, 30s", cons, 0},
	} {
		var opts []idemjetstream.Option
		if tc.lease > 0 {
			opts = append(opts, idemjetstream.WithLease(tc.lease))
		}
		if _, err := idemjetstream.New(keeper, "s", tc.cons, h, opts...); err != nil {
			t.Errorf("%s: New returned %v, want a Runner", tc.name, err)
		}
	}
}

// TestMsgIDRequired: without Nats-Msg-Id, the default key (MsgID) handles a
// producer's two publishes of a message twice; MsgIDRequired rejects each,
// dead-lettered with idem.ErrInvalidKey, and handles the message with the
// header once.
func TestMsgIDRequired(t *testing.T) {
	_, js := connect(t, startNATS(t))
	keeper, _ := miniKeeper(t)
	byDefault := stream(t, js, "REQ", jetstream.StreamConfig{}, jetstream.ConsumerConfig{Durable: "default"})
	strict, err := js.CreateOrUpdateConsumer(context.Background(), "REQ", jetstream.ConsumerConfig{Durable: "strict"})
	if err != nil {
		t.Fatal(err)
	}
	publish(t, js, "REQ.x", "with-id")
	for range 2 { // a producer that retried its Publish, without an id
		if _, err := js.Publish(context.Background(), "REQ.x", []byte("no-id")); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name      string
		cons      jetstream.Consumer
		key       func(jetstream.Msg) string
		runs      map[string]int
		deadNoIDs int
	}{
		{"MsgID", byDefault, idemjetstream.MsgID, map[string]int{"with-id": 1, "no-id": 2}, 0},
		{"MsgIDRequired", strict, idemjetstream.MsgIDRequired, map[string]int{"with-id": 1, "no-id": 0}, 2},
	} {
		var c counter
		var mu sync.Mutex
		var dead []error
		r, err := idemjetstream.New(keeper, tc.name, tc.cons, func(ctx context.Context, m jetstream.Msg) error {
			c.add(string(m.Data()))
			return nil
		}, idemjetstream.WithKey(tc.key), idemjetstream.WithDeadLetter(func(ctx context.Context, m jetstream.Msg, reason error) error {
			mu.Lock()
			defer mu.Unlock()
			if string(m.Data()) == "no-id" {
				dead = append(dead, reason)
			}
			return nil
		}))
		if err != nil {
			t.Fatal(err)
		}
		stop := run(t, r)
		waitSettled(t, tc.cons, 20*time.Second)
		if err := stop(); !errors.Is(err, context.Canceled) {
			t.Fatal(err)
		}
		for id, want := range tc.runs {
			if n := c.get(id); n != want {
				t.Errorf("%s: %s handled %d times, want %d", tc.name, id, n, want)
			}
		}
		mu.Lock()
		if len(dead) != tc.deadNoIDs {
			t.Errorf("%s: %d messages without Nats-Msg-Id dead-lettered (%v), want %d", tc.name, len(dead), dead, tc.deadNoIDs)
		}
		for _, reason := range dead {
			if !errors.Is(reason, idem.ErrInvalidKey) {
				t.Errorf("%s: the reason %v does not wrap idem.ErrInvalidKey", tc.name, reason)
			}
		}
		mu.Unlock()
	}
}

func TestMsgIDWithoutTheHeader(t *testing.T) {
	_, js := connect(t, startNATS(t))
	cons := stream(t, js, "NOID", jetstream.StreamConfig{}, jetstream.ConsumerConfig{})
	publish(t, js, "NOID.x", "with-id")
	publish(t, js, "NOID.x", "")
	b, err := cons.Fetch(2, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for m := range b.Messages() {
		keys = append(keys, idemjetstream.MsgID(m))
	}
	if len(keys) != 2 || keys[0] != "with-id" || !strings.HasPrefix(keys[1], "nats-seq:NOID:2:") {
		t.Fatalf("keys %q, want the Nats-Msg-Id and then nats-seq:NOID:2:<time stored>", keys)
	}
}

// TestRunTakesAPanicForAFailure: a handler's panic does not reach Run's
// caller; its message is Nak'ed with the retry delay, as for an error, and
// handled on its next delivery.
func TestRunTakesAPanicForAFailure(t *testing.T) {
	_, js := connect(t, startNATS(t))
	keeper, _ := miniKeeper(t)
	cons := stream(t, js, "PANIC", jetstream.StreamConfig{}, jetstream.ConsumerConfig{AckWait: 30 * time.Second})
	publish(t, js, "PANIC.x", "boom")
	var mu sync.Mutex
	var delivered []uint64
	handle := func(ctx context.Context, m jetstream.Msg) error {
		md, err := m.Metadata()
		if err != nil {
			return err
		}
		mu.Lock()
		delivered = append(delivered, md.NumDelivered)
		first := len(delivered) == 1
		mu.Unlock()
		if first {
			panic("the first run panics")
		}
		return nil
	}
	r, err := idemjetstream.New(keeper, "panic", cons, handle, idemjetstream.WithRetryDelay(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan any, 1)
	go func() {
		defer func() { done <- recover() }()
		_ = r.Run(ctx)
	}()
	// Settled long before the 30s AckWait: Nak'ed, not left to time out.
	waitSettled(t, cons, 20*time.Second)
	cancel()
	if p := <-done; p != nil {
		t.Fatalf("Run's caller recovered %v, want no panic", p)
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(delivered) != "[1 2]" {
		t.Errorf("boom ran at deliveries %v, want [1 2] (the panic, then the redelivery)", delivered)
	}
}
