package idemjetstream_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemjetstream"
	"github.com/idemkit/idem/internal/proc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
)

// The kill test: three worker processes (this test binary, run again with
// IDEMJS_WORKER set) consume one stream through a Runner on a real
// redis-server, and one of them is killed with SIGKILL in the middle of a
// batch.
const (
	killIDs       = 160_000         // distinct message ids
	killInWindow  = 20_000          // duplicates published within the Duplicates window: dropped by JetStream
	killLate      = 20_000          // duplicates published after it: stored, answered by idem
	killLease     = 2 * time.Second // the runners' lease, and the consumer's AckWait
	killBatch     = 500
	killVictimRun = 20_000 // the victim's handler blocks after this many runs
	killStream    = "KILL"
	killConsumer  = "workers"
)

// Redis keys of the kill test.
const (
	keyEffects   = "kill:effects"   // hash: message id → handler runs (its effect)
	keyRecovered = "kill:recovered" // counter: handlers told Claim.Recovered
	keyVictimSeq = "kill:victim"    // sorted set: stream sequences whose handler the victim started
	keyInside    = "kill:inside"    // set when the victim's handler has blocked, mid-batch
)

func TestMain(m *testing.M) {
	switch os.Getenv("IDEMJS_WORKER") {
	case "":
	case "chaos":
		os.Exit(chaosWorker())
	default:
		os.Exit(killWorker())
	}
	os.Exit(m.Run())
}

// killWorker is a worker process of the kill test: it runs a Runner until
// SIGTERM (exit 0) or SIGKILL.
func killWorker() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "worker:", err); return 2 }
	nc, err := nats.Connect(os.Getenv("IDEMJS_NATS"))
	if err != nil {
		return fail(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(err)
	}
	cons, err := js.Consumer(ctx, killStream, killConsumer)
	if err != nil {
		return fail(err)
	}
	rc := redis.NewClient(&redis.Options{Addr: os.Getenv("IDEMJS_REDIS")})
	defer rc.Close()
	keeper, err := idem.NewRedis(rc, idem.WithLease(killLease))
	if err != nil {
		return fail(err)
	}
	victim := os.Getenv("IDEMJS_VICTIM") == "1"
	var runs atomic.Int64
	handle := func(ctx context.Context, m jetstream.Msg) error {
		id := m.Headers().Get(jetstream.MsgIDHeader)
		p := rc.Pipeline()
		if c, ok := idem.ClaimFromContext(ctx); ok && c.Recovered() {
			p.Incr(ctx, keyRecovered)
		}
		if victim {
			md, err := m.Metadata()
			if err != nil {
				return err
			}
			p.ZAdd(ctx, keyVictimSeq, redis.Z{Score: float64(md.Sequence.Stream), Member: md.Sequence.Stream})
			if runs.Add(1) == killVictimRun {
				if _, err := p.Exec(ctx); err != nil {
					return err
				}
				rc.Set(ctx, keyInside, id, 0)
				time.Sleep(time.Hour) // until SIGKILL
			}
		}
		p.HIncrBy(ctx, keyEffects, id, 1)
		_, err := p.Exec(ctx)
		return err
	}
	r, err := idemjetstream.New(keeper, "kill", cons, handle,
		idemjetstream.WithBatch(killBatch), idemjetstream.WithConcurrency(32))
	if err != nil {
		return fail(err)
	}
	if err := r.Run(ctx); ctx.Err() == nil {
		return fail(err)
	}
	return 0
}

// worker is a running worker process.
type worker = proc.Worker

func startWorker(t *testing.T, natsURL, redisAddr string, victim bool) *worker {
	t.Helper()
	return proc.StartWorker(t, "IDEMJS_WORKER=1", "IDEMJS_NATS="+natsURL, "IDEMJS_REDIS="+redisAddr,
		"IDEMJS_VICTIM="+map[bool]string{true: "1", false: "0"}[victim])
}

