package idemjetstream_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemjetstream"
	"github.com/nats-io/nats.go/jetstream"
)

// TestRunDeadLetters: on nats-server, a message idem rejects and messages
// whose deliveries run out (MaxDeliver 2) with their handler failing or
// panicking each time are given to the dead-letter hook, published to a
// dead-letter stream with their reason, stream sequence and delivery count,
// and terminated; none vanishes untold, and a hook that fails keeps its
// message for the next delivery.
func TestRunDeadLetters(t *testing.T) {
	_, js := connect(t, startNATS(t))
	var observed []error // the reasons of the dead letters the Observer was told of
	var omu sync.Mutex
	keeper, _ := miniKeeper(t, idem.WithObserver(idem.ObserverFunc(func(ctx context.Context, ev idem.Event) {
		if ev.Step == idem.StepStream && ev.Result == idem.ResultDeadLettered && ev.Scope == "dl" {
			omu.Lock()
			defer omu.Unlock()
			observed = append(observed, ev.Err)
		}
	})))
	cons := stream(t, js, "DL", jetstream.StreamConfig{}, jetstream.ConsumerConfig{AckWait: 30 * time.Second, MaxDeliver: 2})
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "DEAD", Subjects: []string{"dead.>"}}); err != nil {
		t.Fatal(err)
	}
	publish(t, js, "DL.ok", "ok")          // seq 1: handled
	publish(t, js, "DL.reject", "bad")     // seq 2: an invalid key
	publish(t, js, "DL.fail", "poison")    // seq 3: fails at both deliveries
	publish(t, js, "DL.panic", "panics")   // seq 4: panics at both deliveries
	publish(t, js, "DL.fail", "fail-once") // seq 5: fails at delivery 1 only

	var c counter
	var mu sync.Mutex
	reasons := map[string][]error{}
	publishDead := idemjetstream.PublishDeadLetter(js, "dead.x")
	r, err := idemjetstream.New(keeper, "dl", cons, func(ctx context.Context, m jetstream.Msg) error {
		id := m.Headers().Get(jetstream.MsgIDHeader)
		c.add(id)
		switch {
		case id == "poison", id == "fail-once" && c.get(id) == 1:
			return errors.New("the handler fails")
		case id == "panics":
			panic("the handler panics")
		}
		return nil
	},
		idemjetstream.WithRetryDelay(50*time.Millisecond),
		idemjetstream.WithKey(func(m jetstream.Msg) string {
			if m.Subject() == "DL.reject" {
				return "" // an invalid key: rejected
			}
			return idemjetstream.MsgID(m)
		}),
		idemjetstream.WithDeadLetter(func(ctx context.Context, m jetstream.Msg, reason error) error {
			id := m.Headers().Get(jetstream.MsgIDHeader)
			mu.Lock()
			reasons[id] = append(reasons[id], reason)
			first := len(reasons[id]) == 1
			mu.Unlock()
			if id == "bad" && first {
				return errors.New("the dead-letter store is down") // kept: comes again
			}
			return publishDead(ctx, m, reason)
		}))
	if err != nil {
		t.Fatal(err)
	}
	stop := run(t, r)
	info := waitSettled(t, cons, 20*time.Second)
	if err := stop(); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
	if info.AckFloor.Stream != 5 {
		t.Errorf("ack floor %d, want 5: every message settled", info.AckFloor.Stream)
	}
	for id, want := range map[string]int{"ok": 1, "bad": 0, "poison": 2, "panics": 2, "fail-once": 2} {
		if n := c.get(id); n != want {
			t.Errorf("%s handled %d times, want %d", id, n, want)
		}
	}

	mu.Lock()
	defer mu.Unlock()
	for id, want := range map[string][]error{
		"bad":    {idem.ErrInvalidKey},
		"poison": {idemjetstream.ErrMaxDeliveries},
		"panics": {idemjetstream.ErrMaxDeliveries},
	} {
		rs := reasons[id]
		if n := map[string]int{"bad": 2}[id]; len(rs) != max(n, 1) {
			t.Errorf("%s: the hook was called %d times (%v), want %d", id, len(rs), rs, max(n, 1))
			continue
		}
		for _, w := range want {
			if !errors.Is(rs[len(rs)-1], w) {
				t.Errorf("%s: reason %v does not wrap %v", id, rs[len(rs)-1], w)
			}
		}
	}
	if !strings.Contains(reasons["panics"][0].Error(), "the handler panics") ||
		!strings.Contains(reasons["poison"][0].Error(), "the handler fails") {
		t.Errorf("the reasons %v and %v do not say why the handler failed", reasons["panics"], reasons["poison"])
	}
	if len(reasons) != 3 {
		t.Errorf("the hook was told of %d messages (%v), want bad, poison and panics", len(reasons), reasons)
	}
	omu.Lock()
	var invalid, ranOut int
	for _, err := range observed {
		switch {
		case errors.Is(err, idem.ErrInvalidKey):
			invalid++
		case errors.Is(err, idemjetstream.ErrMaxDeliveries):
			ranOut++
		}
	}
	if len(observed) != 3 || invalid != 1 || ranOut != 2 {
		t.Errorf("the Observer was told of dead letters %v, want bad's (an invalid key) once, poison's and panics' (deliveries ran out)", observed)
	}
	omu.Unlock()

	// The dead-letter stream holds one letter each, with the message.
	dead, err := js.OrderedConsumer(context.Background(), "DEAD", jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := dead.Fetch(10, jetstream.FetchMaxWait(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for m := range b.Messages() {
		h := m.Headers()
		id := h.Get(idemjetstream.HeaderMsgID)
		got[id] = strings.Join([]string{h.Get(idemjetstream.HeaderStream), h.Get(idemjetstream.HeaderStreamSeq),
			h.Get(idemjetstream.HeaderDeliveries), h.Get(idemjetstream.HeaderSubject), string(m.Data())}, " ")
		if !strings.Contains(h.Get(idemjetstream.HeaderReason), map[string]string{
			"bad": "invalid key", "poison": "the handler fails", "panics": "the handler panics"}[id]) {
			t.Errorf("%s: reason header %q", id, h.Get(idemjetstream.HeaderReason))
		}
		if !strings.HasPrefix(h.Get(jetstream.MsgIDHeader), "dead-letter:DL:") {
			t.Errorf("%s: the dead letter's Nats-Msg-Id is %q", id, h.Get(jetstream.MsgIDHeader))
		}
	}
	for id, want := range map[string]string{
		"bad":    "DL 2 2 DL.reject bad",
		"poison": "DL 3 2 DL.fail poison",
		"panics": "DL 4 2 DL.panic panics",
	} {
		if got[id] != want {
			t.Errorf("dead letter of %s: %q, want %q (stream, sequence, deliveries, subject, data)", id, got[id], want)
		}
	}
	if len(got) != 3 {
		t.Errorf("%d dead letters (%v), want 3", len(got), got)
	}
}
