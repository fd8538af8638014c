package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSoak races IDEM_SOAK_N claims (default 1,000,000) on a redis-server
// behind a fault proxy, then as many on a 3-master Cluster, and reports
// executions against keys, duplicates (a run of a key starting while
// another is alive: must be 0), stale completions accepted (must be 0),
// errors by type, and the time taken. It is opt-in: IDEM_SOAK=1. Each
// target stops issuing claims after IDEM_SOAK_LIMIT (default 10m), whatever
// happens, so the whole soak ends within about twice that; give go test a
// -timeout above it:
//
//	IDEM_SOAK=1 IDEM_SOAK_N=20000 go test -run '^TestSoak$' -v -timeout 60m .
//
// 64 workers claim keys from a window that moves along as the claims go:
// about 8 claims per key, 4 workers on a key at once. Keys are of three
// kinds:
//
//   - plain (90%): Do, lease 5s; each call's caller goes away at a random
//     point (as in TestFaultsCallerGone), or stays; fn sometimes fails (the
//     key is released and runs again) or fails for good (Final);
//   - outliving (5%): Do, lease 3s; the caller goes away as fn starts and
//     fn goes on for one and a half to three leases, on
//     context.WithoutCancel, while the workers keep claiming the key;
//   - paused (5%): Begin, then the work, then a pause past the lease (1s)
//     without renewal, as a stalled process, then Complete: a holder taken
//     over meanwhile is refused (a stale completion), one that was not is
//     accepted.
//
// On the single server, the proxy cuts requests, drops replies, delays some
// past the read timeout, and closes every connection every few seconds.
// Renewals go around it: the holders are healthy processes that renew on
// time while their callers' own calls meet the faults, and the leases are
// long against how late a claim can be answered (see faultLease), so any
// duplicate is a bug. With IDEM_SOAK_RENEW=proxy, renewals meet the faults
// too: a holder may then lose its lease to an outage (its Do answers
// ErrLeaseLost) while its operation, which ignores cancellation, goes on,
// and a second run beside it is the contract's limit, not a bug. Duplicates
// are reported apart by the run that was alive (one then told its lease was
// lost, or one that never lost it); in that mode only the second kind must
// be 0.
func TestSoak(t *testing.T) {
	n, limit := soakSettings(t)
	faults := faultproxy.Faults{Cut: 0.002, DropReply: 0.002, Delay: 300 * time.Millisecond, Slow: 0.0005}
	eachSoakTarget(t, 2024, 1024, faults, func(t *testing.T, tg soakTarget) {
		var renew redis.Scripter
		if tg.srv != nil {
			renew = tg.srv.Client(t) // holders renew on time
			if os.Getenv("IDEM_SOAK_RENEW") == "proxy" {
				renew = nil
				t.Log("renewals go through the fault proxy (IDEM_SOAK_RENEW=proxy): a holder may lose its lease to an outage")
			}
		}
		runSoak(t, tg.c, renew, tg.clean, n, limit, tg.faults, tg.stopFaults)
	})
}

// soakTarget is what a soak runs against: c, the client its calls go
// through; clean, a client of the same data without faults, for the checks;
// srv, the redis-server (nil on the Cluster); faults, what the faults did;
// stopFaults ends them.
type soakTarget struct {
	c, clean   redis.Scripter
	srv        *redistest.Server
	faults     func() string
	stopFaults func()
}

// eachSoakTarget runs run as two subtests: "single", a redis-server behind
// a fault proxy (seeded with seed, faults f, and every connection cut every
// five seconds), its client with pool connections; and "cluster", a
// 3-master Cluster without faults, pool connections per node.
func eachSoakTarget(t *testing.T, seed uint64, pool int, f faultproxy.Faults, run func(t *testing.T, tg soakTarget)) {
	t.Run("single", func(t *testing.T) {
		srv := redistest.Start(t)
		p := newFaultProxy(t, srv.Addr, seed)
		c := soakClient(t, p.Addr(), pool)
		p.Set(f)
		stop := cutEvery(p, 5*time.Second)
		run(t, soakTarget{c: c, clean: srv.Client(t), srv: srv, faults: func() string { return fmt.Sprintf("proxy %+v", p.Stats()) }, stopFaults: stop})
	})
	t.Run("cluster", func(t *testing.T) {
		cc := soakCluster(t, pool)
		run(t, soakTarget{c: cc, clean: cc, faults: func() string { return "no proxy" }, stopFaults: func() {}})
	})
}

