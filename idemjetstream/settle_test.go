package idemjetstream

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
)

// settledMsg records how a message was settled.
type settledMsg struct {
	jetstream.Msg // nil: only the settling methods are called
	got           string
	key           string // its key, for a Runner whose key function is msgKey
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
		if err := settle(m, tc.res, results, 250*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		if m.got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, m.got, tc.want)
		}
	}
	m := &settledMsg{}
	_ = settle(m, retry, []idem.MessageResult{retry}, 0)
	if m.got != "Nak" {
		t.Errorf("retry delay 0: %s, want Nak", m.got)
	}
}

// outageRunner returns a Runner of msgKey keys on a Keeper whose Redis is
// gone, with the retry delay 250ms and lease, and the errors it reports.
func outageRunner(t *testing.T, lease time.Duration) (r *Runner, runs func() int, reported func() []error) {
	t.Helper()
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetryBackoff: 16 * time.Millisecond, DialerRetryTimeout: 5 * time.Millisecond})
	t.Cleanup(func() { c.Close() })
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
	errs := reported()
	if len(errs) != 1 || !errors.Is(errs[0], idem.ErrUnavailable) {
		t.Fatalf("the error handler was told %v, want one error wrapping idem.ErrUnavailable", errs)
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
