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
