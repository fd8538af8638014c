package idemkafka_test

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemkafka"
	"github.com/idemkit/idem/internal/proc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// The kill test: worker processes (this test binary, run again with
// IDEMKAFKA_WORKER set to the worker's name) consume one topic as members
// of one group through a Runner on a real redis-server, keyed by the
// records' "id" header. One of them, the victim, is killed with SIGKILL
// while one of its handlers is blocked in the middle of a batch; later a
// further worker joins while the others are busy, so that the group moves
// partitions away from members that are handling them.
const (
	killFirst   = 20_000               // ids 0..killFirst-1, produced before the kill
	killIDs     = 40_000               // distinct ids; the rest are produced after it
	killLate    = 5_000                // ids of the first part produced again after the kill: late duplicates
	killRecords = killIDs + killLate   // records in the topic
	killLease   = 2 * time.Second      // the Keeper's lease
	killSession = 3 * time.Second      // the members' session timeout: how soon the group drops the victim
	killVictim  = 1_500                // the victim blocks in its handler's run of this many, after the effect
	killWork    = 2 * time.Millisecond // a handler's work: 25,000 records take two workers 3 s at least
	killWait    = 60 * time.Second     // the longest wait for any one step
	killTopic   = "kill"
	killGroup   = "workers"
)

// Redis keys of the kill test.
const (
	keyEffects   = "kill:effects"   // hash: id → handler runs (its effect)
	keyRecovered = "kill:recovered" // hash: id → runs told Claim.Recovered
	keyVictim    = "kill:victim"    // hash: id → runs by the victim
	keyVictimAt  = "kill:victim-at" // sorted set: partition → highest offset the victim started
	keyInside    = "kill:inside"    // the id whose handler blocked the victim, set once it has
	keyMembers   = "kill:members"   // set: the workers that were given partitions
	keyRuns      = "kill:runs"      // hash: worker → handler runs
	keyLost      = "kill:lost"      // counter: a Runner's partitions lost (OnPartitionsLost)
)

func TestMain(m *testing.M) {
	if name := os.Getenv("IDEMKAFKA_WORKER"); name != "" {
		os.Exit(killWorker(name))
	}
	os.Exit(m.Run())
}

// killWorker is a worker process of the kill test: it runs a Runner until
// SIGTERM (exit 0) or SIGKILL. The worker named "victim" blocks in its
// killVictim-th handler, after its effect.
func killWorker(name string) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, name+":", err); return 2 }
	rc := redis.NewClient(&redis.Options{Addr: os.Getenv("IDEMKAFKA_REDIS")})
	defer rc.Close()
	keeper, err := idem.NewRedis(rc, idem.WithLease(killLease))
	if err != nil {
		return fail(err)
	}
	victim := name == "victim"
	key := idemkafka.Header("id")
	var runs atomic.Int64
	handle := func(ctx context.Context, rec *kgo.Record) error {
		id := key(rec)
		p := rc.Pipeline()
		p.HIncrBy(ctx, keyEffects, id, 1)
		p.HIncrBy(ctx, keyRuns, name, 1)
		if c, ok := idem.ClaimFromContext(ctx); ok && c.Recovered() {
			p.HIncrBy(ctx, keyRecovered, id, 1)
		}
		if victim {
			p.HIncrBy(ctx, keyVictim, id, 1)
			p.ZAddGT(ctx, keyVictimAt, redis.Z{Score: float64(rec.Offset), Member: rec.Partition})
		}
		if _, err := p.Exec(ctx); err != nil {
			return err
		}
		if victim && runs.Add(1) == killVictim {
			rc.Set(ctx, keyInside, id, 0)
			time.Sleep(time.Hour) // until SIGKILL
		}
		time.Sleep(killWork)
		return nil
	}
	opts := []kgo.Opt{
		kgo.SeedBrokers(strings.Split(os.Getenv("IDEMKAFKA_BROKERS"), ",")...),
		kgo.ConsumerGroup(killGroup),
		kgo.ConsumeTopics(killTopic),
		kgo.FetchMaxWait(100 * time.Millisecond),
		kgo.HeartbeatInterval(100 * time.Millisecond),
		kgo.SessionTimeout(killSession),
		kgo.RebalanceTimeout(10 * time.Second),
		kgo.OnPartitionsAssigned(func(ctx context.Context, _ *kgo.Client, m map[string][]int32) {
			if len(m[killTopic]) > 0 {
				rc.SAdd(ctx, keyMembers, name)
			}
		}),
	}
	r, err := idemkafka.New(keeper, "kill", opts, handle, idemkafka.WithKey(key),
		idemkafka.WithConcurrency(8), idemkafka.WithRetryDelay(200*time.Millisecond),
		idemkafka.WithErrorHandler(func(err error) { fmt.Fprintln(os.Stderr, name+":", err) }))
	if err != nil {
		return fail(err)
	}
	idemkafka.OnRelease(r, func(lost bool) {
		if lost {
			rc.Incr(context.Background(), keyLost)
		}
	})
	if err := r.Run(ctx); ctx.Err() == nil {
		return fail(err)
	}
	return 0
}

