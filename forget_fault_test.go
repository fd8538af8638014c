package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The fault suite's operator: workers run Do on a few keys, and now and then
// a worker "dies" holding a claim (it claims with Begin, may record a
// checkpoint, and stops: no renewal, no completion). An operator, on a
// client of its own through the same faults, inspects keys at random and
// acts on what it saw: it abandons or force-forgets the claims it knows are
// dead, forgets completed records, and tries to forget live claims without
// force, each named by the token it was shown, after a pause in which the
// key may have been claimed again. Replies are lost, so go-redis sends the
// operator's scripts again, sometimes after a worker claimed the key in
// between.

// opLedger follows the runs of the operator test, per key.
type opLedger struct {
	mu sync.Mutex
	// live counts the runs of a key alive now; dead holds the tokens of the
	// claims whose holder died, and deadKeys their keys, as they died.
	live     map[string]int
	dead     map[overlapPair]bool
	deadKeys []string
	// lostClaims counts, per key, the claims whose answer was lost to the
	// worker (ErrUnavailable before any run): Redis may have made them.
	lostClaims map[string]int
	// running lists the keys whose operation runs now (once per run).
	running []string
	// recent holds the keys the workers asked for last, nRecent counts them.
	recent  [8]string
	nRecent int
	// claims lists every claim a worker got, per key.
	claims map[string][]claimSeen
	// ack is the last acknowledged result of a key: the generation of the
	// operator's forgets of the key when the call that got it began, or -1
	// when a forget was under way then (the result may have been read just
	// before it removed the record).
	ack map[string]int
	// forgets counts the operator's forgets of a key, started and ended.
	forgetsStarted, forgetsEnded map[string]int
	// abandoned lists the claims the operator's Abandon ended: the next claim
	// of the key must take them over, recovered, with their checkpoints.
	abandoned []claimSeen

	runs, recovered, crashes, overlaps, healthyLost int
	counts                                          map[string]int
	violations                                      []string
}

// claimSeen is a claim as a worker got it, or as Abandon left it.
type claimSeen struct {
	key         string
	token       int64
	attempt     int
	recovered   bool
	checkpoints []string
}

func newOpLedger() *opLedger {
	return &opLedger{
		live: map[string]int{}, dead: map[overlapPair]bool{}, claims: map[string][]claimSeen{},
		ack: map[string]int{}, forgetsStarted: map[string]int{}, forgetsEnded: map[string]int{},
		counts: map[string]int{}, lostClaims: map[string]int{},
	}
}

// lostClaim records a claim of key whose answer was lost to the worker.
func (l *opLedger) lostClaim(key string) {
	l.mu.Lock()
	l.lostClaims[key]++
	l.mu.Unlock()
}

func (l *opLedger) violate(format string, args ...any) {
	if len(l.violations) < 50 {
		l.violations = append(l.violations, fmt.Sprintf(format, args...))
	}
}

func (l *opLedger) count(what string) {
	l.mu.Lock()
	l.counts[what]++
	l.mu.Unlock()
}

// start records that a run of key began on claim c, and checks that no
// other run of the key is alive and that no result of the key was
// acknowledged since the last forget of it; it returns the end of the run.
func (l *opLedger) start(key string, c *Claim) (end func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.claimLocked(key, c)
	l.runs++
	if c.Recovered() {
		l.recovered++
	}
	if l.live[key] > 0 {
		l.overlaps++
		l.violate("%s: a run (token %d) started while %d other run(s) of the key were alive", key, c.Token(), l.live[key])
	}
	if gen, ok := l.ack[key]; ok && gen >= 0 && gen == l.forgetsStarted[key] {
		l.violate("%s: a run (token %d) started after a result of the key was acknowledged, with no forget since", key, c.Token())
	}
	l.live[key]++
	l.running = append(l.running, key)
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			l.live[key]--
			if i := slices.Index(l.running, key); i >= 0 {
				l.running = slices.Delete(l.running, i, i+1)
			}
			l.mu.Unlock()
		})
	}
}

// runningKey returns a key whose operation runs now, picked with r, or "".
func (l *opLedger) runningKey(r *rand.Rand) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.running) == 0 {
		return ""
	}
	return l.running[r.IntN(len(l.running))]
}