// soakSettings skips the test unless IDEM_SOAK=1 and returns the claims to
// make per target (IDEM_SOAK_N, default 1,000,000) and the time after which
// a target stops making them (IDEM_SOAK_LIMIT, default 10m).
func soakSettings(t *testing.T) (n int64, limit time.Duration) {
	t.Helper()
	if os.Getenv("IDEM_SOAK") != "1" {
		t.Skip("the soak runs only with IDEM_SOAK=1 (IDEM_SOAK_N claims per target, default 1000000; IDEM_SOAK_LIMIT per target, default 10m; give go test -timeout 60m)")
	}
	n, limit = 1_000_000, 10*time.Minute
	if s := os.Getenv("IDEM_SOAK_N"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		require.NoError(t, err, "IDEM_SOAK_N")
		n = v
	}
	if s := os.Getenv("IDEM_SOAK_LIMIT"); s != "" {
		v, err := time.ParseDuration(s)
		require.NoError(t, err, "IDEM_SOAK_LIMIT")
		limit = v
	}
	return n, limit
}

// soakClient is a client of addr (a fault proxy) with short timeouts and
// go-redis's retries of a lost reply, and pool connections.
func soakClient(t *testing.T, addr string, pool int) *redis.Client {
	c := redis.NewClient(&redis.Options{
		Addr: addr, ReadTimeout: 100 * time.Millisecond, WriteTimeout: 100 * time.Millisecond,
		DialTimeout: time.Second, PoolSize: pool,
		MaxRetries: 3, MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 8 * time.Millisecond,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

// soakCluster starts a 3-master Cluster and returns a client of it with
// pool connections per node.
func soakCluster(t *testing.T, pool int) *redis.ClusterClient {
	cl := redistest.StartCluster(t, 3, 0)
	addrs := make([]string, len(cl.Masters))
	for i, m := range cl.Masters {
		addrs[i] = m.Addr
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, PoolSize: pool})
	t.Cleanup(func() { cc.Close() })
	return cc
}

// errSoakFailed is the error of an operation that fails (its key is
// released and runs again).
var errSoakFailed = errors.New("soak: the operation failed")

// runSoak runs the soak on c (faults), renewals on renew if not nil, and
// verifies on clean; stopFaults ends the faults once the claims are done.
func runSoak(t *testing.T, c, renew, clean redis.Scripter, n int64, limit time.Duration, faults func() string, stopFaults func()) {
	const (
		workers     = 64
		perKey      = 8  // claims per key, on average
		window      = 16 // keys claimed at once
		plainLease  = 5 * time.Second
		shortLease  = 3 * time.Second
		pausedLease = time.Second
		detachedMax = 1024 // outliving and paused operations under way at once
		scope       = "soak"
	)
	rs, err := openRedisStore(c, WithPrefix("soak:"))
	require.NoError(t, err)
	cs, err := openRedisStore(clean, WithPrefix("soak:"))
	require.NoError(t, err)
	f := newFences()
	var calls recordStore = rs
	if renew != nil {
		rn, err := openRedisStore(renew, WithPrefix("soak:"))
		require.NoError(t, err)
		calls = splitStore{recordStore: rs, renew: rn}
	}
	gaps := &renewWatch{recordStore: calls, last: map[int64]time.Time{}}
	store := goneStore{&fenceStore{recordStore: gaps, f: f}}
	plain, err := keeperOn(store, WithLease(plainLease), WithRetention(time.Hour))
	require.NoError(t, err)
	short, err := keeperOn(store, WithLease(shortLease), WithRetention(time.Hour))
	require.NoError(t, err)
	paused, err := keeperOn(store, WithLease(pausedLease), WithRetention(time.Hour))
	require.NoError(t, err)
	l := newRunLedger()
	l.lossAllowed = renew == nil && c != clean // renewals meet the faults
	allowed := []string{"in progress", "unavailable", "lease lost", "canceled", "deadline", "final", "operation failed"}

	var lateClaims soakLateClaims
	var (
		stoppedByTime                                    atomic.Bool
		made                                             atomic.Int64 // claims made
		claims, detachedRuns, pauses, staleRefusedManual atomic.Int64
		probes                                           atomic.Int64 // competitors told an outliving operation is in progress
		detached                                         sync.WaitGroup
		slots                                            = make(chan struct{}, detachedMax)
		kindOf                                           = func(i int64) int { return int(uint64(i*2654435761) % 100) }
	)
	keyOf := func(i int64) string { return "k" + strconv.FormatInt(i, 10) }
	start := time.Now()
	deadline := start.Add(limit)

	// record classes err (the operation's own failure first) and records it.
	record := func(key, v string, err error) {
		if errors.Is(err, errSoakFailed) {
			l.mu.Lock()
			l.errs["operation failed"]++
			l.mu.Unlock()
			return
		}
		l.outcome(key, v, err, allowed...)
		var final *FinalError
		if errors.As(err, &final) && !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrLeaseLost) && !isGoneErr(err) {
			l.ack(key) // stored, or replayed: no run may follow
		}
	}

	// plainCall is one Do on a plain key, its caller going away in a random mode.
	plainCall := func(r *rand.Rand, key string) {
		mode := goneMode(r.IntN(int(goneModes)))
		ctx, g := goneContext(mode)
		var opts []Option
		if mode == goneWaiting {
			opts = append(opts, WithWait(time.Second))
		}
		fails := 0 // 1: fails, 2: fails for good
		if mode == callerStays {
			if x := r.IntN(20); x == 0 {
				fails = 1
			} else if x == 1 {
				fails = 2
			}
		}
		ran, tok, called, answered := false, int64(0), time.Now(), time.Duration(0)
		v, err := Do(ctx, plain, scope, key, func(opCtx context.Context) (string, error) {
			ran, answered = true, time.Since(called)
			if c, ok := ClaimFromContext(opCtx); ok {
				tok = c.Token()
			}
			done := l.start(opCtx, key)
			switch {
			case fails == 1:
				done(true)
				return "", errSoakFailed
			case fails == 2:
				done(false)
				return "", Final(errors.New("declined"))
			case mode == goneFnGivesUp:
				g.cancel()
				<-opCtx.Done()
				done(true)
				return "", opCtx.Err()
			case mode == goneFnGoesOn:
				g.cancel()
				<-opCtx.Done()
				time.Sleep(time.Duration(r.IntN(20)) * time.Millisecond)
			default:
				if r.IntN(10) == 0 {
					time.Sleep(time.Duration(r.IntN(5)) * time.Millisecond)
				}
			}
			done(false)
			return fnValue(key), nil
		}, opts...)
		g.cancel()
		if ran && fails == 0 && mode != goneFnGivesUp && errors.Is(err, ErrLeaseLost) {
			l.leaseLost(key, tok) // not a retried Release answering ErrLeaseLost
			lateClaims.note(answered, plainLease)
		}
		if fails != 0 {
			record(key, v, err)
			return
		}
		l.checkGone(key, mode, g, ran, v, err, allowed...)
	}

	// outliving is one Do on an outliving key, detached: its caller leaves
	// as fn starts, and fn goes on for work (1.5 to 3 leases), while a
	// competitor claims the key every third of a lease: it must be told the
	// key is in progress, and never run it.
	outliving := func(key string, work time.Duration) {
		defer detached.Done()
		defer func() { <-slots }()
		ctx, g := goneContext(callerStays)
		ran, started, finished := false, make(chan struct{}), make(chan struct{})
		var competitor sync.WaitGroup
		competitor.Add(1)
		go func() {
			defer competitor.Done()
			select {
			case <-started:
			case <-finished:
				return
			}
			for {
				select {
				case <-finished:
					return
				case <-time.After(shortLease / 3):
				}
				made.Add(1)
				v, err := Do(context.Background(), short, scope, key, l.op(key, 0))
				if errors.Is(err, ErrInProgress) {
					probes.Add(1)
				}
				record(key, v, err)
			}
		}()
		made.Add(1)
		tok, called, answered := int64(0), time.Now(), time.Duration(0)
		v, err := Do(ctx, short, scope, key, func(opCtx context.Context) (string, error) {
			ran, answered = true, time.Since(called)
			if c, ok := ClaimFromContext(opCtx); ok {
				tok = c.Token()
			}
			done := l.start(opCtx, key)
			defer done(false)
			close(started)
			g.cancel()
			<-opCtx.Done()
			time.Sleep(work)
			return fnValue(key), nil
		})
		close(finished)
		competitor.Wait()
		g.cancel()
		if ran && errors.Is(err, ErrLeaseLost) {
			l.leaseLost(key, tok)
			lateClaims.note(answered, shortLease)
		}
		if ran {
			detachedRuns.Add(1)
			l.checkGone(key, goneFnGoesOn, g, ran, v, err, allowed...)
			return
		}
		record(key, v, err)
	}

	// claimAndComplete claims key on k, runs its work and completes at once;
	// it reports whether the key is settled (a result stored or replayed).
	claimAndComplete := func(k *Keeper, key string) bool {
		ctx := context.Background()
		made.Add(1)
		out, err := k.Begin(ctx, scope, key)
		if err == nil && out.Claim != nil {
			done := l.start(contextWithClaim(ctx, out.Claim), key)
			done(false)
			err = out.Claim.Complete(ctx, []byte(fnValue(key)), 0)
			if err == nil {
				l.ack(key)
			}
		}
		v := fnValue(key)
		if out.Replayed && string(out.Value) != v {
			v = string(out.Value)
		}
		record(key, v, err)
		return err == nil
	}

	// pausedHolder claims a paused key, works, then pauses past its lease
	// without renewal, as a stalled process, and completes; a competitor
	// claims the key every quarter of a lease meanwhile, takes it over once
	// the lease has run out (Recovered), works and completes at once. The
	// holder's completion is refused when it was taken over, and accepted
	// when it was not.
	pausedHolder := func(key string, pause time.Duration) {
		defer detached.Done()
		defer func() { <-slots }()
		ctx := context.Background()
		made.Add(1)
		out, err := paused.Begin(ctx, scope, key)
		if err != nil || out.Replayed {
			v := fnValue(key)
			if out.Replayed && string(out.Value) != v {
				v = string(out.Value)
			}
			record(key, v, err)
			return
		}
		cl := out.Claim
		done := l.start(contextWithClaim(ctx, cl), key)
		done(false)
		pauses.Add(1)
		var competitor sync.WaitGroup
		competitor.Add(1)
		go func() {
			defer competitor.Done()
			for end := time.Now().Add(3 * pausedLease); time.Now().Before(end); {
				time.Sleep(pausedLease / 4)
				if claimAndComplete(paused, key) {
					return
				}
			}
		}()
		time.Sleep(pause)
		err = cl.Complete(ctx, []byte(fnValue(key)), 0)
		switch {
		case err == nil:
			l.ack(key)
		case errors.Is(err, ErrLeaseLost):
			staleRefusedManual.Add(1)
		}
		record(key, fnValue(key), err)
		competitor.Wait()
	}

	progressDone := make(chan struct{})
	go func() { // a line every 30s, for long runs
		for {
			select {
			case <-progressDone:
				return
			case <-time.After(30 * time.Second):
			}
			l.mu.Lock()
			overlaps := l.overlaps
			l.mu.Unlock()
			t.Logf("progress: %d claims in %s, %d duplicates so far", made.Load(), time.Since(start).Round(time.Second), overlaps)
		}
	}()
	defer close(progressDone)

	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), uint64(n)))
			for {
				i := claims.Add(1)
				if i > n {
					return
				}
				if time.Now().After(deadline) {
					stoppedByTime.Store(true)
					return
				}
				ki := i/perKey + r.Int64N(window)
				key := keyOf(ki)
				switch kind := kindOf(ki); {
				case kind < 90:
					made.Add(1)
					plainCall(r, key)
				case kind < 95:
					select {
					case slots <- struct{}{}:
						detached.Add(1)
						go outliving(key, shortLease*3/2+time.Duration(r.Int64N(int64(shortLease*3/2))))
					default: // too many under way: ask and go on
						made.Add(1)
						v, err := Do(context.Background(), short, scope, key, l.op(key, 0))
						record(key, v, err)
					}
				default:
					select {
					case slots <- struct{}{}:
						detached.Add(1)
						go pausedHolder(key, pausedLease+time.Duration(r.Int64N(int64(pausedLease/2))))
					default:
						claimAndComplete(paused, key)
					}
				}
			}
		}()
	}
	wg.Wait()
	detached.Wait()
	issued := made.Load()
	elapsed := time.Since(start)
	stopFaults()
	timedOut := stoppedByTime.Load()

	// Every key answers once its leases have run out, and its stored result
	// is that of the highest token handed out for it.
	time.Sleep(plainLease + 100*time.Millisecond)
	lastKey := issued/perKey + window
	direct := map[int]*Keeper{}
	for kind, lease := range map[int]time.Duration{0: plainLease, 1: shortLease, 2: pausedLease} {
		k, err := keeperOn(&fenceStore{recordStore: cs, f: f}, WithLease(lease), WithRetention(time.Hour))
		require.NoError(t, err)
		direct[kind] = k
	}
	var verified, unverified, mismatched atomic.Int64
	verifyBy := time.Now().Add(limit)
	var vg sync.WaitGroup
	next := atomic.Int64{}
	for w := 0; w < workers; w++ {
		vg.Add(1)
		go func() {
			defer vg.Done()
			ctx := context.Background()
			for {
				ki := next.Add(1) - 1
				if ki > lastKey {
					return
				}
				if time.Now().After(verifyBy) {
					unverified.Add(1)
					continue
				}
				key := keyOf(ki)
				k := direct[0]
				switch kind := kindOf(ki); {
				case kind >= 95:
					k = direct[2]
				case kind >= 90:
					k = direct[1]
				}
				out, err := k.Begin(ctx, scope, key)
				if err == nil && out.Claim != nil { // abandoned, released, or never claimed: run it now
					done := l.start(contextWithClaim(ctx, out.Claim), key)
					done(false)
					err = out.Claim.Complete(ctx, []byte(fnValue(key)), 0)
					if err == nil {
						out, err = k.Begin(ctx, scope, key)
					}
				}
				if err != nil || !out.Replayed {
					l.mu.Lock()
					l.violate("%s after the soak: %+v, %v; want its stored result", key, out, err)
					l.mu.Unlock()
					continue
				}
				if out.Err == nil {
					var got string
					if err := (msgpackCodec{}).Unmarshal(out.Value, &got); err != nil {
						got = string(out.Value) // stored by Claim.Complete
					}
					if got != fnValue(key) {
						l.mu.Lock()
						l.violate("%s after the soak stores %q", key, out.Value)
						l.mu.Unlock()
					}
				}
				if out.Token != f.highest(recordID(scope, key)) {
					mismatched.Add(1)
					l.mu.Lock()
					l.violate("%s: the stored result is by token %d; the highest handed out is %d", key, out.Token, f.highest(recordID(scope, key)))
					l.mu.Unlock()
				}
				verified.Add(1)
			}
		}()
	}
	vg.Wait()

	l.mu.Lock()
	defer l.mu.Unlock()
	f.mu.Lock()
	defer f.mu.Unlock()
	runs, keys := 0, 0
	byRuns := map[string]int{}
	for _, r := range l.runs {
		runs += r
		keys++
		switch {
		case r == 1:
			byRuns["1"]++
		case r == 2:
			byRuns["2"]++
		default:
			byRuns["3+"]++
		}
	}
	t.Logf("%d claims in %s (%.0f claims/s)%s; %d keys run (%d checked after), %d executions: keys by runs %v; re-runs: %d recovered after a lost lease, %d after a failed run; %d operations outlived their caller (probed %d times while they ran), %d holders paused past their lease",
		issued, elapsed.Round(time.Millisecond), float64(issued)/elapsed.Seconds(), map[bool]string{true: " (stopped by the time bound)", false: ""}[timedOut],
		keys, verified.Load(), runs, byRuns, l.recovered, l.afterGiveUp, detachedRuns.Load(), probes.Load(), pauses.Load())
	besideLost, besideHealthy := l.overlapsBeside()
	leasesLost := 0
	for range l.lost {
		leasesLost++
	}
	t.Logf("duplicates (a run while another of its key was alive): %d (%d beside a run whose lease was then reported lost, %d beside one that never lost it); runs told their lease was lost: %d; stale completions accepted: %d; stale completions refused: %d (%d by paused holders); stored results not the last holder's: %d; other violations: %d",
		l.overlaps, besideLost, besideHealthy, leasesLost, f.nStale, f.staleRefused, staleRefusedManual.Load(), mismatched.Load(), l.nViolations-map[bool]int{false: l.overlaps, true: 0}[l.lossAllowed])
	t.Logf("answers: %s; callers gone: %s; fn ran with the caller gone: %s; %s", sortedCounts(l.errs), sortedCounts(l.gone), sortedCounts(l.ranGone), faults())
	gaps.mu.Lock()
	t.Logf("renewals: %d; longest time a live claim went without one (from its answer or its last renewal): %s; renewals later than two thirds of their lease (the process did not renew on time): %d",
		gaps.renewals, gaps.maxGap.Round(time.Millisecond), gaps.late)
	gaps.mu.Unlock()
	if len(lateClaims.lost) > 0 {
		t.Logf("runs told their lease was lost: how long after the call their claim was answered, against their lease: %s", lateClaims.String())
	}
	if l.lossAllowed {
		assert.Zero(t, besideHealthy, "duplicates beside a holder that never lost its lease")
		for _, p := range l.pairs {
			if !l.lost[p] {
				assert.Failf(t, "violation", "%s: a run started beside the run with token %d, which never lost its lease", p.key, p.token)
			}
		}
	} else {
		assert.Zero(t, l.overlaps, "duplicates")
	}
	assert.Zero(t, f.nStale, "stale completions accepted")
	assert.Zero(t, unverified.Load(), "keys left unchecked by the time bound")
	for _, v := range l.violations {
		assert.Fail(t, v)
	}
	for _, s := range f.staleAccepted {
		assert.Failf(t, "violation", "stale completion accepted: %s", s)
	}
}

