package idemhttp

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// eventID is a key function that reads a JSON event's "id", as a Stripe
// webhook carries it, and refuses a body that is not JSON.
func eventID(r *http.Request, body []byte) (string, error) {
	var ev struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal(body, &ev); err != nil {
		return "", &RefusedError{Status: http.StatusBadRequest, Detail: "The body is not a JSON event.", Err: err}
	}
	return ev.ID, nil
}

// echoBody answers the request's body, so that a test sees what the handler
// got.
func echoBody(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
}

func TestKeyFuncRedeliveryRunsOnce(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		g := newGuarded(t, b, nil, echoBody, WithKeyFunc(eventID))
		delivery := `{"id":"evt_1","type":"invoice.paid"}`
		first := g.serve(post("/webhooks/stripe", delivery))
		require.Equal(t, http.StatusOK, first.Code, "body: %s", first.Body)
		assert.Equal(t, delivery, first.Body.String(), "the handler gets the whole body")
		assert.Equal(t, g.k.RecordID("", "evt_1"), g.next(t, idem.ResultClaimed).ID)

		again := g.serve(post("/webhooks/stripe", delivery, DefaultKeyHeader, "ignored"))
		assert.Equal(t, http.StatusOK, again.Code)
		assert.Equal(t, "true", again.Header().Get(ReplayedHeader))
		assert.Equal(t, delivery, again.Body.String())

		other := g.serve(post("/webhooks/stripe", `{"id":"evt_2"}`))
		assert.Equal(t, http.StatusOK, other.Code)
		assert.Empty(t, other.Header().Get(ReplayedHeader))
		assert.Equal(t, int64(2), g.runs.Load(), "one run per event")
	})
}

// The key of a GitHub delivery is a header of its own: WithKeyHeader reads it.
func TestKeyHeaderOfAWebhook(t *testing.T) {
	g := newGuarded(t, redistest.Miniredis(t), nil, echoBody, WithKeyHeader("X-GitHub-Delivery"))
	for range 2 {
		rec := g.serve(post("/webhooks/github", `{"action":"opened"}`, "X-GitHub-Delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958"))
		assert.Equal(t, http.StatusOK, rec.Code)
	}
	assert.Equal(t, int64(1), g.runs.Load())
}

// An inbox is (provider, event id): the same id from two providers is two
// records.
func TestKeyFuncWithProviderScope(t *testing.T) {
	g := newGuarded(t, redistest.Miniredis(t), nil, echoBody, WithKeyFunc(eventID),
		WithScope(func(r *http.Request) (string, error) {
			provider, ok := strings.CutPrefix(r.URL.Path, "/webhooks/")
			if !ok || provider == "" {
				return "", Refuse(http.StatusNotFound, "No such webhook provider.")
			}
			return provider, nil
		}))
	for _, path := range []string{"/webhooks/a", "/webhooks/b", "/webhooks/a"} {
		assert.Equal(t, http.StatusOK, g.serve(post(path, `{"id":"evt_1"}`)).Code)
	}
	assert.Equal(t, int64(2), g.runs.Load())
	requireProblem(t, g.serve(post("/webhooks/", `{"id":"evt_1"}`)), http.StatusNotFound, ProblemScopeRefused)
}

func TestKeyFuncAnswers(t *testing.T) {
	for _, tc := range []struct {
		name    string
		keyFunc func(r *http.Request, body []byte) (string, error)
		opts    []Option
		body    string
		status  int
		problem string // "": the handler's answer
		event   idem.Result
	}{
		{name: "no key, required", keyFunc: eventID, body: `{"type":"ping"}`, status: 400, problem: ProblemKeyMissing, event: idem.ResultInvalid},
		{name: "no key, not required: unguarded", keyFunc: eventID, opts: []Option{WithKeyRequired(false)}, body: `{"type":"ping"}`, status: 200},
		{name: "an invalid key", keyFunc: eventID, body: `{"id":"evt\n1"}`, status: 400, problem: ProblemKeyInvalid, event: idem.ResultInvalid},
		{name: "refused by the function", keyFunc: eventID, body: `not json`, status: 400, problem: ProblemKeyRefused, event: idem.ResultRefused},
		{name: "refused with a status", keyFunc: func(*http.Request, []byte) (string, error) {
			return "", Refuse(http.StatusUnauthorized, "The signature does not verify.")
		}, body: `{"id":"evt_1"}`, status: 401, problem: ProblemKeyRefused, event: idem.ResultRefused},
		{name: "body over the limit: the function is not asked", keyFunc: func(*http.Request, []byte) (string, error) {
			panic("asked")
		}, opts: []Option{WithBodyLimit(4)}, body: `{"id":"evt_1"}`, status: 413, problem: ProblemBodyTooLarge, event: idem.ResultTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := redistest.Miniredis(t)
			g := newGuarded(t, b, nil, echoBody, append([]Option{WithKeyFunc(tc.keyFunc)}, tc.opts...)...)
			rec := g.serve(post("/hook", tc.body))
			if tc.problem == "" {
				require.Equal(t, tc.status, rec.Code)
				assert.Equal(t, tc.body, rec.Body.String(), "an unguarded request keeps its body")
				assert.Empty(t, b.Mini.Keys())
				return
			}
			requireProblem(t, rec, tc.status, tc.problem)
			ev := g.next(t, tc.event)
			assert.Equal(t, tc.status, ev.Status)
			assert.Zero(t, g.runs.Load())
			assert.Empty(t, b.Mini.Keys(), "Redis is not touched")
		})
	}
}

// The key function may read r.Body (it was read already, and is given
// back); the handler still gets the whole body, and so does the fingerprint.
func TestKeyFuncReadingTheBodyAgain(t *testing.T) {
	var fingerprinted atomic.Value
	g := newGuarded(t, redistest.Miniredis(t), nil, echoBody,
		WithKeyFunc(func(r *http.Request, body []byte) (string, error) {
			again, err := io.ReadAll(r.Body)
			if err != nil || string(again) != string(body) {
				return "", Refuse(http.StatusInternalServerError, "r.Body is not the body")
			}
			return eventID(r, body)
		}),
		WithFingerprint(func(r *http.Request, body []byte) []byte {
			fingerprinted.Store(string(body))
			return body
		}))
	rec := g.serve(post("/hook", `{"id":"evt_9","n":1}`))
	require.Equal(t, http.StatusOK, rec.Code, "body: %s", rec.Body)
	assert.Equal(t, `{"id":"evt_9","n":1}`, rec.Body.String())
	assert.Equal(t, `{"id":"evt_9","n":1}`, fingerprinted.Load())

	requireProblem(t, g.serve(post("/hook", `{"id":"evt_9","n":2}`)), http.StatusUnprocessableEntity, ProblemMismatch)
}