// claimLocked records a claim a worker got; l.mu is held.
func (l *opLedger) claimLocked(key string, c *Claim) {
	cs := claimSeen{key: key, token: c.Token(), attempt: c.Attempt(), recovered: c.Recovered()}
	for _, cp := range c.allCheckpoints() {
		cs.checkpoints = append(cs.checkpoints, cp.Name)
	}
	l.claims[key] = append(l.claims[key], cs)
}

// crashed records a claim whose holder died at once: claimed, and never
// renewed, completed or released.
func (l *opLedger) crashed(key string, c *Claim) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.claimLocked(key, c)
	l.crashes++
	l.dead[overlapPair{key, c.Token()}] = true
	l.deadKeys = append(l.deadKeys, key)
}

// isDead reports whether the claim of token on key is known dead.
func (l *opLedger) isDead(key string, token int64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dead[overlapPair{key, token}]
}

// callStarts returns the generation of the forgets of key for a call that
// starts now, -1 if a forget is under way.
func (l *opLedger) callStarts(key string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.forgetsStarted[key] != l.forgetsEnded[key] {
		return -1
	}
	return l.forgetsStarted[key]
}

// forgotSince reports whether a forget of key started since a call began in
// generation gen.
func (l *opLedger) forgotSince(key string, gen int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return gen < 0 || l.forgetsStarted[key] != gen
}

// touch records that a worker asks for key now.
func (l *opLedger) touch(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.recent[l.nRecent%len(l.recent)] = key
	l.nRecent++
}

// recentKey returns a key a worker asked for lately, picked with r, or "".
func (l *opLedger) recentKey(r *rand.Rand) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.recent[r.IntN(len(l.recent))]
}

// deadKey returns the key of a claim known dead, picked with r, or "".
func (l *opLedger) deadKey(r *rand.Rand) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.deadKeys) == 0 {
		return ""
	}
	return l.deadKeys[r.IntN(len(l.deadKeys))]
}

// acked records that a call of key that began in generation gen got the
// key's result.
func (l *opLedger) acked(key string, gen int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ack[key] = gen
}

// forgetting brackets a forget of key by the operator.
func (l *opLedger) forgetting(key string) (done func()) {
	l.mu.Lock()
	l.forgetsStarted[key]++
	l.mu.Unlock()
	return func() {
		l.mu.Lock()
		l.forgetsEnded[key]++
		l.mu.Unlock()
	}
}

// abandonedClaim records a claim of key whose lease the operator's Abandon
// ended, as the record r it answered.
func (l *opLedger) abandonedClaim(key string, r Record) {
	l.mu.Lock()
	defer l.mu.Unlock()
	cs := claimSeen{key: key, token: r.Token, attempt: r.Attempt}
	for _, cp := range r.Checkpoints {
		cs.checkpoints = append(cs.checkpoints, cp.Name)
	}
	l.abandoned = append(l.abandoned, cs)
}

// wasAbandoned reports whether the operator's Abandon ended the claim of
// token on key.
func (l *opLedger) wasAbandoned(key string, token int64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.abandoned, func(a claimSeen) bool { return a.key == key && a.token == token })
}

// checkAbandoned checks that the first claim of each abandoned key after the
// abandoned one (the one with the next higher token) took it over:
// recovered, the next attempt, with the checkpoints.
func (l *opLedger) checkAbandoned() (checked int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, a := range l.abandoned {
		key := a.key
		var next *claimSeen
		for i, c := range l.claims[key] {
			if c.token > a.token && (next == nil || c.token < next.token) {
				next = &l.claims[key][i]
			}
		}
		if next == nil {
			l.violate("%s: the claim of token %d was abandoned and never claimed again", key, a.token)
			continue
		}
		checked++
		// A claim that Redis made but whose answer was lost to its caller
		// (ErrUnavailable) is a claim too, held by nobody: it takes the
		// abandoned one over, keeps its checkpoints, and its lease runs out.
		if !next.recovered || next.attempt < a.attempt+1 || next.attempt > a.attempt+1+l.lostClaims[key] {
			l.violate("%s: the claim after the abandoned token %d (attempt %d) is token %d, attempt %d, recovered %v: want attempt %d (or up to %d more, claims whose answer was lost), recovered",
				key, a.token, a.attempt, next.token, next.attempt, next.recovered, a.attempt+1, l.lostClaims[key])
		}
		for _, cp := range a.checkpoints {
			if !slices.Contains(next.checkpoints, cp) {
				l.violate("%s: the claim after the abandoned token %d lacks its checkpoint %q", key, a.token, cp)
			}
		}
	}
	return checked
}

