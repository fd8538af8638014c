package idemjetstream

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/nats-io/nats.go/jetstream"
)

// settledMsg records how a message was settled.
type settledMsg struct {
	jetstream.Msg // nil: only the settling methods are called
	got           string
	key           string                 // its key, for a Runner whose key function is msgKey
	md            *jetstream.MsgMetadata // nil: no metadata
}

func (m *settledMsg) Metadata() (*jetstream.MsgMetadata, error) {
	if m.md == nil {
		return nil, errors.New("no metadata")
	}
	return m.md, nil
}

// msgKey is the key of a *settledMsg.
func msgKey(m jetstream.Msg) string { return m.(*settledMsg).key }

func (m *settledMsg) Ack() error { m.got = "Ack"; return nil }
func (m *settledMsg) Nak() error { m.got = "Nak"; return nil }
func (m *settledMsg) Term() error {
	m.got = "Term"
	return nil
}
func (m *settledMsg) NakWithDelay(d time.Duration) error {
	m.got = fmt.Sprintf("NakWithDelay(%s)", d)
	return nil
}

func TestSettleMapsEachResult(t *testing.T) {
	retry := idem.MessageResult{Status: idem.MessageRetry, Err: errors.New("handler failed"), First: 0}
	rejected := idem.MessageResult{Status: idem.MessageRejected, Err: idem.ErrInvalidKey, First: 0}
	for _, tc := range []struct {
		name    string
		res     idem.MessageResult
		results []idem.MessageResult // the batch, when the result refers to another
		want    string
	}{
		{"handled", idem.MessageResult{Ack: true, Status: idem.MessageHandled}, nil, "Ack"},
		{"replayed", idem.MessageResult{Ack: true, Status: idem.MessageReplayed}, nil, "Ack"},
		{"duplicate of an acknowledged one", idem.MessageResult{Ack: true, Status: idem.MessageDuplicate}, nil, "Ack"},
		{"handler failed", retry, nil, "NakWithDelay(250ms)"},
		{"unavailable", idem.MessageResult{Status: idem.MessageRetry, Err: fmt.Errorf("%w: refused", idem.ErrUnavailable)}, nil, "NakWithDelay(250ms)"},
		{"lease lost", idem.MessageResult{Status: idem.MessageRetry, Err: idem.ErrLeaseLost, Ran: true}, nil, "NakWithDelay(250ms)"},
		{"held elsewhere", idem.MessageResult{Status: idem.MessageRetry, Err: &idem.InProgressError{RetryAfter: 1500 * time.Millisecond}}, nil, "NakWithDelay(1.5s)"},
		{"held elsewhere, lease nearly out", idem.MessageResult{Status: idem.MessageRetry, Err: &idem.InProgressError{RetryAfter: time.Millisecond}}, nil, "NakWithDelay(100ms)"},
		{"stopped before its handler", idem.MessageResult{Status: idem.MessageRetry, Err: errStopped, Ran: true}, nil, "Nak"},
		{"rejected", rejected, nil, "Term"},
		{"duplicate of a retried one", idem.MessageResult{Status: idem.MessageDuplicate, Err: idem.ErrDuplicate, First: 0}, []idem.MessageResult{retry}, "NakWithDelay(250ms)"},
		{"duplicate of a rejected one", idem.MessageResult{Status: idem.MessageDuplicate, Err: idem.ErrDuplicate, First: 0}, []idem.MessageResult{rejected}, "Term"},
	} {
		m := &settledMsg{}
		results := tc.results
		if results == nil {
			results = []idem.MessageResult{tc.res}
		}
		r := &Runner{s: settings{retryDelay: 250 * time.Millisecond}}
		if err := r.settle(context.Background(), m, tc.res, results); err != nil {
			t.Fatal(err)
		}
		if m.got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, m.got, tc.want)
		}
	}
	m := &settledMsg{}
	_ = (&Runner{}).settle(context.Background(), m, retry, []idem.MessageResult{retry})
	if m.got != "Nak" {
		t.Errorf("retry delay 0: %s, want Nak", m.got)
	}
}

