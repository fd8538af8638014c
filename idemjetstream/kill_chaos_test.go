package idemjetstream_test

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemjetstream"
	"github.com/idemkit/idem/internal/proc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/runlog"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
)

// The chaos kill test: three worker processes (this test binary, run
// again with IDEMJS_WORKER=chaos) consume a stream through a Runner on a
// redis-server with AOF, each handler's side effect a line in its
// worker's log (internal/runlog), while a worker is killed, the
// redis-server restarted, and another worker stopped past its lease.
const (
	chaosMessages    = 600
	chaosLease       = 2 * time.Second // the runners' lease, and the consumer's AckWait
	chaosDelay       = 50 * time.Millisecond
	chaosBatch       = 4
	chaosConcurrency = 1
	chaosStream      = "CHAOS"
	chaosConsumer    = "chaos"
	chaosScope       = "chaos"
)

// chaosWorker is a worker process of the chaos kill test: it runs a Runner
// until SIGTERM (exit 0) or SIGKILL; Run returning of itself is a failure
// (exit 2), an outage of Redis included.
func chaosWorker() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "worker:", err); return 2 }
	log, err := runlog.Open(os.Getenv("IDEMJS_LOG"))
	if err != nil {
		return fail(err)
	}
	defer log.Close()
	nc, err := nats.Connect(os.Getenv("IDEMJS_NATS"))
	if err != nil {
		return fail(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(err)
	}
	cons, err := js.Consumer(ctx, chaosStream, chaosConsumer)
	if err != nil {
		return fail(err)
	}
	rc := redis.NewClient(&redis.Options{Addr: os.Getenv("IDEMJS_REDIS")})
	defer rc.Close()
	keeper, err := idem.NewRedis(rc, idem.WithLease(chaosLease), idem.WithObserver(idem.ObserverFunc(func(_ context.Context, ev idem.Event) {
		switch {
		case ev.Step == idem.StepComplete && ev.Result == idem.ResultDone:
			_ = log.Stored(ev.ID, ev.Token)
		case ev.Step == idem.StepComplete && ev.Result == idem.ResultLeaseLost:
			_ = log.Fenced(ev.ID, ev.Token)
		case ev.Result == idem.ResultUnavailable:
			fmt.Fprintln(os.Stderr, "worker: unavailable:", ev.Step, ev.Err)
		}
	})))
	if err != nil {
		return fail(err)
	}
	// The side effect is a line of the log, made whatever the handler's
	// context says once the pause is over, as a handler that does not look
	// at it would: what fences a late one is the runner.
	handle := func(ctx context.Context, m jetstream.Msg) error {
		c, ok := idem.ClaimFromContext(ctx)
		if !ok {
			return fmt.Errorf("no claim in the handler's context")
		}
		id, rid := m.Headers().Get(jetstream.MsgIDHeader), keeper.RecordID(c.Scope(), c.Key())
		if err := log.Start(id, rid, c.Token(), c.Recovered()); err != nil {
			return err
		}
		time.Sleep(chaosDelay)
		return log.Run(id, rid, c.Token(), c.Recovered())
	}
	r, err := idemjetstream.New(keeper, chaosScope, cons, handle,
		idemjetstream.WithBatch(chaosBatch), idemjetstream.WithConcurrency(chaosConcurrency),
		idemjetstream.WithErrorHandler(func(err error) { fmt.Fprintln(os.Stderr, "worker: told:", err) }))
	if err != nil {
		return fail(err)
	}
	if err := r.Run(ctx); ctx.Err() == nil {
		return fail(fmt.Errorf("Run returned: %v", err))
	}
	return 0
}

// chaosProc is a worker process of the chaos kill test and its log.
type chaosProc struct {
	*worker
	name, log string
}