// TestFaultsOperator: under lost replies, cut connections and delayed
// replies, with workers that die holding claims and an operator that
// Forgets and Abandons at random by the tokens it saw:
//
//   - no run of a key starts while another is alive, nor after a result of
//     the key was acknowledged unless the key was forgotten since;
//   - a healthy run (its renewals get through) never loses its lease: no
//     operator action, resent or confirmed late, touches a claim it did not
//     know dead;
//   - no completion by a stale token is accepted;
//   - an abandoned claim is always taken over by the next claim of its key,
//     recovered, as the next attempt, with its checkpoints;
//   - a forget never removes a pending record that was not known dead, and a
//     forget without force of a live claim or of checkpoints is refused;
//   - every key answers once the faults stop and the leases have run out.
func TestFaultsOperator(t *testing.T) {
	srv := redistest.Start(t)
	scenarios := []struct {
		name   string
		faults faultproxy.Faults
	}{
		{name: "drop replies after execution", faults: faultproxy.Faults{DropReply: 0.15}},
		{name: "delay replies past the read timeout", faults: faultproxy.Faults{Delay: 3 * faultReadTimeout, Slow: 0.1}},
		{name: "cut connections", faults: faultproxy.Faults{Cut: 0.1}},
	}
	for i, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			faultsOperator(t, srv, uint64(300+i), "op"+strconv.Itoa(i)+":", sc.faults)
		})
	}
}