// outageRunner returns a Runner of msgKey keys on a Keeper whose Redis is
// gone, with the retry delay 250ms and lease, and the errors it reports.
func outageRunner(t *testing.T, lease time.Duration) (r *Runner, runs func() int, reported func() []error) {
	t.Helper()
	mr := miniredis.RunT(t)
	c := redistest.NewClient(t, mr.Addr())
	keeper, err := idem.NewRedis(c)
	if err != nil {
		t.Fatal(err)
	}
	mr.Close()
	var mu sync.Mutex
	var n int
	var errs []error
	s := defaultSettings()
	s.key, s.retryDelay = msgKey, 250*time.Millisecond
	s.onError = func(err error) {
		mu.Lock()
		defer mu.Unlock()
		errs = append(errs, err)
	}
	r = &Runner{keeper: keeper, scope: "outage", s: s, lease: lease, ackWait: time.Hour,
		handle: func(ctx context.Context, m jetstream.Msg) error {
			mu.Lock()
			defer mu.Unlock()
			n++
			return nil
		}}
	return r, func() int {
			mu.Lock()
			defer mu.Unlock()
			return n
		}, func() []error {
			mu.Lock()
			defer mu.Unlock()
			return append([]error(nil), errs...)
		}
}

func TestConsumeGoesOnWhenRedisIsUnreachable(t *testing.T) {
	r, runs, reported := outageRunner(t, idem.DefaultLease)
	msgs := []*settledMsg{{key: "a"}, {key: ""}, {key: "b"}, {key: "a"}}
	batch := make([]jetstream.Msg, len(msgs))
	for i, m := range msgs {
		batch[i] = m
	}
	backoff, err := r.consume(context.Background(), batch)
	if err != nil {
		t.Fatalf("consume returned %v for a batch that found Redis unreachable, want nil (reported, not returned)", err)
	}
	if !backoff {
		t.Error("consume did not ask Run to pause after a batch that found Redis unreachable")
	}
	if n := runs(); n != 0 {
		t.Errorf("%d handlers ran without a claim", n)
	}
	want := []string{"NakWithDelay(250ms)", "Term", "NakWithDelay(250ms)", "NakWithDelay(250ms)"}
	for i, m := range msgs {
		if m.got != want[i] {
			t.Errorf("message %d (key %q) settled %s, want %s", i, m.key, m.got, want[i])
		}
	}
	var outages, deadLetters int
	for _, err := range reported() {
		switch {
		case errors.Is(err, idem.ErrUnavailable):
			outages++
		case errors.Is(err, idem.ErrInvalidKey):
			deadLetters++ // no WithDeadLetter: the Term'ed message is reported
		}
	}
	if errs := reported(); len(errs) != 2 || outages != 1 || deadLetters != 1 {
		t.Fatalf("the error handler was told %v, want one error wrapping idem.ErrUnavailable and one of the invalid key terminated", errs)
	}
}

func TestConsumeReturnsARefusal(t *testing.T) {
	r, runs, reported := outageRunner(t, -time.Second) // a lease Consume refuses
	msgs := []*settledMsg{{key: "a"}, {key: "b"}}
	backoff, err := r.consume(context.Background(), []jetstream.Msg{msgs[0], msgs[1]})
	if !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("consume returned %v for a batch Consume refused, want idem.ErrInvalidConfig", err)
	}
	if backoff || runs() != 0 || len(reported()) != 0 {
		t.Errorf("backoff %v, %d handlers ran, reported %v: want no pause, no handler, no report", backoff, runs(), reported())
	}
	for i, m := range msgs {
		if m.got != "NakWithDelay(250ms)" {
			t.Errorf("message %d settled %s, want NakWithDelay(250ms)", i, m.got)
		}
	}
}