func TestKillAWorkerMidBatch(t *testing.T) {
	if testing.Short() {
		t.Skip("the kill test takes tens of seconds; -short leaves it out")
	}
	natsURL, redisAddr := startNATS(t), redistest.Start(t).Addr
	ctx := context.Background()
	_, js := connect(t, natsURL)
	rc := redis.NewClient(&redis.Options{Addr: redisAddr})
	t.Cleanup(func() { rc.Close() })
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: killStream, Subjects: []string{"kill.>"}, Duplicates: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	cons, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: killConsumer, AckWait: killLease, MaxAckPending: 4 * killBatch, MaxDeliver: -1,
	})
	if err != nil {
		t.Fatal(err)
	}

	started := time.Now()
	victim := startWorker(t, natsURL, redisAddr, true)
	survivors := []*worker{startWorker(t, natsURL, redisAddr, false), startWorker(t, natsURL, redisAddr, false)}

	// Publish every id, each tenth of them twice at once (JetStream drops
	// the second), then, past the window, a duplicate of 20,000 of them.
	published, publishing := make(chan error, 1), true
	go func() { published <- publishKill(ctx, js) }()

	// Kill the victim once its handler has blocked in the middle of a batch.
	for rc.Exists(ctx, keyInside).Val() == 0 {
		select {
		case <-victim.Done:
			t.Fatalf("the victim exited before it was killed: %v\n%s", victim.Err, victim.Out)
		case <-time.After(20 * time.Millisecond):
		}
	}
	if err := victim.Cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	<-victim.Done
	held, err := rc.ZRevRangeWithScores(ctx, keyVictimSeq, 0, 0).Result()
	if err != nil || len(held) != 1 {
		t.Fatalf("the victim's stream sequences: %v %v", held, err)
	}
	lastHeld := uint64(held[0].Score)

	// The victim's batch is acknowledged once the ack floor passes the last
	// message of it; it is measured from the kill.
	var recoveredAt time.Duration
	deadline := time.Now().Add(120 * time.Second)
	for {
		info, err := cons.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if recoveredAt == 0 && info.AckFloor.Stream >= lastHeld {
			recoveredAt = time.Since(killed)
		}
		if !publishing && info.NumPending == 0 && info.NumAckPending == 0 && info.NumRedelivered == 0 &&
			info.AckFloor.Stream == uint64(killIDs+killLate) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 120s: %d pending, %d unacknowledged, ack floor %d of %d", info.NumPending, info.NumAckPending, info.AckFloor.Stream, killIDs+killLate)
		}
		select {
		case err := <-published:
			if err != nil {
				t.Fatal(err)
			}
			publishing = false
		case <-time.After(50 * time.Millisecond):
		}
	}
	took := time.Since(started)
	for _, w := range survivors {
		_ = w.Cmd.Process.Signal(syscall.SIGTERM)
		if <-w.Done; w.Err != nil {
			t.Errorf("a survivor did not stop cleanly on SIGTERM: %v\n%s", w.Err, w.Out)
		}
	}

	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != killIDs+killLate {
		t.Errorf("the stream holds %d messages, want %d: the duplicates within the window dropped, those after it stored", info.State.Msgs, killIDs+killLate)
	}
	effects, err := rc.HGetAll(ctx, keyEffects).Result()
	if err != nil {
		t.Fatal(err)
	}
	lost, again := 0, 0
	for i := range killIDs {
		n, _ := strconv.Atoi(effects[killID(i)])
		if n == 0 {
			lost++
		}
		again += max(n-1, 0)
	}
	recovered, _ := rc.Get(ctx, keyRecovered).Int()
	if lost != 0 {
		t.Errorf("%d ids lost: their handler's effect is missing", lost)
	}
	if recovered == 0 {
		t.Error("no handler was told Recovered: the kill did not leave a batch's claims pending")
	}
	if bound := killLease + 5*time.Second; recoveredAt > bound {
		t.Errorf("the victim's batch was acknowledged %s after the kill, want within the lease plus 5s (%s)", recoveredAt, bound)
	}
	t.Logf("%d messages (%d ids, %d duplicates within the window, %d after it) in %s; the victim's batch acknowledged %s after the kill; %d handlers told Recovered; %d finished handlers ran again",
		killIDs+killInWindow+killLate, killIDs, killInWindow, killLate, took.Round(time.Millisecond), recoveredAt.Round(time.Millisecond), recovered, again)
}

func killID(i int) string { return "order-" + strconv.Itoa(i) }

// publishKill publishes the kill test's messages: every id, a tenth of them
// twice in a row (the second within the Duplicates window), then, once the
// window has passed, a duplicate of killLate ids chosen at random. It
// publishes in chunks, each acknowledged before the next.
func publishKill(ctx context.Context, js jetstream.JetStream) error {
	var ids []string
	var dup []bool
	for i := range killIDs {
		ids, dup = append(ids, killID(i)), append(dup, false)
		if i%(killIDs/killInWindow) == 0 {
			ids, dup = append(ids, killID(i)), append(dup, true)
		}
	}
	if err := publishChunks(ctx, js, "kill.order", ids, dup); err != nil {
		return err
	}
	time.Sleep(1100 * time.Millisecond) // past the Duplicates window of the last id
	ids, dup = ids[:0], dup[:0]
	for _, i := range rand.New(rand.NewPCG(1, 2)).Perm(killIDs)[:killLate] {
		ids, dup = append(ids, killID(i)), append(dup, false)
	}
	return publishChunks(ctx, js, "kill.order", ids, dup)
}

// publishChunks publishes a message on subject for each of ids, and checks
// that JetStream took the i-th as a duplicate when dup[i] says so, and only
// then.
func publishChunks(ctx context.Context, js jetstream.JetStream, subject string, ids []string, dup []bool) error {
	const chunk = 2000
	for len(ids) > 0 {
		n := min(chunk, len(ids))
		fs := make([]jetstream.PubAckFuture, n)
		for i, id := range ids[:n] {
			f, err := js.PublishAsync(subject, []byte(id), jetstream.WithMsgID(id))
			if err != nil {
				return err
			}
			fs[i] = f
		}
		for i, f := range fs {
			select {
			case ack := <-f.Ok():
				if ack.Duplicate != dup[i] {
					return fmt.Errorf("%s: taken as a duplicate: %v, want %v", ids[i], ack.Duplicate, dup[i])
				}
			case err := <-f.Err():
				return err
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		ids, dup = ids[n:], dup[n:]
	}
	return nil
}
