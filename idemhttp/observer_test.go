package idemhttp

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// syncBuffer is a bytes.Buffer safe for a logger and a test at once.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// lines returns the JSON lines written since the last call.
func (b *syncBuffer) lines(t *testing.T) []map[string]any {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(&b.buf)
	for sc.Scan() {
		var line map[string]any
		require.NoError(t, json.Unmarshal(sc.Bytes(), &line), "%s", sc.Text())
		out = append(out, line)
	}
	b.buf.Reset()
	return out
}

// A guarded request writes one Debug line through SlogObserver, its own:
// the claim and the completion are marked as the request's and left out. A
// replay's line names the attempt that ran it, as the claim's does.
func TestSlogOneDebugLinePerRequest(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		out := &syncBuffer{}
		logger := slog.New(slog.NewJSONHandler(out, &slog.HandlerOptions{Level: slog.LevelDebug}))
		var mu sync.Mutex
		var steps []idem.Event
		all := idem.ObserverFunc(func(_ context.Context, ev idem.Event) {
			mu.Lock()
			defer mu.Unlock()
			steps = append(steps, ev)
		})
		k, err := idem.NewRedis(b.Client, idem.WithObserver(idem.SlogObserver(logger, nil), all))
		require.NoError(t, err)
		guard, err := New(k)
		require.NoError(t, err)
		h := guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
		serve := func(r *http.Request) int {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, r)
			return rec.Code
		}

		for _, want := range []struct {
			msg    string
			status int
		}{{"idem request: done", 201}, {"idem request: replayed", 201}} {
			require.Equal(t, want.status, serve(post("/payments", "10 EUR", DefaultKeyHeader, "pay-1")))
			lines := out.lines(t)
			require.Len(t, lines, 1, "one line per request: %v", lines)
			assert.Equal(t, want.msg, lines[0]["msg"])
			assert.Equal(t, "DEBUG", lines[0]["level"])
			assert.EqualValues(t, 1, lines[0]["idem.attempt"], "%s: the attempt that ran it", want.msg)
			assert.EqualValues(t, want.status, lines[0]["idem.status"])
		}

		// A client error is logged at Info: the claim's line and the
		// request's.
		require.Equal(t, http.StatusUnprocessableEntity, serve(post("/payments", "20 EUR", DefaultKeyHeader, "pay-1")))
		var msgs []string
		for _, l := range out.lines(t) {
			msgs = append(msgs, l["msg"].(string))
		}
		assert.Equal(t, []string{"idem claim: mismatch", "idem request: mismatch"}, msgs)

		// The steps of a direct call are not a request's.
		_, err = idem.Do(context.Background(), k, "", "direct", func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
		assert.Len(t, out.lines(t), 2, "a direct call logs its claim and its completion")

		mu.Lock()
		defer mu.Unlock()
		for _, ev := range steps {
			direct := ev.Scope == "" && ev.ID == k.RecordID("", "direct")
			want := ev.Step != idem.StepRequest && !direct
			assert.Equal(t, want, ev.InRequest, "%s:%s", ev.Step, ev.Result)
		}
	})
}
