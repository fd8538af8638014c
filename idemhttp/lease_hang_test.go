package idemhttp

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stallRenewals makes the lease renewals (extend.lua) of a Keeper on b hang,
// whatever their context says (as go-redis does without
// ContextTimeoutEnabled, waiting out its own timeouts), until release is
// closed, and then fail as a read timeout would, unsent. It counts them in
// hung.
type stallRenewals struct {
	release chan struct{}
	hung    atomic.Int32
}

// newStallRenewals hooks a stallRenewals to b's client; its release is
// closed when the test ends.
func newStallRenewals(t *testing.T, b *redistest.Backend) *stallRenewals {
	s := &stallRenewals{release: make(chan struct{})}
	t.Cleanup(func() { close(s.release) })
	b.Client.AddHook(redistest.ScriptHook{On: func(ctx context.Context, name string, cmd redis.Cmder, send func() error) error {
		if name != "extend" {
			return send()
		}
		s.hung.Add(1)
		<-s.release
		return errors.New("read tcp 127.0.0.1: i/o timeout")
	}})
	return s
}

// TestHandlerCancelledWhenTheLeaseRunsOutDuringAHungRenewal: the handler's
// context ends with idem.ErrLeaseLost when its lease runs out while its
// renewal hangs; the request returns then, without waiting for the
// renewal, and stores nothing.
func TestHandlerCancelledWhenTheLeaseRunsOutDuringAHungRenewal(t *testing.T) {
	b := redistest.Miniredis(t)
	s := newStallRenewals(t, b)
	k, err := idem.NewRedis(b.Client, idem.WithLease(300*time.Millisecond), idem.WithRetention(time.Minute))
	require.NoError(t, err)
	guard, err := New(k)
	require.NoError(t, err)
	var cause error
	h := guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
		cause = context.Cause(r.Context())
		w.WriteHeader(http.StatusInternalServerError)
	}))
	req := httptest.NewRequest(http.MethodPost, "/payments", nil)
	req.Header.Set(DefaultKeyHeader, "k")
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.ServeHTTP(httptest.NewRecorder(), req)
	}()
	select {
	case <-done:
		assert.ErrorIs(t, cause, idem.ErrLeaseLost)
		assert.Positive(t, s.hung.Load(), "the renewal was under way, and still is")
		r, err := k.Inspect(context.Background(), "", "k")
		require.NoError(t, err)
		assert.Equal(t, idem.StatePending, r.State, "nothing stored, nothing released")
	case <-time.After(20 * time.Second): // the renewal hangs until the test ends
		assert.Fail(t, "the handler's context was not cancelled when its lease ran out")
	}
}
