package idem

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// SlogObserver logs each event once, at its level, with what it carries.
func TestSlogObserverLevelsAndAttrs(t *testing.T) {
	var buf bytes.Buffer
	logger := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	obs := SlogObserver(logger, func(context.Context) []slog.Attr { return []slog.Attr{slog.String("trace_id", "t1")} })
	for _, row := range []struct {
		ev    Event
		level string
	}{
		{Event{Step: StepClaim, Result: ResultReplayed, Token: 7, Attempt: 1}, "DEBUG"},
		{Event{Step: StepRequest, Result: ResultMismatch, Status: 422}, "INFO"},
		{Event{Step: StepRequest, Result: ResultRefused, Status: 403}, "INFO"},
		{Event{Step: StepClaim, Result: ResultInProgress, LeaseLeft: 2 * time.Second}, "DEBUG"},
		{Event{Step: StepRequest, Result: ResultFailOpen, Err: ErrUnavailable}, "WARN"},
		{Event{Step: StepComplete, Result: ResultLeaseLost, Held: time.Second, Err: ErrLeaseLost}, "WARN"},
		{Event{Step: StepClaim, Result: ResultCorrupt, Err: ErrCorrupt}, "ERROR"},
	} {
		buf.Reset()
		obs.Observe(context.Background(), row.ev)
		var line map[string]any
		require.NoError(t, json.Unmarshal(buf.Bytes(), &line), "one JSON line: %s", buf.String())
		name := row.ev.Step.String() + ":" + row.ev.Result.String()
		assert.Equal(t, row.level, line["level"], name)
		assert.Equal(t, "idem "+row.ev.Step.String()+": "+row.ev.Result.String(), line["msg"], name)
		assert.Equal(t, "t1", line["trace_id"], name)
		assert.Equal(t, row.ev.Status != 0, line["idem.status"] != nil, "%s: status only when set", name)
		assert.Equal(t, row.ev.LeaseLeft != 0, line["idem.lease_left"] != nil, "%s: lease left only when set", name)
		assert.Equal(t, row.ev.Held != 0, line["idem.held"] != nil, "%s: held only when set", name)
		assert.Equal(t, row.ev.Err != nil, line["error"] != nil, "%s: error only when set", name)
	}
}

// Durations are logged as durations, not as integer nanoseconds, by the
// JSON handler too.
func TestSlogObserverDurations(t *testing.T) {
	var buf bytes.Buffer
	obs := SlogObserver(slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})), nil)
	obs.Observe(context.Background(), Event{Step: StepComplete, Result: ResultLeaseLost,
		Took: 1500 * time.Microsecond, Held: 2 * time.Second, LeaseLeft: 250 * time.Millisecond})
	var line map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &line), "one JSON line: %s", buf.String())
	for attr, want := range map[string]time.Duration{
		"idem.took": 1500 * time.Microsecond, "idem.held": 2 * time.Second, "idem.lease_left": 250 * time.Millisecond,
	} {
		s, ok := line[attr].(string)
		require.True(t, ok, "%s is %T %v, want a duration string", attr, line[attr], line[attr])
		d, err := time.ParseDuration(s)
		require.NoError(t, err, attr)
		assert.Equal(t, want, d, attr)
	}
	assert.Equal(t, "1.5ms", line["idem.took"])
}

// A layer's request writes one line at Debug, its own: the steps it took
// (InRequest) are left out at Debug, and logged at the levels above.
func TestSlogObserverOneDebugLinePerRequest(t *testing.T) {
	var buf bytes.Buffer
	obs := SlogObserver(slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})), nil)
	for _, row := range []struct {
		ev     Event
		logged bool
	}{
		{Event{Step: StepClaim, Result: ResultClaimed, InRequest: true}, false},
		{Event{Step: StepComplete, Result: ResultDone, InRequest: true}, false},
		{Event{Step: StepExtend, Result: ResultDone, InRequest: true}, false},
		{Event{Step: StepRequest, Result: ResultDone, Status: 201}, true},
		{Event{Step: StepClaim, Result: ResultRecovered, InRequest: true}, true},
		{Event{Step: StepComplete, Result: ResultLeaseLost, InRequest: true}, true},
		{Event{Step: StepClaim, Result: ResultMismatch, InRequest: true}, true},
		{Event{Step: StepClaim, Result: ResultClaimed}, true},
		{Event{Step: StepComplete, Result: ResultDone}, true},
	} {
		buf.Reset()
		obs.Observe(context.Background(), row.ev)
		name := row.ev.Step.String() + ":" + row.ev.Result.String()
		if row.ev.InRequest {
			name += " in a request"
		}
		assert.Equal(t, row.logged, buf.Len() > 0, "%s: %s", name, buf.String())
	}
}
