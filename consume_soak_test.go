package idem

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSoakConsume runs IDEM_SOAK_N claims (messages given to Consume or
// BeginBatch; default 1,000,000) through Consume with markers on, on a
// redis-server behind a fault proxy, then as many on a 3-master Cluster, and
// reports claims, message ids, executions, duplicate executions (must be
// 0), replays (from markers and from records), redeliveries after the
// result retention, messages never acknowledged (must be 0), errors by type
// and the time taken. It is opt-in: IDEM_SOAK=1. Each target stops issuing
// claims after IDEM_SOAK_LIMIT (default 10m):
//
//	IDEM_SOAK=1 IDEM_SOAK_N=1000000 go test -run '^TestSoakConsume$' -v -timeout 60m .
//
// The Keepers keep results for a second (WithRetention) and markers for a
// minute (WithMarkerRetention), with a lease of a second, so that most
// redeliveries of a handled message come after its result retention and
// within its marker retention: they must be answered "done before"
// (MessageReplayed) and never run, or retry when their call did not reach
// Redis (then delivered again). Workers, each a Keeper of its own:
//
//   - four consumers take batches of 200 messages: new ids, ids redelivered
//     at once (a producer's duplicate, a rebalance), ids not acknowledged
//     before (every one is redelivered until it is, up to 30 times: then
//     it counts as lost), and ids handled 1.5 to 50 seconds before (after
//     the result retention, within the marker retention); 1% of handlers
//     fail (released, run again on redelivery);
//   - a slow consumer takes batches of 10, a fifth of whose handlers work
//     for 0.7 of the lease (renewed by Consume);
//   - a consumer that dies: it claims batches of 20 new ids with BeginBatch
//     and compact claims, runs half of them, and never settles; their
//     redelivery takes them over once the lease has run out.
//
// A duplicate execution is a handler that starts for a message while
// another holder's handler of it runs with its lease alive by its own
// process's clock, or one that starts within the marker retention of the
// Consume call that acknowledged the message (counted from when that call
// began, which is before Redis stored the marker).
func TestSoakConsume(t *testing.T) {
	n, limit := soakSettings(t)
	faults := faultproxy.Faults{Cut: 0.001, DropReply: 0.001, Delay: 300 * time.Millisecond, Slow: 0.0005}
	eachSoakTarget(t, 2025, 256, faults, func(t *testing.T, tg soakTarget) {
		runConsumeSoak(t, tg.c, tg.clean, n, limit, tg.faults, tg.stopFaults)
	})
}

// Settings of the consumer soak.
const (
	soakLease     = time.Second
	soakRetention = time.Second
	soakMarkers   = time.Minute
	// soakOldMin and soakOldMax bound the age of the messages redelivered
	// after the result retention: within the marker retention.
	soakOldMin = 3 * soakRetention / 2
	soakOldMax = 50 * time.Second
	// soakMaxDeliveries is how often a message not acknowledged is
	// redelivered before it counts as lost.
	soakMaxDeliveries = 30
)

// soakMsg is the state of one message id in the consumer soak.
type soakMsg struct {
	live    []*msgRun
	lastTok int64
	// acked: acknowledged; since is when the Consume call that handled it
	// began (zero if it was acknowledged otherwise first).
	acked      bool
	since      time.Time
	succeeded  bool
	deliveries int
	// retried: a delivery of it was not acknowledged (its handler failed,
	// its claim was held or lost), or a consumer died holding it.
	retried bool
}

// soakLedger is msgLedger for a million ids: the same checks, in shards.
type soakLedger struct {
	shards [256]struct {
		mu sync.Mutex
		m  map[int64]*soakMsg
	}
	runs, executions, overlaps, afterAck, afterMarkers, overruns atomic.Int64
	// afterAckRetried counts the runs after an acknowledgement of messages
	// that took more than one delivery.
	afterAckRetried atomic.Int64
	mu              sync.Mutex
	violations      []string
	nViolations     int
}

func newSoakLedger() *soakLedger {
	l := &soakLedger{}
	for i := range l.shards {
		l.shards[i].m = map[int64]*soakMsg{}
	}
	return l
}

func (l *soakLedger) violate(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.nViolations++
	if len(l.violations) < 30 {
		l.violations = append(l.violations, fmt.Sprintf(format, args...))
	}
}

// with runs f on the state of id, locked.
func (l *soakLedger) with(id int64, f func(m *soakMsg)) {
	sh := &l.shards[uint64(id)%uint64(len(l.shards))]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	m := sh.m[id]
	if m == nil {
		m = &soakMsg{}
		sh.m[id] = m
	}
	f(m)
}

// begin is msgLedger.begin for message id; a run within the marker
// retention of the call that acknowledged id is a duplicate execution.
func (l *soakLedger) begin(ctx context.Context, id int64, batch bool) *msgRun {
	c, _ := ClaimFromContext(ctx)
	now := time.Now()
	run := &msgRun{key: strconv.FormatInt(id, 10), claim: c, ctx: ctx, batch: batch, token: c.Token()}
	l.runs.Add(1)
	l.with(id, func(m *soakMsg) {
		if m.acked {
			if !m.since.IsZero() && now.Sub(m.since) >= soakMarkers {
				l.afterMarkers.Add(1) // its marker may be gone: a run is allowed
			} else {
				l.afterAck.Add(1)
				if m.retried {
					l.afterAckRetried.Add(1)
				}
				l.violate("message %d: a handler ran (token %d) after it was acknowledged (handled %s before; it took more than one delivery: %v)", id, run.token, now.Sub(m.since).Round(time.Millisecond), m.retried)
			}
		}
		switch {
		case run.token == m.lastTok:
			l.violate("message %d: token %d handed to two runs", id, run.token)
		case run.token < m.lastTok:
			if now.Before(c.localLeaseEnd()) {
				l.violate("message %d: a handler with token %d started after one with token %d, its lease alive", id, run.token, m.lastTok)
			}
			if !batch {
				run.overrun, run.by = true, m.lastTok
			}
		default:
			m.lastTok = run.token
		}
		for _, other := range m.live {
			if other.token == run.token || !(other.batch || other.ctx.Err() == nil) {
				continue
			}
			if now.Before(other.claim.localLeaseEnd()) {
				l.overlaps.Add(1)
				l.violate("message %d: two live runs: token %d started while token %d runs with its lease alive", id, run.token, other.token)
			} else if !other.batch {
				other.overrun, other.by = true, run.token
			}
		}
		m.live = append(m.live, run)
	})
	return run
}

func (l *soakLedger) end(id int64, run *msgRun, success bool) {
	l.with(id, func(m *soakMsg) {
		m.live = slices.DeleteFunc(m.live, func(r *msgRun) bool { return r == run })
		if success {
			m.succeeded = true
		}
	})
	if success {
		l.executions.Add(1)
	}
}

// waitCancelled is msgLedger.waitCancelled.
func (l *soakLedger) waitCancelled(id int64, run *msgRun) {
	var over bool
	var by int64
	l.with(id, func(*soakMsg) { over, by = run.overrun, run.by })
	if !over || run.ctx.Err() != nil {
		return
	}
	l.overruns.Add(1)
	t := time.NewTimer(overrunBound)
	defer t.Stop()
	select {
	case <-run.ctx.Done():
	case <-t.C:
		l.violate("message %d: the handler with token %d still runs %s after token %d took it over", id, run.token, overrunBound, by)
	}
}

// soakStream hands out message ids: new ones, and those to redeliver.
type soakStream struct {
	next atomic.Int64
	mu   sync.Mutex
	// pending are the ids not acknowledged, to redeliver, each not before
	// its time: a broker redelivers after a while, not at once. queued
	// holds the ids in pending: a broker keeps one copy of a message it
	// waits to see acknowledged, however many deliveries of it came back
	// unacknowledged (else the copies of a message held by a dead
	// consumer multiply, and use its 30 deliveries up within one lease).
	pending []soakPending
	queued  map[int64]bool
	// handled is a ring of (id, when its call began) of handled messages,
	// one in 16 (see handledOne).
	handled []soakHandled
	at      int
	lost    int
}

type soakHandled struct {
	id   int64
	when time.Time
}

type soakPending struct {
	id        int64
	notBefore time.Time
}

// handledOne notes that id was handled by a call that began at when: one id
// in 16 is kept, in a ring of 2^18, some four million messages, a few
// minutes of the soak.
func (s *soakStream) handledOne(id int64, when time.Time) {
	if id%16 != 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.handled) < 1<<18 {
		s.handled = append(s.handled, soakHandled{id, when})
		return
	}
	s.handled[s.at] = soakHandled{id, when}
	s.at = (s.at + 1) % len(s.handled)
}