func faultsOperator(t *testing.T, srv *redistest.Server, seed uint64, prefix string, faults faultproxy.Faults) {
	p := newFaultProxy(t, srv.Addr, seed)
	faulty, err := openRedisStore(newFaultClient(t, p.Addr()), WithPrefix(prefix))
	require.NoError(t, err)
	operatorStore, err := openRedisStore(newFaultClient(t, p.Addr()), WithPrefix(prefix))
	require.NoError(t, err)
	clean, err := openRedisStore(srv.Client(t), WithPrefix(prefix))
	require.NoError(t, err)
	f := newFences()
	// Renewals go around the faults: the healthy holders renew on time, so
	// a lost lease is the operator's doing.
	k, err := keeperOn(&fenceStore{recordStore: splitStore{recordStore: faulty, renew: clean}, f: f}, WithLease(faultLease), WithRetention(time.Minute))
	require.NoError(t, err)
	operator, err := keeperOn(operatorStore, WithLease(faultLease), WithRetention(time.Minute))
	require.NoError(t, err)
	l := newOpLedger()
	const scope = "op"
	const keys, workers, calls = 120, 6, 120

	p.Set(faults)
	ctx := context.Background()
	var wg sync.WaitGroup
	var ops atomic.Int64
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, uint64(w)))
			for j := 0; j < calls; j++ {
				// A third of the calls retry a key whose holder died, as
				// its client would; the rest pick any key.
				key := ""
				if r.IntN(3) == 0 {
					key = l.deadKey(r)
				}
				if key == "" {
					key = "k" + strconv.Itoa(r.IntN(keys))
				}
				l.touch(key)
				ops.Add(1)
				if r.IntN(5) == 0 {
					// A worker that dies holding the claim.
					out, err := k.Begin(ctx, scope, key)
					if errors.Is(err, ErrUnavailable) {
						l.lostClaim(key)
					}
					if err != nil || out.Claim == nil {
						l.count("crash: no claim")
						continue
					}
					l.crashed(key, out.Claim)
					if r.IntN(2) == 0 && out.Claim.Checkpoint(ctx, "step-"+strconv.FormatInt(out.Claim.Token(), 36), nil) == nil {
						l.count("crash: checkpointed")
					}
					continue
				}
				gen := l.callStarts(key)
				ran := false
				v, err := Do(ctx, k, scope, key, func(opCtx context.Context) (string, error) {
					ran = true
					c, _ := ClaimFromContext(opCtx)
					end := l.start(key, c)
					defer end()
					work := rand.N(6 * time.Millisecond)
					if r.IntN(10) == 0 {
						work = 30*time.Millisecond + rand.N(30*time.Millisecond) // a longer operation
					}
					time.Sleep(work)
					if errors.Is(context.Cause(opCtx), ErrLeaseLost) {
						l.mu.Lock()
						l.healthyLost++
						l.violate("%s: a healthy run (token %d) lost its lease: %v", key, c.Token(), context.Cause(opCtx))
						l.mu.Unlock()
					}
					return fnValue(key), nil
				})
				switch kind := errKind(err); kind {
				case "":
					if v != fnValue(key) {
						l.mu.Lock()
						l.violate("%s answered %q", key, v)
						l.mu.Unlock()
					}
					l.acked(key, gen)
					l.count("do: ok")
				case "in progress", "unavailable":
					if kind == "unavailable" && !ran {
						l.lostClaim(key)
					}
					l.count("do: " + kind)
				case "lease lost":
					// Allowed only when the operator forgot the key during
					// the call: a result stored, then forgotten before a
					// resent Complete (its first reply lost) ran.
					if l.forgotSince(key, gen) {
						l.count("do: lease lost to a forget")
						break
					}
					fallthrough
				default:
					l.mu.Lock()
					l.violate("%s: Do answered %v", key, err)
					l.mu.Unlock()
				}
			}
		}()
	}

	// The operator, until the workers are done.
	stop := make(chan struct{})
	opDone := make(chan struct{})
	go func() {
		defer close(opDone)
		r := rand.New(rand.NewPCG(seed, 99))
		for {
			select {
			case <-stop:
				return
			default:
			}
			// Most often a key whose holder is known to have died (a stuck
			// key reported to the operator); else one whose operation runs
			// now, one a worker asked for lately, or any key.
			var key string
			switch n := r.IntN(8); {
			case n < 4:
				key = l.deadKey(r)
			case n < 6:
				key = l.runningKey(r)
			case n == 6:
				key = l.recentKey(r)
			}
			if key == "" {
				key = "k" + strconv.Itoa(r.IntN(keys))
			}
			seen, err := operator.Inspect(ctx, scope, key)
			if err != nil {
				l.count("operator: inspect failed")
				continue
			}
			time.Sleep(rand.N(10 * time.Millisecond)) // the operator reads; the key may be claimed meanwhile
			operate(l, operator, r, scope, key, seen)
		}
	}()
	wg.Wait()
	close(stop)
	<-opDone
	p.Set(faultproxy.Faults{})

	// Once the leases have run out, every key answers a caller without
	// faults; its claim, if it runs, is checked as any other.
	time.Sleep(faultLease + 50*time.Millisecond)
	direct, err := keeperOn(&fenceStore{recordStore: clean, f: f}, WithLease(faultLease), WithRetention(time.Minute))
	require.NoError(t, err)
	for n := 0; n < keys; n++ {
		key := "k" + strconv.Itoa(n)
		v, err := Do(ctx, direct, scope, key, func(opCtx context.Context) (string, error) {
			c, _ := ClaimFromContext(opCtx)
			defer l.start(key, c)()
			return fnValue(key), nil
		})
		if assert.NoError(t, err, "%s after the faults stopped and the lease ran out", key) {
			assert.Equal(t, fnValue(key), v)
		}
	}

	checked := l.checkAbandoned()
	f.mu.Lock()
	defer f.mu.Unlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	t.Logf("%d calls: %d runs (%d recovered), %d holders died; %d overlapping runs, %d healthy runs that lost their lease; "+
		"%d abandoned claims, each checked against the next claim: %d; completions %d, stale refused %d, stale accepted %d; "+
		"outcomes: %s; proxy %+v",
		ops.Load(), l.runs, l.recovered, l.crashes, l.overlaps, l.healthyLost, len(l.abandoned), checked,
		f.completed, f.staleRefused, f.nStale, sortedCounts(l.counts), p.Stats())
	for _, v := range l.violations {
		assert.Fail(t, v)
	}
	for _, s := range f.staleAccepted {
		assert.Failf(t, "violation", "stale completion accepted: %s", s)
	}
	assert.Positive(t, len(l.abandoned), "the operator abandoned no claim")
	assert.Positive(t, l.counts["forget: removed completed"], "the operator forgot no completed record")
	assert.Positive(t, l.counts["forget: refused live"], "the operator never tried to forget a live claim")
	if st := p.Stats(); st.Cuts+st.DroppedReplies+st.DelayedReplies == 0 {
		assert.Failf(t, "violation", "the proxy put in no fault: %+v", st)
	}
}

