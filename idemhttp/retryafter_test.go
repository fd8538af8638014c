package idemhttp

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// conflictWhileRunning holds a first request in its handler and answers a
// second with the same key, on miniredis, whose clock stands still: the lease
// left is exactly the lease.
func conflictWhileRunning(t *testing.T, b *redistest.Backend, lease time.Duration, opts ...Option) (*httptest.ResponseRecorder, idem.Event) {
	t.Helper()
	release := make(chan struct{})
	g := newGuarded(t, b, []idem.Option{idem.WithLease(lease)}, func(w http.ResponseWriter, r *http.Request) {
		<-release
		w.WriteHeader(http.StatusCreated)
	}, opts...)
	first := make(chan int)
	go func() { first <- g.serve(post("/pay", "a", DefaultKeyHeader, "k")).Code }()
	g.next(t, idem.ResultClaimed)
	rec := g.serve(post("/pay", "a", DefaultKeyHeader, "k"))
	ev := g.next(t, idem.ResultInProgress)
	close(release)
	assert.Equal(t, http.StatusCreated, <-first)
	return rec, ev
}

func TestRetryAfterIsAShortHint(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lease time.Duration
		opts  []Option
		want  int // seconds
	}{
		{"default hint, whatever the lease", idem.DefaultLease, nil, 1},
		{"the hint set", idem.DefaultLease, []Option{WithRetryAfter(5 * time.Second)}, 5},
		{"never more than the lease left", 3 * time.Second, []Option{WithRetryAfter(time.Hour)}, 3},
		{"MaxDuration announces the whole lease left", idem.DefaultLease, []Option{WithRetryAfter(idem.MaxDuration)}, 30},
		{"a sub-second hint rounds up to HTTP's second", idem.DefaultLease, []Option{WithRetryAfter(200 * time.Millisecond)}, 1},
		{"a lease left of 1.5 s rounds up", 1500 * time.Millisecond, []Option{WithRetryAfter(time.Hour)}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec, ev := conflictWhileRunning(t, redistest.Miniredis(t), tc.lease, tc.opts...)
			requireProblem(t, rec, http.StatusConflict, ProblemInProgress)
			assert.Equal(t, strconv.Itoa(tc.want), rec.Header().Get("Retry-After"))
			assert.Equal(t, tc.lease, ev.LeaseLeft)
		})
	}
}

// On a real Redis, whose clock moves, the default hint is 1 s too.
func TestRetryAfterHintOnRedis(t *testing.T) {
	rec, ev := conflictWhileRunning(t, redistest.Real(t), idem.DefaultLease)
	assert.Equal(t, http.StatusConflict, rec.Code)
	assert.Equal(t, "1", rec.Header().Get("Retry-After"))
	assert.Greater(t, ev.LeaseLeft, time.Duration(0))
	assert.LessOrEqual(t, ev.LeaseLeft, idem.DefaultLease)
}

func TestRetryAfterMustBePositive(t *testing.T) {
	k, err := idem.NewRedis(redistest.Miniredis(t).Client)
	require.NoError(t, err)
	for _, d := range []time.Duration{0, -time.Second} {
		_, err := New(k, WithRetryAfter(d))
		assert.ErrorIs(t, err, idem.ErrInvalidConfig, "WithRetryAfter(%s)", d)
	}
}
