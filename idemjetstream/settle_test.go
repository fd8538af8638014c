package idemjetstream

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/nats-io/nats.go/jetstream"
)

// settledMsg records how a message was settled.
type settledMsg struct {
	jetstream.Msg // nil: only the settling methods are called
	got           string
}

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