// old returns up to n handled messages aged soakOldMin to soakOldMax.
func (s *soakStream) old(r *rand.Rand, n int) []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []int64
	now := time.Now()
	for try := 0; try < 4*n && len(s.handled) > 0 && len(out) < n; try++ {
		h := s.handled[r.IntN(len(s.handled))]
		if age := now.Sub(h.when); age >= soakOldMin && age <= soakOldMax {
			out = append(out, h.id)
		}
	}
	return out
}

// takePending returns up to n ids due for redelivery (all of them, due or
// not, with all).
func (s *soakStream) takePending(n int, all bool) []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	var out []int64
	kept := s.pending[:0]
	for _, p := range s.pending {
		if len(out) < n && (all || !now.Before(p.notBefore)) {
			out = append(out, p.id)
			delete(s.queued, p.id)
		} else {
			kept = append(kept, p)
		}
	}
	s.pending = kept
	return out
}

// redeliver queues id for redelivery after d, unless it is queued already.
func (s *soakStream) redeliver(id int64, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.queued[id] {
		return
	}
	if s.queued == nil {
		s.queued = map[int64]bool{}
	}
	s.queued[id] = true
	s.pending = append(s.pending, soakPending{id, time.Now().Add(d)})
}

func soakKey(id int64) string { return "m" + strconv.FormatInt(id, 10) }

