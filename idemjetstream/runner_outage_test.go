package idemjetstream_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemjetstream"
	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
)

// outageReports collects the errors a runner reports (WithErrorHandler)
// that say Redis was unreachable.
type outageReports struct {
	mu    sync.Mutex
	n     int
	other []error
	more  chan struct{} // a token for each outage reported
}

func newOutageReports() *outageReports {
	return &outageReports{more: make(chan struct{}, 1<<16)}
}

func (o *outageReports) report(err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !errors.Is(err, idem.ErrUnavailable) {
		o.other = append(o.other, err)
		return
	}
	o.n++
	select {
	case o.more <- struct{}{}:
	default:
	}
}

func (o *outageReports) count() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.n
}

// TestRunSurvivesARedisOutage: a batch none of whose claims reached Redis
// does not stop Run: its message is Nak'ed with the retry delay, the outage
// reported, and once Redis is back the message is handled, once.
func TestRunSurvivesARedisOutage(t *testing.T) {
	_, js := connect(t, startNATS(t))
	mr := miniredis.RunT(t)
	// Redis is cut off behind a proxy, rather than closed and started again
	// on its port, which another process may take meanwhile.
	p, err := faultproxy.New(mr.Addr(), 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetryBackoff: 16 * time.Millisecond})
	t.Cleanup(func() { c.Close() })
	keeper, err := idem.NewRedis(c)
	if err != nil {
		t.Fatal(err)
	}
	cons := stream(t, js, "BLIP", jetstream.StreamConfig{}, jetstream.ConsumerConfig{AckWait: 30 * time.Second})

	var runs atomic.Int64
	reports := newOutageReports()
	r, err := idemjetstream.New(keeper, "orders", cons, func(ctx context.Context, m jetstream.Msg) error {
		runs.Add(1)
		return nil
	}, idemjetstream.WithRetryDelay(100*time.Millisecond), idemjetstream.WithErrorHandler(reports.report))
	if err != nil {
		t.Fatal(err)
	}

	p.Set(faultproxy.Faults{Cut: 1}) // Redis goes away for a moment
	p.CutAll()
	publish(t, js, "BLIP.x", "id-1")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()

	select {
	case err := <-done:
		t.Fatalf("Run returned %v during a short Redis outage: the runner has stopped for good (documented: Nak with the retry delay, and go on)", err)
	case <-time.After(5 * time.Second):
	}
	if n := reports.count(); n == 0 {
		t.Errorf("Run reported no outage to the error handler in 5s of Redis unreachable")
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("the handler ran %d times while Redis was unreachable, want 0", n)
	}
	p.Set(faultproxy.Faults{}) // and comes back
	deadline := time.Now().Add(10 * time.Second)
	for runs.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times after Redis came back, want 1", runs.Load())
	}
	waitSettled(t, cons, 10*time.Second)
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run returned %v, want context.Canceled", err)
	}
	if runs.Load() != 1 {
		t.Errorf("handler ran %d times, want 1", runs.Load())
	}
	reports.mu.Lock()
	defer reports.mu.Unlock()
	if len(reports.other) != 0 {
		t.Errorf("the error handler was told of other errors: %v", reports.other)
	}
}

// TestRunSurvivesARealRedisOutage is TestRunSurvivesARedisOutage against a
// real redis-server, killed while a message waits and started again: Run
// reports the outage and goes on fetching, handles no message without a
// claim, and handles the message once Redis is back, once.
func TestRunSurvivesARealRedisOutage(t *testing.T) {
	_, js := connect(t, startNATS(t))
	srv := redistest.Start(t)
	keeper, err := idem.NewRedis(redistest.NewClient(t, srv.Addr))
	if err != nil {
		t.Fatal(err)
	}
	cons := stream(t, js, "KILLREDIS", jetstream.StreamConfig{}, jetstream.ConsumerConfig{AckWait: 30 * time.Second})

	var runs atomic.Int64
	var delivered atomic.Uint64 // NumDelivered of the handled message
	reports := newOutageReports()
	r, err := idemjetstream.New(keeper, "orders", cons, func(ctx context.Context, m jetstream.Msg) error {
		runs.Add(1)
		if md, err := m.Metadata(); err == nil {
			delivered.Store(md.NumDelivered)
		}
		return nil
	}, idemjetstream.WithRetryDelay(50*time.Millisecond), idemjetstream.WithErrorHandler(reports.report))
	if err != nil {
		t.Fatal(err)
	}

	srv.Stop()
	publish(t, js, "KILLREDIS.x", "id-1")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()

	// Three outages reported: Run went on fetching after each.
	for i := range 3 {
		select {
		case err := <-done:
			t.Fatalf("Run returned %v while redis-server was down, after %d outages reported", err, i)
		case <-reports.more:
		case <-time.After(30 * time.Second):
			t.Fatalf("Run reported %d outages in 30s of redis-server down, want 3", i)
		}
	}
	if n := runs.Load(); n != 0 {
		t.Fatalf("the handler ran %d times while redis-server was down, want 0", n)
	}

	srv.Restart(t)
	waitSettled(t, cons, 20*time.Second)
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run returned %v, want context.Canceled", err)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times after redis-server came back, want 1", n)
	}
	if d := delivered.Load(); d < 4 {
		t.Errorf("the message was handled at delivery %d, want at least 4 (Nak'ed at each of the 3 outages reported)", d)
	}
	reports.mu.Lock()
	defer reports.mu.Unlock()
	if len(reports.other) != 0 {
		t.Errorf("the error handler was told of other errors: %v", reports.other)
	}
}