// worker is a running worker process.
type worker struct {
	name string
	*proc.Worker
}

func startWorker(t *testing.T, name, brokers, redisAddr string) *worker {
	t.Helper()
	return &worker{name, proc.StartWorker(t, "IDEMKAFKA_WORKER="+name, "IDEMKAFKA_BROKERS="+brokers, "IDEMKAFKA_REDIS="+redisAddr)}
}

// running fails t if one of ws has exited.
func running(t *testing.T, ws ...*worker) {
	t.Helper()
	for _, w := range ws {
		select {
		case <-w.Done:
			t.Fatalf("worker %s exited: %v\n%s", w.name, w.Err, w.Out)
		default:
		}
	}
}

func TestKillAWorkerMidBatch(t *testing.T) {
	if testing.Short() {
		t.Skip("the kill test takes tens of seconds; -short leaves it out")
	}
	c := clusterWith(t, []kfake.Opt{kfake.GroupMinSessionTimeout(100 * time.Millisecond)}, killTopic)
	srv := redistest.Start(t)
	rc := redistest.NewClient(t, srv.Addr)
	ctx := context.Background()
	brokers := strings.Join(c.ListenAddrs(), ",")

	began := time.Now()
	victim := startWorker(t, "victim", brokers, srv.Addr)
	ws := []*worker{startWorker(t, "a", brokers, srv.Addr), startWorker(t, "b", brokers, srv.Addr)}
	waitFor(t, killWait, "each of the three workers given partitions", func() bool {
		running(t, append(ws, victim)...)
		return rc.SCard(ctx, keyMembers).Val() == 3
	})

	// The first part of the ids; the victim is killed once its handler has
	// blocked in the middle of a batch. Its claims of the keys it had not
	// settled stay pending until their lease runs out, and its partitions go
	// to the others once the group has dropped it (the session timeout).
	produce(t, c, killTopic, 0, killFirst)
	waitFor(t, killWait, "the victim's handler to block", func() bool {
		running(t, append(ws, victim)...)
		return rc.Exists(ctx, keyInside).Val() == 1
	})
	if err := victim.Cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	<-victim.Done
	at, err := rc.ZRangeWithScores(ctx, keyVictimAt, 0, -1).Result()
	if err != nil || len(at) == 0 {
		t.Fatalf("the victim's partitions: %v %v", at, err)
	}
	waitFor(t, killWait, "the victim's partitions committed past every record it started", func() bool {
		running(t, ws...)
		com := committed(t, c, killGroup, killTopic)
		for _, z := range at {
			p, _ := strconv.Atoi(z.Member.(string))
			if com[int32(p)] <= int64(z.Score) {
				return false
			}
		}
		return true
	})
	recoveredAt := time.Since(killed)

	// The rest of the ids, and a late duplicate of killLate of the first
	// part (in its partition: the record key is the id too); then a fourth
	// worker joins while the others handle them (each handler takes
	// killWork, so that they cannot be done before it joins). The
	// partitions it is given are revoked from members with records of them
	// left: their running handlers finish, and are stored and committed,
	// before the partitions move.
	produce(t, c, killTopic, killFirst-killLate, killIDs-killFirst+killLate)
	joined := time.Now()
	ws = append(ws, startWorker(t, "c", brokers, srv.Addr))
	waitFor(t, killWait, "the fourth worker given partitions", func() bool {
		running(t, ws...)
		return rc.SIsMember(ctx, keyMembers, "c").Val()
	})
	assignedAt := time.Since(joined)
	waitFor(t, killWait, "every offset committed", func() bool {
		running(t, ws...)
		return committedTotal(t, c, killGroup, killTopic) == killRecords
	})
	took := time.Since(began)
	for _, w := range ws {
		_ = w.Cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, w := range ws {
		select {
		case <-w.Done:
			if w.Err != nil {
				t.Errorf("worker %s did not stop cleanly on SIGTERM: %v\n%s", w.name, w.Err, w.Out)
			}
		case <-time.After(killWait):
			t.Fatalf("worker %s did not stop within %s of SIGTERM", w.name, killWait)
		}
	}

	// No id is lost and none runs three times. An id runs twice only when
	// the victim ran it and was killed before its outcome was stored: the
	// second run took over the victim's claim once its lease had run out,
	// and was told Recovered.

	effects := hashInts(t, rc, keyEffects)
	recovered := hashInts(t, rc, keyRecovered)
	byVictim := hashInts(t, rc, keyVictim)
	var lost, thrice, unexplained []string
	twice, recoveredRuns := 0, 0
	for i := range killIDs {
		id := strconv.Itoa(i)
		recoveredRuns += recovered[id]
		switch n := effects[id]; {
		case n == 0:
			lost = append(lost, id)
		case n > 2:
			thrice = append(thrice, fmt.Sprintf("%s×%d", id, n))
		case n == 2:
			twice++
			if byVictim[id] != 1 || recovered[id] < 1 {
				unexplained = append(unexplained, fmt.Sprintf("%s (victim ran it %d times, %d runs told Recovered)", id, byVictim[id], recovered[id]))
			}
		}
	}
	if len(lost) > 0 {
		t.Errorf("%d ids lost, their handler never ran: %v", len(lost), head(lost))
	}
	if len(thrice) > 0 {
		t.Errorf("%d ids ran more than twice: %v", len(thrice), head(thrice))
	}
	if len(unexplained) > 0 {
		t.Errorf("%d ids ran twice though not a recovery of the victim's claim: %v", len(unexplained), head(unexplained))
	}
	if recoveredRuns < twice {
		t.Errorf("%d runs told Recovered, fewer than the %d ids that ran twice", recoveredRuns, twice)
	}
	inside := rc.Get(ctx, keyInside).Val()
	if effects[inside] != 2 || recovered[inside] != 1 {
		t.Errorf("id %s, whose handler the victim was killed in, ran %d times, %d of them told Recovered; want 2, the second Recovered", inside, effects[inside], recovered[inside])
	}
	// Every record was produced before the fourth worker started: any it
	// handled was left in a partition revoked from another member.
	runs := hashInts(t, rc, keyRuns)
	if runs["c"] == 0 {
		t.Errorf("the fourth worker handled no record (runs %v): no partition was revoked with records left", runs)
	}
	lostParts, _ := rc.Get(ctx, keyLost).Int()
	t.Logf("%d records (%d ids, %d late duplicates) in %s; the victim ran %d ids, its partitions committed past them %s after the kill; %d ids ran twice, %d runs told Recovered; the fourth worker given partitions %s after it started; runs by worker %v; %d times partitions lost",
		killRecords, killIDs, killLate, took.Round(time.Millisecond), len(byVictim), recoveredAt.Round(time.Millisecond), twice, recoveredRuns, assignedAt.Round(time.Millisecond), runs, lostParts)
}

// hashInts reads the hash key as integers.
func hashInts(t *testing.T, rc *redis.Client, key string) map[string]int {
	t.Helper()
	h, err := rc.HGetAll(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]int, len(h))
	for k, v := range h {
		out[k], _ = strconv.Atoi(v)
	}
	return out
}

// head is the first few of s, for a message.
func head(s []string) []string { return s[:min(len(s), 10)] }