// renewWatch measures, per claim, the time between its answer and its first
// renewal, and between renewals: a renewal later than two thirds of the lease
// means the process did not renew on time (a stall), whatever the store did.
type renewWatch struct {
	recordStore
	mu       sync.Mutex
	last     map[int64]time.Time // by token: the claim's answer or last renewal
	renewals int
	late     int
	maxGap   time.Duration
}

func (s *renewWatch) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	r, err := s.recordStore.Claim(ctx, id, req)
	if err == nil && r.Status == statusClaimed {
		s.mu.Lock()
		s.last[r.Token] = time.Now()
		s.mu.Unlock()
	}
	return r, err
}

func (s *renewWatch) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	now := time.Now()
	s.mu.Lock()
	if last, ok := s.last[token]; ok {
		gap := now.Sub(last)
		s.renewals++
		s.maxGap = max(s.maxGap, gap)
		if gap > lease*2/3 {
			s.late++
		}
	}
	s.last[token] = now
	s.mu.Unlock()
	return s.recordStore.Extend(ctx, id, token, lease, keep)
}

func (s *renewWatch) forget(token int64) {
	s.mu.Lock()
	delete(s.last, token)
	s.mu.Unlock()
}

func (s *renewWatch) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (bool, error) {
	s.forget(token)
	return s.recordStore.Complete(ctx, id, token, value, keep)
}

func (s *renewWatch) Release(ctx context.Context, id string, token int64, keep time.Duration) error {
	s.forget(token)
	return s.recordStore.Release(ctx, id, token, keep)
}

// soakLateClaims notes, for runs told their lease was lost, how long their
// claim took to be answered: a claim answered after two thirds of its lease
// is renewed only after the lease ended (TestLateClaimRunsOnAnExpiredLease).
type soakLateClaims struct {
	mu   sync.Mutex
	lost []string
}

func (s *soakLateClaims) note(answered, lease time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lost = append(s.lost, fmt.Sprintf("%s of %s", answered.Round(time.Millisecond), lease))
}

func (s *soakLateClaims) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprint(s.lost)
}
