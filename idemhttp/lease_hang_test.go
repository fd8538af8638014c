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
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stallRenewals is a Store whose renewals hang, whatever their context says
// (as go-redis does without ContextTimeoutEnabled, waiting out its own
// timeouts), until release is closed.
type stallRenewals struct {
	idem.Store
	release chan struct{}
	hung    atomic.Int32
}

func (s *stallRenewals) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	s.hung.Add(1)
	<-s.release
	return errors.New("read tcp 127.0.0.1: i/o timeout")
}

// TestHandlerCancelledWhenTheLeaseRunsOutDuringAHungRenewal: the handler's
// context ends with idem.ErrLeaseLost when its lease runs out while its
// renewal hangs; the request returns then, without waiting for the
// renewal, and stores nothing.
func TestHandlerCancelledWhenTheLeaseRunsOutDuringAHungRenewal(t *testing.T) {
	b := redistest.Miniredis(t)
	rs, err := idem.NewRedisStore(b.Client)
	require.NoError(t, err)
	s := &stallRenewals{Store: rs, release: make(chan struct{})}
	t.Cleanup(func() { close(s.release) })
	k, err := idem.New(s, idem.WithLease(300*time.Millisecond), idem.WithRetention(time.Minute))
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
		r, err := rs.Inspect(context.Background(), k.RecordID("", "k"))
		require.NoError(t, err)
		assert.Equal(t, idem.StatePending, r.State, "nothing stored, nothing released")
	case <-time.After(20 * time.Second): // the renewal hangs until the test ends
		assert.Fail(t, "the handler's context was not cancelled when its lease ran out")
	}
}