func startChaosWorker(t *testing.T, natsURL, redisAddr, name, log string) *chaosProc {
	t.Helper()
	w := proc.StartWorker(t, "IDEMJS_WORKER=chaos", "IDEMJS_NATS="+natsURL, "IDEMJS_REDIS="+redisAddr, "IDEMJS_LOG="+log)
	return &chaosProc{worker: w, name: name, log: log}
}

// stopMidHandler stops w (SIGSTOP) while one of its handlers is under way
// (a start in its log with no run after it) and returns those handlers;
// stopped between two, w is let go on for a moment and tried again.
func stopMidHandler(t *testing.T, w *chaosProc, deadline time.Time) []runlog.RunLine {
	t.Helper()
	for {
		if time.Now().After(deadline) {
			t.Fatalf("worker %s was never stopped mid-handler", w.name)
		}
		if err := w.Cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		under, err := runlog.Unfinished(w.log)
		if err != nil {
			t.Fatal(err)
		}
		if len(under) > 0 {
			return under
		}
		if err := w.Cmd.Process.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestKillOutagePause: three workers consume 600 messages while, in turn,
// one is killed with SIGKILL in the middle of a handler and another
// started in its place, the redis-server is killed and started again on
// its AOF (appendfsync always) twice (two fifths of a lease later, then a
// whole lease later), and another worker is stopped (SIGSTOP) in the
// middle of a handler for three leases, then let go on (SIGCONT). No worker exits on the outages; no id is lost;
// no handler runs again once its outcome was stored; every run of an id
// beyond its first is Recovered (the killed and the stopped handlers' ids
// among them), and the stopped handlers' late completions are not stored.
func TestKillOutagePause(t *testing.T) {
	if testing.Short() {
		t.Skip("the kill test takes tens of seconds; -short leaves it out")
	}
	natsURL := startNATS(t)
	srv := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	ctx := context.Background()
	_, js := connect(t, natsURL)
	rc := srv.Client(t)
	const pause = 3 * chaosLease
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: chaosStream, Subjects: []string{"chaos.>"}})
	if err != nil {
		t.Fatal(err)
	}
	cons, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: chaosConsumer, AckWait: chaosLease, MaxDeliver: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]string, chaosMessages)
	for i := range ids {
		ids[i] = "order-" + strconv.Itoa(i)
	}
	if err := publishChunks(ctx, js, "chaos.order", ids, make([]bool, len(ids))); err != nil {
		t.Fatal(err)
	}

	dir := t.TempDir()
	var logs []string
	start := func(name string) *chaosProc {
		log := filepath.Join(dir, fmt.Sprintf("%s.%d.log", name, len(logs)))
		logs = append(logs, log)
		return startChaosWorker(t, natsURL, srv.Addr, name, log)
	}
	workers := []*chaosProc{start("w0"), start("w1"), start("w2")}
	alive := func() {
		t.Helper()
		for _, w := range workers {
			select {
			case <-w.Done:
				t.Fatalf("worker %s exited: %v\n%s", w.name, w.Err, w.Out)
			default:
			}
		}
	}
	deadline := time.Now().Add(60 * time.Second) // a bound, not a margin
	waitRuns := func(n int) {
		t.Helper()
		for {
			l, err := runlog.Read(logs...)
			if err != nil {
				t.Fatal(err)
			}
			if len(l.Runs) >= n {
				return
			}
			alive()
			if time.Now().After(deadline) {
				t.Fatalf("the workers ran %d handlers, waiting for %d", len(l.Runs), n)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}

	// A SIGKILL mid-handler, and another worker started in its place.
	waitRuns(chaosMessages / 10)
	killed := stopMidHandler(t, workers[0], deadline)
	if err := workers[0].Cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-workers[0].Done
	workers[0] = start("w3")

	// The redis-server killed, and started again on its AOF: first after
	// two fifths of a lease (shorter than half a lease, it loses no lease),
	// then after a whole lease (leases run out: their claims are taken over).
	outages := []time.Duration{chaosLease * 2 / 5, chaosLease}
	for i, outage := range outages {
		waitRuns((2 + i) * chaosMessages / 10)
		srv.Stop()
		time.Sleep(outage)
		srv.Restart(t)
		alive()
	}

	// A worker stopped mid-handler for three leases.
	waitRuns((2 + len(outages)) * chaosMessages / 10)
	stopped := stopMidHandler(t, workers[1], deadline)
	time.Sleep(pause)
	if err := workers[1].Cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}

	for {
		alive()
		info, err := cons.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream == chaosMessages {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d pending, %d unacknowledged, ack floor %d of %d", info.NumPending, info.NumAckPending, info.AckFloor.Stream, chaosMessages)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// What the workers saw of the outages: the dials go-redis logged as
	// refused, the errors the runners went on from (WithErrorHandler), and
	// the steps the Observer was told Redis did not answer.
	refused, told, unavailable := 0, 0, 0
	for _, w := range workers {
		_ = w.Cmd.Process.Signal(syscall.SIGTERM)
		if <-w.Done; w.Err != nil {
			t.Errorf("worker %s did not stop cleanly on SIGTERM: %v\n%s", w.name, w.Err, w.Out)
		}
		refused += strings.Count(w.Out.String(), "connection refused")
		told += strings.Count(w.Out.String(), "worker: told:")
		unavailable += strings.Count(w.Out.String(), "worker: unavailable:")
	}

	l, err := runlog.Read(logs...)
	if err != nil {
		t.Fatal(err)
	}
	n := l.Count(ids)
	keeper, err := idem.NewRedis(rc, idem.WithLease(chaosLease))
	if err != nil {
		t.Fatal(err)
	}
	notCompleted := 0
	for _, id := range ids {
		r, err := keeper.Inspect(ctx, chaosScope, id)
		if err != nil {
			t.Fatal(err)
		}
		if r.State != idem.StateCompleted {
			notCompleted++
		}
	}
	t.Logf("cd idemjetstream && go test -race -count=1 -run '^TestKillOutagePause$' .: %s; %d not completed; "+
		"the SIGKILL stopped %d handlers, the SIGSTOP (%s, a lease %s) %d; "+
		"the outages (%v): %d dials refused, the runners went on from %d errors, %d steps unavailable",
		n, notCompleted, len(killed), pause, chaosLease, len(stopped), outages, refused, told, unavailable)
	for _, p := range n.Problems {
		t.Log(p)
	}
	if n.Lost != 0 || notCompleted != 0 {
		t.Errorf("%d ids never handled, %d whose record is not completed", n.Lost, notCompleted)
	}
	if n.AgainAfterStored != 0 || n.StoredWithoutRun != 0 {
		t.Errorf("%d handlers run again after their outcome was stored, %d outcomes stored with no run", n.AgainAfterStored, n.StoredWithoutRun)
	}
	if n.SecondRuns != n.Recovered {
		t.Errorf("%d second runs, %d of them Recovered", n.SecondRuns, n.Recovered)
	}
	takenOver := func(under []runlog.RunLine, what string) {
		for _, u := range under {
			if !slices.ContainsFunc(l.Runs, func(r runlog.RunLine) bool { return r.ID == u.ID && r.Token > u.Token && r.Recovered }) {
				t.Errorf("%s: the %s handler (token %d) was not run again, Recovered", u.ID, what, u.Token)
			}
		}
	}
	takenOver(killed, "killed")
	takenOver(stopped, "stopped")
	for _, s := range stopped {
		if slices.Contains(l.Stored[s.RID], s.Token) {
			t.Errorf("%s: the stopped handler's late outcome (token %d) was stored", s.ID, s.Token)
		}
		if !slices.ContainsFunc(l.Runs, func(r runlog.RunLine) bool { return r.ID == s.ID && r.Token == s.Token }) {
			t.Errorf("%s: the stopped handler did not make its side effect once let go on", s.ID)
		}
	}
}