func soakID(key string) int64 {
	id, _ := strconv.ParseInt(key[1:], 10, 64)
	return id
}

// soakCounts are the soak's tallies.
type soakCounts struct {
	mu                                                  sync.Mutex
	status                                              map[string]int
	oldSent, oldReplayed, oldExpired, oldRetry, oldRuns int
	// oldUnreached counts the redeliveries in oldRetry whose call did not
	// reach Redis (unreachedRedis); oldRetryWhy counts the answers of all
	// of them.
	oldUnreached int
	oldRetryWhy  map[string]int
	// oldRetrySample is the first answer in oldRetry that reached Redis.
	oldRetrySample error
}

// unreachedRedis reports whether err, a message's answer, is
// ErrUnavailable because its call's connection failed: cut, reset, a reply
// that did not come in time, no connection free. Redis did not answer, so
// the message was never decided: it is retried (redelivered), as the
// consumer contract says, and its next delivery must be answered done
// before. A reply of Redis's own (a script's error, errCallMissing) wraps
// none of these causes.
func unreachedRedis(err error) bool {
	var ne net.Error
	return errors.Is(err, ErrUnavailable) &&
		(errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrClosed))
}

func (c *soakCounts) add(what string) {
	c.mu.Lock()
	c.status[what]++
	c.mu.Unlock()
}