// operate is one action of the operator on the record of key it was shown
// (seen), named by seen's token.
func operate(l *opLedger, operator *Keeper, r *rand.Rand, scope, key string, seen Record) {
	ctx := context.Background()
	dead := seen.State == StatePending && l.isDead(key, seen.Token)
	switch {
	case dead && (r.IntN(3) > 0 || l.wasAbandoned(key, seen.Token)):
		// An abandoned claim is left for the next attempt to take over
		// (checkAbandoned checks that it does): abandoned again, never
		// forgotten.
		got, err := operator.abandonKey(ctx, scope, key, seen.Token)
		switch {
		case err != nil:
			l.count("abandon: failed")
		case got.State == StatePending && got.Token == seen.Token:
			if got.LeaseLeft > 0 {
				l.mu.Lock()
				l.violate("%s: abandoned token %d still has %s of lease", key, got.Token, got.LeaseLeft)
				l.mu.Unlock()
			}
			l.abandonedClaim(key, got)
			l.count("abandon: ended")
		case got.State == StatePending && got.LeaseLeft <= 0 && got.Age < faultLease:
			// A newer claim whose lease is over, though it was made less
			// than a lease ago: ended early, by an abandon it was not named
			// in.
			l.mu.Lock()
			l.violate("%s: abandon of token %d ended the lease of token %d, made %s ago", key, seen.Token, got.Token, got.Age)
			l.mu.Unlock()
		default:
			l.count("abandon: nothing to do")
		}
	case dead:
		done := l.forgetting(key)
		got, err := operator.forgetToken(ctx, scope, key, seen.Token, true)
		done()
		countForget(l, key, seen, got, err, true)
	case seen.State == StatePending:
		// A claim not known dead: a healthy holder, or one whose claim
		// answer was lost. Without force.
		done := l.forgetting(key)
		got, err := operator.forgetToken(ctx, scope, key, seen.Token, false)
		done()
		countForget(l, key, seen, got, err, false)
	case seen.State == StateCompleted || seen.State == StateReleased:
		done := l.forgetting(key)
		got, err := operator.forgetToken(ctx, scope, key, seen.Token, false)
		done()
		countForget(l, key, seen, got, err, false)
	}
}

// countForget checks and counts what a forget answered.
func countForget(l *opLedger, key string, seen, got Record, err error, force bool) {
	var refused *ForgetRefusedError
	switch {
	case errors.As(err, &refused):
		if force {
			l.mu.Lock()
			l.violate("%s: a forced forget was refused: %v", key, err)
			l.mu.Unlock()
		}
		if refused.LeaseLeft > 0 {
			l.count("forget: refused live")
		} else {
			l.count("forget: refused checkpoints")
		}
	case err != nil:
		l.count("forget: failed")
	case got.State == StateAbsent:
		l.count("forget: nothing to forget")
	case got.Token != seen.Token:
		l.mu.Lock()
		l.violate("%s: forget of token %d removed the record of token %d", key, seen.Token, got.Token)
		l.mu.Unlock()
	case got.State == StatePending && !l.isDead(key, got.Token) && (got.LeaseLeft > 0 || len(got.Checkpoints) > 0):
		l.mu.Lock()
		l.violate("%s: forget removed a live claim or checkpoints (token %d, lease left %s, %d checkpoints) not known dead", key, got.Token, got.LeaseLeft, len(got.Checkpoints))
		l.mu.Unlock()
	case got.State == StateCompleted:
		l.count("forget: removed completed")
	default:
		l.count("forget: removed " + got.State.String())
	}
}