func TestUnreachableTellsAnOutage(t *testing.T) {
	alive := context.Background()
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		err  error
		want bool
	}{
		{"store unavailable", alive, fmt.Errorf("idem: Consume: no claim reached the store: %w", idem.ErrUnavailable), true},
		{"store unavailable, Run ending", ended, idem.ErrUnavailable, true},
		{"a timeout not Run's", alive, fmt.Errorf("dial: %w", context.DeadlineExceeded), true},
		{"a cancellation not Run's", alive, fmt.Errorf("read: %w", context.Canceled), true},
		{"Run's own end", ended, context.Canceled, false},
		{"a timeout as Run ends", ended, context.DeadlineExceeded, false},
		{"misuse", alive, fmt.Errorf("%w: WithLease", idem.ErrInvalidConfig), false},
	} {
		if got := unreachable(tc.ctx, tc.err); got != tc.want {
			t.Errorf("%s: unreachable %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestSettleDeadLettersBeforeTerm: a rejected message, and one that would
// come again at its last delivery, are given to the dead-letter hook, then
// terminated; a hook's error Nak's a rejected message (for the hook to be
// tried again) and terminates one at its last delivery all the same.
func TestSettleDeadLettersBeforeTerm(t *testing.T) {
	failed := idem.MessageResult{Status: idem.MessageRetry, Err: errors.New("handler failed"), Ran: true}
	held := idem.MessageResult{Status: idem.MessageRetry, Err: &idem.InProgressError{RetryAfter: time.Second}}
	rejected := idem.MessageResult{Status: idem.MessageRejected, Err: idem.ErrInvalidKey}
	for _, tc := range []struct {
		name      string
		res       idem.MessageResult
		delivered uint64 // of the consumer's MaxDeliver 3
		hookErr   error
		want      string
		reason    []error // what the reason given to the hook wraps; nil: no hook call
	}{
		{"handler failed, deliveries left", failed, 2, nil, "NakWithDelay(250ms)", nil},
		{"handler failed, last delivery", failed, 3, nil, "Term", []error{ErrMaxDeliveries, failed.Err}},
		{"held elsewhere, last delivery", held, 3, nil, "Term", []error{ErrMaxDeliveries, idem.ErrInProgress}},
		{"stopped, last delivery", idem.MessageResult{Status: idem.MessageRetry, Err: errStopped}, 3, nil, "Term", []error{ErrMaxDeliveries, errStopped}},
		{"rejected", rejected, 1, nil, "Term", []error{idem.ErrInvalidKey}},
		{"rejected, the hook fails", rejected, 1, errors.New("no dead-letter stream"), "NakWithDelay(250ms)", []error{idem.ErrInvalidKey}},
		{"rejected at its last delivery, the hook fails", rejected, 3, errors.New("no dead-letter stream"), "Term", []error{idem.ErrInvalidKey}},
		{"handler failed at its last delivery, the hook fails", failed, 3, errors.New("no dead-letter stream"), "Term", []error{ErrMaxDeliveries}},
	} {
		m := &settledMsg{md: &jetstream.MsgMetadata{NumDelivered: tc.delivered, Stream: "S"}}
		var calls []error
		var reported []error
		r := &Runner{maxDeliver: 3, s: settings{retryDelay: 250 * time.Millisecond,
			onError: func(err error) { reported = append(reported, err) },
			deadLetter: func(ctx context.Context, msg jetstream.Msg, reason error) error {
				if m.got != "" {
					t.Errorf("%s: the hook was called after %s", tc.name, m.got)
				}
				calls = append(calls, reason)
				return tc.hookErr
			}}}
		if err := r.settle(context.Background(), m, tc.res, []idem.MessageResult{tc.res}); err != nil {
			t.Fatal(err)
		}
		if m.got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, m.got, tc.want)
		}
		if tc.reason == nil {
			if len(calls) != 0 {
				t.Errorf("%s: the hook was called with %v, want no call", tc.name, calls)
			}
			continue
		}
		if len(calls) != 1 {
			t.Fatalf("%s: the hook was called %d times, want once", tc.name, len(calls))
		}
		for _, w := range tc.reason {
			if !errors.Is(calls[0], w) {
				t.Errorf("%s: the reason %v does not wrap %v", tc.name, calls[0], w)
			}
		}
		if (tc.hookErr != nil) != (len(reported) == 1) || (tc.hookErr != nil && !errors.Is(reported[0], tc.hookErr)) {
			t.Errorf("%s: the error handler was told %v, want the hook's error %v", tc.name, reported, tc.hookErr)
		}
	}
}

// TestSettleWithoutADeadLetterHookReports: without WithDeadLetter, a message
// given up on is terminated and the error handler told why.
func TestSettleWithoutADeadLetterHookReports(t *testing.T) {
	var reported []error
	r := &Runner{maxDeliver: 2, s: settings{retryDelay: time.Second, onError: func(err error) { reported = append(reported, err) }}}
	m := &settledMsg{md: &jetstream.MsgMetadata{NumDelivered: 2, Stream: "S", Sequence: jetstream.SequencePair{Stream: 7}}}
	fail := errors.New("handler failed")
	if err := r.settle(context.Background(), m, idem.MessageResult{Status: idem.MessageRetry, Err: fail, Ran: true}, nil); err != nil {
		t.Fatal(err)
	}
	if m.got != "Term" {
		t.Errorf("settled %s, want Term", m.got)
	}
	if len(reported) != 1 || !errors.Is(reported[0], ErrMaxDeliveries) || !errors.Is(reported[0], fail) ||
		!strings.Contains(reported[0].Error(), "message 7 of stream S (delivery 2)") {
		t.Errorf("the error handler was told %v, want the message, ErrMaxDeliveries and the handler's error", reported)
	}
}