// runConsumeSoak runs the consumer soak on c (the workers) and verifies on
// clean; stopFaults ends the faults once the claims are done.
func runConsumeSoak(t *testing.T, c, clean redis.Scripter, n int64, limit time.Duration, faults func() string, stopFaults func()) {
	const (
		consumers = 4
		batchSize = 200
		scope     = "soak"
	)
	rs, err := openRedisStore(c, WithPrefix("csoak:"))
	require.NoError(t, err)
	book := newSoakFences()
	store := &soakFenced{redisStore: rs, f: book}
	newK := func() *Keeper {
		k, err := keeperOn(store, WithLease(soakLease), WithRetention(soakRetention), WithMarkerRetention(soakMarkers))
		require.NoError(t, err)
		return k
	}
	led := newSoakLedger()
	stream := &soakStream{}
	counts := &soakCounts{status: map[string]int{}}
	var claims atomic.Int64
	start := time.Now()
	deadline := start.Add(limit)
	var stoppedByTime atomic.Bool

	handler := func(slowShare int) func(ctx context.Context, m msg) error {
		return func(ctx context.Context, m msg) error {
			id := soakID(m.ID)
			run := led.begin(ctx, id, false)
			var err error
			switch h := uint64(id*2654435761) ^ uint64(len(m.Body)); {
			case m.Body == "fail":
				err = errFlaky
			case slowShare > 0 && h%100 < uint64(slowShare):
				t := time.NewTimer(soakLease * 7 / 10)
				select {
				case <-ctx.Done():
					err = ctx.Err()
				case <-t.C:
				}
				t.Stop()
			}
			if err == nil {
				err = ctx.Err()
			}
			led.waitCancelled(id, run)
			led.end(id, run, err == nil)
			return err
		}
	}

	// consume delivers ids (old: those redelivered after the retention) and
	// takes the answers as a broker would.
	consume := func(k *Keeper, r *rand.Rand, ids []int64, old map[int64]bool, slowShare int) {
		batch := make([]msg, len(ids))
		for i, id := range ids {
			body := "ok"
			if r.IntN(100) == 0 {
				body = "fail"
			}
			batch[i] = msg{ID: soakKey(id), Body: body}
		}
		claims.Add(int64(len(batch)))
		began := time.Now()
		res, err := Consume(context.Background(), k, scope, batch, msgID, handler(slowShare), WithConcurrency(8))
		if err != nil && !unreachableAnswer(res, err) {
			led.violate("Consume: %v", err)
			return
		}
		for i, r := range res {
			id := ids[i]
			counts.add(r.Status.String() + ": " + cfKind(r.Err))
			if !typedErr(r.Err, errFlaky) {
				led.violate("message %d: untyped error: %v", id, r.Err)
			}
			if old[id] && r.Status != MessageDuplicate { // a duplicate is answered by its first
				counts.mu.Lock()
				counts.oldSent++
				switch {
				case r.Ran:
					counts.oldRuns++
				case r.Status == MessageReplayed:
					counts.oldReplayed++
				case errors.Is(r.Err, ErrResultExpired):
					counts.oldExpired++
				default:
					counts.oldRetry++
					why := r.Status.String() + ": " + cfKind(r.Err)
					if unreachedRedis(r.Err) {
						counts.oldUnreached++
						why += " (Redis not reached)"
					} else if counts.oldRetrySample == nil {
						counts.oldRetrySample = r.Err
					}
					if counts.oldRetryWhy == nil {
						counts.oldRetryWhy = map[string]int{}
					}
					counts.oldRetryWhy[why]++
				}
				counts.mu.Unlock()
			}
			if r.Status == MessageDuplicate {
				continue
			}
			var deliveries int
			led.with(id, func(m *soakMsg) {
				m.deliveries++
				deliveries = m.deliveries
				if !r.Ack {
					m.retried = true
					return
				}
				switch r.Status {
				case MessageHandled:
					if !m.acked {
						m.since = began
					}
				case MessageReplayed:
					if !m.succeeded {
						led.violate("message %d acknowledged (replayed) although no handler of it ever succeeded", id)
					}
				}
				m.acked = true
			})
			switch {
			case r.Ack && r.Status == MessageHandled:
				stream.handledOne(id, began)
			case r.Ack:
			case r.Status == MessageRejected:
				led.violate("message %d rejected: %v", id, r.Err)
			case deliveries < soakMaxDeliveries:
				stream.redeliver(id, soakLease/10)
			default:
				stream.mu.Lock()
				stream.lost++
				stream.mu.Unlock()
				led.violate("message %d never acknowledged in %d deliveries; last answer %s: %v", id, deliveries, r.Status, r.Err)
			}
		}
	}

	var wg sync.WaitGroup
	work := func(w int, f func(k *Keeper, r *rand.Rand)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			k := newK()
			r := rand.New(rand.NewPCG(uint64(w), uint64(n)))
			for claims.Load() < n {
				if time.Now().After(deadline) {
					stoppedByTime.Store(true)
					return
				}
				f(k, r)
			}
		}()
	}
	newIDs := func(k int) []int64 {
		first := stream.next.Add(int64(k)) - int64(k)
		ids := make([]int64, k)
		for i := range ids {
			ids[i] = first + int64(i)
		}
		return ids
	}
	for w := 0; w < consumers; w++ {
		work(w, func(k *Keeper, r *rand.Rand) {
			ids := stream.takePending(batchSize/5, false)
			old := map[int64]bool{}
			for _, id := range stream.old(r, batchSize/20) {
				old[id] = true
				ids = append(ids, id)
			}
			for len(ids) < batchSize {
				switch x := r.IntN(10); {
				case x == 0 && stream.next.Load() > 0:
					top := stream.next.Load()
					ids = append(ids, max(0, top-1-r.Int64N(min(top, 2000))))
				default:
					ids = append(ids, newIDs(1)[0])
				}
			}
			consume(k, r, ids, old, 0)
		})
	}
	work(consumers, func(k *Keeper, r *rand.Rand) {
		consume(k, r, append(stream.takePending(2, false), newIDs(8)...), nil, 20)
	})
	work(consumers+1, func(k *Keeper, r *rand.Rand) {
		ids := newIDs(20)
		keys := make([]string, len(ids))
		for i, id := range ids {
			keys[i] = soakKey(id)
		}
		claims.Add(int64(len(keys)))
		res, err := k.batchBegin(context.Background(), scope, keys, withCompactClaims())
		if err != nil {
			led.violate("BeginBatch: %v", err)
			return
		}
		for i, br := range res {
			if c := br.Outcome.Claim; c != nil && i%2 == 0 {
				run := led.begin(contextWithClaim(context.Background(), c), ids[i], true)
				led.end(ids[i], run, true)
			}
			// It dies: the broker redelivers the batch.
			led.with(ids[i], func(m *soakMsg) { m.retried = true })
			stream.redeliver(ids[i], soakLease/10)
		}
		time.Sleep(5 * time.Millisecond)
	})

	progressDone := make(chan struct{})
	go func() {
		for {
			select {
			case <-progressDone:
				return
			case <-time.After(30 * time.Second):
			}
			t.Logf("progress: %d claims in %s, %d executions, %d duplicates so far", claims.Load(), time.Since(start).Round(time.Second), led.executions.Load(), led.afterAck.Load()+led.overlaps.Load())
		}
	}()
	wg.Wait()
	close(progressDone)
	issued := claims.Load()
	elapsed := time.Since(start)
	stopFaults()

	// The stream has stopped: what was not acknowledged is redelivered
	// until it is, waiting out the leases of claims left pending.
	drain := newK()
	r := rand.New(rand.NewPCG(1, 2))
	rounds := 0
	for ; rounds < 3*soakMaxDeliveries; rounds++ {
		ids := stream.takePending(1<<30, true)
		if len(ids) == 0 {
			break
		}
		if rounds > 0 {
			time.Sleep(soakLease / 2)
		}
		for len(ids) > 0 {
			k := min(len(ids), batchSize)
			consume(drain, r, ids[:k], nil, 0)
			ids = ids[k:]
		}
	}
	left := len(stream.takePending(1<<30, true))

	// Every message handled within the marker retention is still known.
	cs, err := openRedisStore(clean, WithPrefix("csoak:"))
	require.NoError(t, err)
	var checked, forgotten, forgottenRetried int
	stream.mu.Lock()
	sample := slices.Clone(stream.handled)
	stream.mu.Unlock()
	rand.New(rand.NewPCG(3, 4)).Shuffle(len(sample), func(i, j int) { sample[i], sample[j] = sample[j], sample[i] })
	for _, h := range sample {
		if checked == 20000 {
			break
		}
		if time.Since(h.when) > soakMarkers-5*time.Second {
			continue
		}
		checked++
		rep, err := cs.Claim(context.Background(), recordID(scope, soakKey(h.id)), claimRequest{Attempt: newAttemptID(), Lease: soakLease, Keep: soakLease, Retention: soakRetention, MarkerRetention: soakMarkers})
		if err == nil && rep.Status == statusClaimed {
			forgotten++
			var retried bool
			led.with(h.id, func(m *soakMsg) { retried = m.retried })
			if retried {
				forgottenRetried++
			}
			led.violate("message %d, handled %s ago, is claimable: forgotten within the marker retention (it took more than one delivery: %v)", h.id, time.Since(h.when).Round(time.Millisecond), retried)
		}
	}

	stream.mu.Lock()
	ids, lost := stream.next.Load(), stream.lost
	stream.mu.Unlock()
	counts.mu.Lock()
	defer counts.mu.Unlock()
	book.mu.Lock()
	defer book.mu.Unlock()
	dups := led.overlaps.Load() + led.afterAck.Load()
	t.Logf("%d claims in %s (%.0f claims/s)%s; %d message ids; %d handler runs, %d executions (handler successes); duplicate executions: %d (%d beside a live holder, %d after the message was acknowledged, within the marker retention, %d of them of messages that took more than one delivery); %d runs after the marker retention; %d holders started beside a handler not yet cancelled past its lease",
		issued, elapsed.Round(time.Millisecond), float64(issued)/elapsed.Seconds(), map[bool]string{true: " (stopped by the time bound)", false: ""}[stoppedByTime.Load()],
		ids, led.runs.Load(), led.executions.Load(), dups, led.overlaps.Load(), led.afterAck.Load(), led.afterAckRetried.Load(), led.afterMarkers.Load(), led.overruns.Load())
	t.Logf("claims answered from markers: %d of %d; redeliveries after the result retention (%s to %s old): %d, answered replayed %d, ErrResultExpired %d, other retry %d (%s), ran again %d",
		book.markers, book.claims, soakOldMin, soakOldMax, counts.oldSent, counts.oldReplayed, counts.oldExpired, counts.oldRetry, sortedCounts(counts.oldRetryWhy), counts.oldRuns)
	t.Logf("answers: %s; stale completions accepted %d, refused %d; never acknowledged: %d (%d left after %d drain rounds); handled messages checked after (up to 20000, handled within the marker retention): %d, forgotten %d (%d of them took more than one delivery); %s",
		sortedCounts(counts.status), book.stale, book.refused, lost, left, rounds, checked, forgotten, forgottenRetried, faults())
	assert.Zero(t, dups, "duplicate executions")
	assert.Zero(t, book.stale, "stale completions accepted")
	assert.Zero(t, lost+left, "messages never acknowledged")
	// A redelivery whose call did not reach Redis (a cut connection, a
	// reply lost past go-redis's retries, a timeout on a loaded machine) is
	// answered retry and delivered again, to be answered done before then:
	// the duplicate and never-acknowledged checks above hold it to that.
	// How many there are depends on the faults and the machine's load, so
	// only the others count.
	assert.Zero(t, counts.oldRuns+counts.oldExpired+counts.oldRetry-counts.oldUnreached, "redeliveries after the result retention, within the marker retention, not answered done before (Redis answered otherwise; the first retry answer: %v)", counts.oldRetrySample)
	led.mu.Lock()
	defer led.mu.Unlock()
	for _, v := range led.violations {
		assert.Fail(t, "violation", v)
	}
	if led.nViolations > len(led.violations) {
		assert.Failf(t, "violation", "%d violations in all", led.nViolations)
	}
}

// soakFences is fenceBook for a million records: the highest token per
// record, and the completions accepted below it.
type soakFences struct {
	mu              sync.Mutex
	highest         map[string]int64
	claims, markers int
	stale, refused  int
}

func newSoakFences() *soakFences { return &soakFences{highest: map[string]int64{}} }

// soakFenced is a redisStore that records its batch claims and completions
// in f.
type soakFenced struct {
	*redisStore
	f *soakFences
}

func (s *soakFenced) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	out := s.redisStore.ClaimBatch(ctx, req)
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	for j, r := range out {
		if r.Err != nil {
			continue
		}
		s.f.claims++
		if r.Reply.Marker {
			s.f.markers++
		}
		if r.Reply.Status == statusClaimed {
			s.f.highest[req.IDs[j]] = max(s.f.highest[req.IDs[j]], r.Reply.Token)
		}
	}
	return out
}

func (s *soakFenced) SettleBatch(ctx context.Context, items []batchCompletion, release []claimFence, keep time.Duration) (done, given []error) {
	s.f.mu.Lock()
	before := make([]int64, len(items))
	for j, it := range items {
		before[j] = s.f.highest[it.ID]
	}
	s.f.mu.Unlock()
	done, given = s.redisStore.SettleBatch(ctx, items, release, keep)
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	for j, it := range items {
		switch {
		case done[j] == nil && before[j] > it.Token:
			s.f.stale++
		case errors.Is(done[j], ErrLeaseLost):
			s.f.refused++
		}
	}
	return done, given
}
