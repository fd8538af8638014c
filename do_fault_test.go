package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"strings"
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

// The fault tests, the linearizability histories, the client-gone tests and
// the soak share what follows: the client settings behind a fault proxy, the
// ledger of runs per key, the ledger of fencing tokens, and store wrappers
// that end a caller's context at a chosen point of a call or send the
// renewals around the faults.

// Client settings behind a fault proxy. A command through the proxy gives up
// after at most faultCallBound: each of its tries waits out the read timeout
// (a delayed reply), with a backoff between tries.
const (
	faultReadTimeout = 50 * time.Millisecond
	faultRetries     = 3
	faultMaxBackoff  = 8 * time.Millisecond
	faultCallBound   = (faultRetries+1)*faultReadTimeout + faultRetries*faultMaxBackoff

	// faultLease is the lease of the tests under faults. A claim that Redis
	// ran at t0 may be answered only at t0 + faultCallBound: its reply is
	// delayed past the read timeout, go-redis sends it again, and the
	// script answers the same claim (same attempt) without a new lease. The
	// first renewal comes a third of a lease after that answer. So the
	// lease must outlast faultCallBound + lease/3 by far, or a run that
	// started on a claim answered late can still be running when its lease
	// ends, and whether another worker takes the key over beside it then
	// depends on how fast a busy machine schedules the two. At 1.5s, a claim
	// answered as late as possible is renewed about 0.8s before its lease
	// ends (TestFaultsLateClaimBound checks the arithmetic).
	faultLease = 1500 * time.Millisecond
)

// TestFaultsLateClaimBound: the lease of the fault tests leaves, after the
// latest possible answer to a claim and its first renewal, at least half a
// lease for a busy machine to schedule the renewal.
func TestFaultsLateClaimBound(t *testing.T) {
	assert.Less(t, faultCallBound+faultLease/3, faultLease/2)
}

// newFaultClient is a go-redis client of addr (a fault proxy) with the
// settings above and a pool large enough that no command waits for a
// connection (a wait would stretch a call past faultCallBound).
func newFaultClient(t testing.TB, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{
		Addr: addr, ReadTimeout: faultReadTimeout, WriteTimeout: faultReadTimeout,
		DialTimeout: time.Second, PoolSize: 128,
		MaxRetries: faultRetries, MinRetryBackoff: time.Millisecond, MaxRetryBackoff: faultMaxBackoff,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

// newFaultProxy starts a fault proxy in front of addr, closed in t.Cleanup.
func newFaultProxy(t testing.TB, addr string, seed uint64) *faultproxy.Proxy {
	p, err := faultproxy.New(addr, seed)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// cutEvery closes every connection of p every d until the returned function
// is called (which waits for it to stop); with d 0 it does nothing.
func cutEvery(p *faultproxy.Proxy, d time.Duration) (stop func()) {
	if d <= 0 {
		return func() {}
	}
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-quit:
				return
			case <-time.After(d):
				p.CutAll()
			}
		}
	}()
	return func() { close(quit); <-done }
}

// errKind names what err is, for the tallies: one of idem's errors, a final
// error, the caller's own cancellation, "" for nil, or "untyped".
func errKind(err error) string {
	var final *FinalError
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ErrCorrupt):
		return "corrupt"
	case errors.Is(err, ErrLeaseLost):
		return "lease lost"
	case errors.Is(err, ErrUnavailable):
		return "unavailable"
	case errors.Is(err, ErrInProgress):
		return "in progress"
	case errors.Is(err, ErrMismatch):
		return "mismatch"
	case errors.As(err, &final):
		return "final"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline"
	}
	return "untyped"
}

// isGoneErr reports whether err is what a caller whose context ended gets:
// its cancellation, and not the store's failure.
func isGoneErr(err error) bool {
	return (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) && !errors.Is(err, ErrUnavailable)
}

// runLedger follows the runs of operations per key. A run counts as alive
// from the moment the operation starts until it returns; a second run of a
// key that starts while one is alive is a duplicate execution, whatever came
// of either.
type runLedger struct {
	mu     sync.Mutex
	live   map[string]int
	runs   map[string]int
	tokens map[string]int64 // the token of the key's last run
	gaveUp map[string]bool  // the key's last run failed, so its claim was given up
	acked  map[string]bool  // a call for the key was answered with its result
	// recovered counts re-runs that took over a claim whose lease had run
	// out (Recovered); afterGiveUp, re-runs after a run that failed.
	recovered, afterGiveUp int
	overlaps               int
	errs                   map[string]int
	// gone counts the calls per goneMode whose caller went away; ranGone,
	// those whose fn ran.
	gone, ranGone map[string]int
	violations    []string
	nViolations   int
	// liveTok is the token of the run of a key alive now; pairs lists the
	// overlaps (key, the earlier run's token); lost holds the runs (key and
	// token) told that their lease was lost.
	liveTok map[string]int64
	pairs   []overlapPair
	lost    map[overlapPair]bool
	// lossAllowed: renewals meet faults, so a run may lose its lease (and a
	// run beside it is then no violation by itself: see overlapsBeside).
	lossAllowed bool
}

// overlapPair names a run: its key and its token.
type overlapPair struct {
	key   string
	token int64
}

func newRunLedger() *runLedger {
	return &runLedger{
		live: map[string]int{}, runs: map[string]int{}, tokens: map[string]int64{},
		gaveUp: map[string]bool{}, acked: map[string]bool{}, errs: map[string]int{},
		gone: map[string]int{}, ranGone: map[string]int{},
		liveTok: map[string]int64{}, lost: map[overlapPair]bool{},
	}
}

// leaseLost records that the run of key with token was told its lease was
// lost (its Do answered ErrLeaseLost).
func (l *runLedger) leaseLost(key string, token int64) {
	l.mu.Lock()
	l.lost[overlapPair{key, token}] = true
	l.mu.Unlock()
}

// overlapsBeside splits the overlaps by the run that was alive when another
// started: one that was told its lease was lost, or one that was not.
func (l *runLedger) overlapsBeside() (lostHolder, healthyHolder int) {
	for _, p := range l.pairs {
		if l.lost[p] {
			lostHolder++
		} else {
			healthyHolder++
		}
	}
	return lostHolder, healthyHolder
}

// violate records a violation; l.mu is held.
func (l *runLedger) violate(format string, args ...any) {
	l.nViolations++
	if len(l.violations) < 50 {
		l.violations = append(l.violations, fmt.Sprintf(format, args...))
	}
}

// start is called by an operation of key as it starts, with its context; the
// operation calls done as it returns, with whether it failed (its claim is
// then given up). It checks that no other run of the key is alive, that no
// result of the key was acknowledged, that tokens increase from run to run,
// and that a re-run is either a takeover (Recovered) or follows a run that
// gave the key up.
func (l *runLedger) start(ctx context.Context, key string) (done func(failed bool)) {
	c, ok := ClaimFromContext(ctx)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.live[key] > 0 {
		l.overlaps++
		l.pairs = append(l.pairs, overlapPair{key, l.liveTok[key]})
		if !l.lossAllowed {
			l.violate("%s: a run started while %d other run(s) of the key were alive", key, l.live[key])
		}
	}
	if l.acked[key] {
		l.violate("%s: a run started after a result of the key was acknowledged", key)
	}
	switch {
	case !ok:
		l.violate("%s: the operation's context carries no claim", key)
	case c.Token() <= l.tokens[key]:
		l.violate("%s: a run with token %d after one with token %d", key, c.Token(), l.tokens[key])
	}
	if ok && l.runs[key] > 0 {
		switch {
		case c.Recovered():
			l.recovered++
		case l.gaveUp[key]:
			l.afterGiveUp++
		default:
			l.violate("%s: run %d has a fresh claim (attempt %d, not recovered) although the run before it did not give the key up", key, l.runs[key]+1, c.Attempt())
		}
	}
	if ok {
		l.tokens[key] = c.Token()
		if l.live[key] == 0 {
			l.liveTok[key] = c.Token()
		}
	}
	l.runs[key]++
	l.live[key]++
	var once sync.Once
	return func(failed bool) {
		once.Do(func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.live[key]--
			l.gaveUp[key] = failed
		})
	}
}

// fnValue is the value the operation of key returns.
func fnValue(key string) string { return "v:" + key }

// op returns an operation of key that runs for up to maxWork and returns
// fnValue(key).
func (l *runLedger) op(key string, maxWork time.Duration) func(context.Context) (string, error) {
	return func(ctx context.Context) (string, error) {
		done := l.start(ctx, key)
		defer done(false)
		if maxWork > 0 {
			time.Sleep(rand.N(maxWork))
		}
		return fnValue(key), nil
	}
}

// outcome records what a Do call for key answered, and returns its kind.
// allowed are the kinds (errKind) the scenario allows; any other is a
// violation, and so is a value that is not the key's.
func (l *runLedger) outcome(key, v string, err error, allowed ...string) string {
	kind := errKind(err)
	l.mu.Lock()
	defer l.mu.Unlock()
	if kind == "" {
		if v != fnValue(key) {
			l.violate("%s answered %q", key, v)
		}
		l.acked[key] = true
		l.errs["ok"]++
		return kind
	}
	l.errs[kind]++
	if !slices.Contains(allowed, kind) {
		l.violate("%s: %s error not allowed here: %v", key, kind, err)
	}
	return kind
}

// ack records that a result of key was acknowledged otherwise than by a
// value (a stored final error).
func (l *runLedger) ack(key string) {
	l.mu.Lock()
	l.acked[key] = true
	l.mu.Unlock()
}

// checkGone records what a Do call of key in mode answered (see outcome),
// and checks it against what mode allows, given whether its fn ran (and
// returned fnValue(key), unless mode is goneFnGivesUp) and whether its
// caller's cancellation happened:
//
//   - a caller gone before its claim was answered (goneBefore, goneInClaim,
//     goneClaimFail) gets its cancellation, never ErrUnavailable, and fn
//     does not run;
//   - a caller gone once the claim answered, but before idem read the
//     answer, never gets ErrUnavailable for its claim;
//   - fn that gave up with its context's error is answered that error;
//   - fn that ran and returned its value is answered that value, with
//     ErrUnavailable at worst (the result could not be stored), never with
//     ErrLeaseLost nor a cancellation: its lease was renewed, and the
//     result is stored on a context of its own.
func (l *runLedger) checkGone(key string, mode goneMode, g *callerGone, ran bool, v string, err error, allowed ...string) {
	l.outcome(key, v, err, allowed...)
	fired := g.fired.Load() || mode == goneBefore || mode == goneFnGivesUp || mode == goneFnGoesOn
	l.mu.Lock()
	defer l.mu.Unlock()
	if fired {
		l.gone[goneModeNames[mode]]++
	}
	if ran {
		l.ranGone[goneModeNames[mode]]++
	}
	bad := func(format string, args ...any) {
		l.violate("%s, %s: "+format, append([]any{key, goneModeNames[mode]}, args...)...)
	}
	switch mode {
	case goneBefore, goneInClaim, goneClaimFail:
		if fired && (ran || !isGoneErr(err)) {
			bad("the caller left before the claim was answered: fn ran %v, err %v; want its cancellation and no run", ran, err)
		}
	case goneAnswered:
		if fired && !ran && errors.Is(err, ErrUnavailable) {
			bad("the caller left before idem read the claim's answer, and got ErrUnavailable: %v", err)
		}
	case goneFnGivesUp:
		if ran && !errors.Is(err, context.Canceled) {
			bad("fn gave up with its context's error, Do answered %v", err)
		}
	}
	if ran && mode != goneFnGivesUp {
		if errors.Is(err, ErrLeaseLost) && l.lossAllowed {
			return // its renewals met the faults; its value is not stored
		}
		if errors.Is(err, ErrLeaseLost) || isGoneErr(err) {
			bad("fn ran and returned its value, and Do answered %v: its lease was renewed, its result must be stored or ErrUnavailable", err)
		}
		if v != fnValue(key) {
			bad("fn ran and Do answered %q, %v", v, err)
		}
	}
}

func (l *runLedger) totalRuns() (runs, keys int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, n := range l.runs {
		runs += n
	}
	return runs, len(l.runs)
}

// check fails t for every violation seen.
func (l *runLedger) check(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, v := range l.violations {
		assert.Fail(t, v)
	}
}

// sortedCounts formats a tally in a stable order.
func sortedCounts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s %d", k, m[k])
	}
	return b.String()
}

// fences follows the fencing tokens the store hands out, per record, to
// catch a stale completion accepted: a Complete that succeeds for a token
// although the store had answered a claim with a higher token for the record
// before that Complete was sent.
type fences struct {
	mu            sync.Mutex
	max           map[string]int64 // the highest token a claim was answered with, per record id
	completed     int
	staleRefused  int
	staleAccepted []string // the first 50
	nStale        int      // stale completions accepted
}

func newFences() *fences { return &fences{max: map[string]int64{}} }

func (f *fences) highest(id string) int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.max[id]
}

// fenceStore is a store that records the claims and completions it passes
// on in f.
type fenceStore struct {
	recordStore
	f *fences
}

func (s *fenceStore) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	r, err := s.recordStore.Claim(ctx, id, req)
	if err == nil && r.Status == statusClaimed {
		s.f.mu.Lock()
		s.f.max[id] = max(s.f.max[id], r.Token)
		s.f.mu.Unlock()
	}
	return r, err
}

func (s *fenceStore) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (stored bool, err error) {
	before := s.f.highest(id)
	stored, err = s.recordStore.Complete(ctx, id, token, value, keep)
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	switch {
	case err == nil && before > token:
		s.f.nStale++
		if len(s.f.staleAccepted) < 50 {
			s.f.staleAccepted = append(s.f.staleAccepted, fmt.Sprintf("record %s: completion by token %d accepted after a claim with token %d", id, token, before))
		}
	case err == nil:
		s.f.completed++
	case errors.Is(err, ErrLeaseLost):
		s.f.staleRefused++
	}
	return stored, err
}

// splitStore sends renewals (Extend) to renew and every other call to the
// store it embeds: a process whose renewals get through while the calls of
// its callers meet the faults. A holder whose renewals get through must never
// see its key run by another.
type splitStore struct {
	recordStore
	renew recordStore
}

func (s splitStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	return s.renew.Extend(ctx, id, token, lease, keep)
}

// goneAt is the point of a store call at which a caller goes away.
type goneAt uint8

const (
	// goneBeforeStore: the caller's context ends as the call starts, so
	// go-redis sends nothing.
	goneBeforeStore goneAt = iota + 1
	// goneAfterStore: the store answered; the caller's context ends before
	// idem reads the answer.
	goneAfterStore
	// goneStoreFails: the caller's context ends and the call fails as on a
	// reset connection, without reaching Redis.
	goneStoreFails
)

// goneOn names the calls of a store, for callerGone.
type goneOn uint8

const (
	goneOnAny goneOn = iota
	goneOnClaim
	goneOnComplete
	goneOnRelease
	goneOnExtend
)

// callerGone, carried in a caller's context, makes goneStore end that
// context at a point of the first store call of kind on made with it (or of
// any kind, goneOnAny): once, so that later calls (a Wait's retries, renewals)
// are left alone.
type callerGone struct {
	at     goneAt
	on     goneOn
	cancel context.CancelFunc
	fired  atomic.Bool
}

type callerGoneKey struct{}

// withCallerGone returns a cancellable context that carries a callerGone
// for at and on (at 0: none fires, but g.cancel still ends the context).
func withCallerGone(parent context.Context, at goneAt, on goneOn) (context.Context, *callerGone) {
	ctx, cancel := context.WithCancel(parent)
	g := &callerGone{at: at, on: on, cancel: cancel}
	return context.WithValue(ctx, callerGoneKey{}, g), g
}

// errGoneReset is the error of a store call cut by goneStoreFails.
var errGoneReset = errors.New("read tcp 127.0.0.1: connection reset by peer")

// goneStore is a store that ends callers' contexts as their callerGone says.
type goneStore struct{ recordStore }

// gone returns the callerGone of ctx that fires on a call of op, marking it
// fired, or nil.
func firingGone(ctx context.Context, op goneOn) *callerGone {
	g, _ := ctx.Value(callerGoneKey{}).(*callerGone)
	if g == nil || g.at == 0 || (g.on != goneOnAny && g.on != op) || !g.fired.CompareAndSwap(false, true) {
		return nil
	}
	return g
}

// around runs call with the callerGone of ctx for op, if any, applied.
func aroundGone(ctx context.Context, op goneOn, call func() error) error {
	g := firingGone(ctx, op)
	if g == nil {
		return call()
	}
	switch g.at {
	case goneBeforeStore:
		g.cancel()
		return call()
	case goneAfterStore:
		defer g.cancel()
		return call()
	default:
		g.cancel()
		return errGoneReset
	}
}

func (s goneStore) Claim(ctx context.Context, id string, req claimRequest) (r claimReply, err error) {
	err = aroundGone(ctx, goneOnClaim, func() error {
		var err error
		r, err = s.recordStore.Claim(ctx, id, req)
		return err
	})
	return r, err
}

func (s goneStore) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (stored bool, err error) {
	err = aroundGone(ctx, goneOnComplete, func() error {
		var err error
		stored, err = s.recordStore.Complete(ctx, id, token, value, keep)
		return err
	})
	return stored, err
}

func (s goneStore) Release(ctx context.Context, id string, token int64, keep time.Duration) error {
	return aroundGone(ctx, goneOnRelease, func() error { return s.recordStore.Release(ctx, id, token, keep) })
}

func (s goneStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	return aroundGone(ctx, goneOnExtend, func() error { return s.recordStore.Extend(ctx, id, token, lease, keep) })
}

// TestFaults runs Do from several workers on a few keys through a fault
// proxy that cuts connections, drops replies after the server executed the
// command, delays replies past the client's read timeout, or closes every
// connection at once; go-redis retries as it does by default. Under each:
// fn never runs twice for a key at once, never after a result for the key was
// acknowledged, and a second run is always a marked takeover (Recovered) of a
// claim whose result was never stored; every failure the caller sees is
// typed; and once the faults stop, no key is stuck beyond its lease.
//
// The lease is faultLease: long against the time a claim can take to be
// answered (faultCallBound). It used to be 300ms against a read timeout of
// 100ms, four tries and go-redis's default backoff, so a claim whose replies
// were delayed could be answered after most or all of its lease had gone;
// fn then ran on a lease about to end (its first renewal due a third of a
// lease later), and the overlap check failed whenever the machine was busy
// enough to let another worker claim the key while fn was still running.
func TestFaults(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	scenarios := []struct {
		name   string
		faults faultproxy.Faults
		cutAll bool
	}{
		{name: "cut connections", faults: faultproxy.Faults{Cut: 0.2}},
		{name: "drop replies after execution", faults: faultproxy.Faults{DropReply: 0.2}},
		{name: "delay replies past the read timeout", faults: faultproxy.Faults{Delay: 3 * faultReadTimeout, Slow: 0.2}},
		{name: "close every connection", cutAll: true},
	}
	for i, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			p := newFaultProxy(t, srv.Addr, uint64(i+1))
			c := newFaultClient(t, p.Addr())
			prefix := "fault" + strconv.Itoa(i) + ":"
			k := clusterKeeper(t, c, []Option{WithPrefix(prefix)}, WithLease(faultLease), WithRetention(time.Minute))
			l := newRunLedger()
			p.Set(sc.faults)
			stopCuts := func() {}
			if sc.cutAll {
				stopCuts = cutEvery(p, 15*time.Millisecond)
			}
			ctx := context.Background()
			const keys, workers, calls = 100, 8, 50
			var wg sync.WaitGroup
			var ops atomic.Int64
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(w), uint64(i)))
					for j := 0; j < calls; j++ {
						key := "k" + strconv.Itoa(r.IntN(keys))
						v, err := Do(ctx, k, "faults", key, l.op(key, 3*time.Millisecond))
						ops.Add(1)
						l.outcome(key, v, err, "in progress", "lease lost", "unavailable")
					}
				}()
			}
			wg.Wait()
			stopCuts()
			p.Set(faultproxy.Faults{})

			// No key is stuck: once the lease has run out, every key answers,
			// here to a client without faults or short timeouts.
			time.Sleep(faultLease + 50*time.Millisecond)
			direct := clusterKeeper(t, srv.Client(t), []Option{WithPrefix(prefix)}, WithLease(faultLease), WithRetention(time.Minute))
			stuck := 0
			for n := 0; n < keys; n++ {
				key := "k" + strconv.Itoa(n)
				v, err := Do(ctx, direct, "faults", key, l.op(key, 0))
				if err != nil {
					stuck++
					assert.Failf(t, "violation", "%s after the faults stopped and the lease ran out: %v", key, err)
				}
				l.outcome(key, v, err)
			}

			runs, nkeys := l.totalRuns()
			t.Logf("%s: %d calls, %d runs of fn on %d keys, %d recovered re-runs, %d overlapping; answers: %s; proxy %+v; stuck %d",
				sc.name, ops.Load(), runs, nkeys, l.recovered, l.overlaps, sortedCounts(l.errs), p.Stats(), stuck)
			l.check(t)
			if st := p.Stats(); st.Cuts+st.DroppedReplies+st.DelayedReplies == 0 {
				assert.Failf(t, "violation", "the proxy put in no fault: %+v", st)
			}
		})
	}
}

// goneMode is how a caller of Do goes away in TestFaultsCallerGone.
type goneMode int

const (
	callerStays   goneMode = iota // the caller stays
	goneBefore                    // its context ended before it called Do
	goneInClaim                   // it goes as the claim is sent: Redis never sees the claim
	goneClaimFail                 // it goes as the claim fails on a reset connection
	goneAnswered                  // it goes once the claim answered, before idem reads the answer; fn goes on
	goneTimer                     // a timer ends it at a random point of the call
	goneFnGivesUp                 // it goes while fn runs, and fn gives up (returns its context's error)
	goneFnGoesOn                  // it goes while fn runs, and fn goes on for a while on context.WithoutCancel
	goneComplete                  // it goes as fn's result is sent to be stored
	goneWaiting                   // it waits for an attempt in progress (Wait), and a timer ends it
	goneModes
)

var goneModeNames = [goneModes]string{
	"stays", "gone before the call", "gone as the claim is sent", "gone as the claim fails",
	"gone once the claim answered", "gone at a random point", "gone while fn runs, fn gives up",
	"gone while fn runs, fn goes on", "gone as the result is stored", "gone while waiting",
}

// goneContext returns the context of a call in mode, and its callerGone.
func goneContext(mode goneMode) (context.Context, *callerGone) {
	bg := context.Background()
	switch mode {
	case goneInClaim:
		return withCallerGone(bg, goneBeforeStore, goneOnClaim)
	case goneClaimFail:
		return withCallerGone(bg, goneStoreFails, goneOnClaim)
	case goneAnswered:
		return withCallerGone(bg, goneAfterStore, goneOnClaim)
	case goneComplete:
		return withCallerGone(bg, goneBeforeStore, goneOnComplete)
	}
	ctx, g := withCallerGone(bg, 0, goneOnAny)
	switch mode {
	case goneBefore:
		g.cancel()
	case goneTimer:
		time.AfterFunc(rand.N(3*time.Millisecond), g.cancel)
	case goneWaiting:
		time.AfterFunc(rand.N(30*time.Millisecond), g.cancel)
	}
	return ctx, g
}

// TestFaultsCallerGone: the callers of TestFaults go away at every point of
// a call: before it, as the claim is sent, as it fails, once it answered,
// while fn runs (fn then gives up, or goes on), as the result is stored, while
// waiting for an attempt in progress, or at a random moment. A few operations
// outlive their caller by more than three leases (fn goes on after its
// context was cancelled, on context.WithoutCancel, then returns a value),
// while a prober asks for their keys again and again on another Keeper. Under
// each fault of TestFaults, and with coalescing:
//
//   - no run of a key starts while another is alive (a counter of live runs
//     per key, incremented as fn starts and decremented as it returns), nor
//     after a result of the key was acknowledged, and a re-run is a takeover
//     (Recovered) or follows a run that failed;
//   - no completion by a stale token is accepted, and each key's stored
//     result is that of the highest token the store handed out for it;
//   - a caller whose context ended before the answer gets its cancellation
//     (context.Canceled), never ErrUnavailable, and fn does not run; a caller
//     whose fn ran gets fn's value, with ErrUnavailable at worst (the result
//     could not be stored), never ErrLeaseLost: renewals went on;
//   - every error is one of ErrInProgress, ErrUnavailable, ErrLeaseLost (a
//     release retried after another claim took the key), context.Canceled
//     or context.DeadlineExceeded.
//
// Renewals go around the faults (splitStore): the processes are healthy and
// renew on time, so a second run beside a live one would be a bug whatever
// the faults did to the callers' own calls.
func TestFaultsCallerGone(t *testing.T) {
	srv := redistest.Start(t)
	scenarios := []struct {
		name     string
		faults   faultproxy.Faults
		cutEvery time.Duration
		coalesce bool
	}{
		{name: "cut connections", faults: faultproxy.Faults{Cut: 0.1}},
		{name: "drop replies after execution", faults: faultproxy.Faults{DropReply: 0.1}},
		{name: "delay replies past the read timeout", faults: faultproxy.Faults{Delay: 3 * faultReadTimeout, Slow: 0.1}},
		{name: "close every connection", cutEvery: 15 * time.Millisecond},
		{name: "drop replies, coalescing", faults: faultproxy.Faults{DropReply: 0.1}, coalesce: true},
	}
	for i, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			faultsCallerGone(t, srv, uint64(100+i), "gone"+strconv.Itoa(i)+":", sc.faults, sc.cutEvery, sc.coalesce)
		})
	}
}

func faultsCallerGone(t *testing.T, srv *redistest.Server, seed uint64, prefix string, faults faultproxy.Faults, cuts time.Duration, coalesce bool) {
	p := newFaultProxy(t, srv.Addr, seed)
	faulty, err := openRedisStore(newFaultClient(t, p.Addr()), WithPrefix(prefix))
	require.NoError(t, err)
	clean, err := openRedisStore(srv.Client(t), WithPrefix(prefix))
	require.NoError(t, err)
	f := newFences()
	store := goneStore{&fenceStore{recordStore: splitStore{recordStore: faulty, renew: clean}, f: f}}
	k, err := keeperOn(store, WithLease(faultLease), WithRetention(time.Minute), WithCoalescing(coalesce))
	require.NoError(t, err)
	probe, err := keeperOn(store, WithLease(faultLease), WithRetention(time.Minute)) // asks Redis, never the coalescing layer
	require.NoError(t, err)
	l := newRunLedger()
	const scope = "gone"
	allowed := []string{"in progress", "unavailable", "lease lost", "canceled", "deadline"}

	p.Set(faults)
	stopCuts := cutEvery(p, cuts)

	// Operations that outlive their caller by more than three leases, each
	// on a key of its own; a prober asks for the key while they run.
	const longOps = 3
	outlive := 3*faultLease + faultLease/5
	var (
		wg     sync.WaitGroup
		probes atomic.Int64 // probes answered ErrInProgress while a long operation ran
	)
	for n := 0; n < longOps; n++ {
		key := "long" + strconv.Itoa(n)
		started, finished := make(chan struct{}), make(chan struct{})
		wg.Add(2)
		go func() {
			defer wg.Done()
			defer close(finished)
			// Claims may fail under the faults: try until the operation ran.
			for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(25 * time.Millisecond) {
				ctx, g := goneContext(callerStays)
				ran := false
				v, err := Do(ctx, k, scope, key, func(opCtx context.Context) (string, error) {
					ran = true
					done := l.start(opCtx, key)
					defer done(false)
					close(started)
					g.cancel() // the caller times out and leaves
					<-opCtx.Done()
					assert.ErrorIs(t, context.Cause(opCtx), context.Canceled, "the operation sees its caller's cancellation")
					work := context.WithoutCancel(opCtx) // the operation goes on
					c, ok := ClaimFromContext(work)
					assert.True(t, ok && c.Token() != 0, "%s: the claim is in the operation's context", key)
					time.Sleep(outlive)
					// A lost lease would show in Do's answer (checkGone):
					// the context was cancelled by the caller first.
					return fnValue(key), nil
				})
				l.checkGone(key, goneFnGoesOn, g, ran, v, err, allowed...)
				if ran {
					return
				}
			}
			assert.Failf(t, "violation", "%s: the long operation never got its claim", key)
			close(started)
		}()
		go func() {
			defer wg.Done()
			<-started
			for {
				select {
				case <-finished:
					return
				case <-time.After(faultLease / 4):
				}
				v, err := Do(context.Background(), probe, scope, key, l.op(key, 0))
				if errors.Is(err, ErrInProgress) {
					probes.Add(1)
				}
				l.outcome(key, v, err, allowed...)
			}
		}()
	}

	// Workers on shared keys, each call going away in a mode of its own.
	const keys, workers, calls = 100, 6, 60
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, uint64(w)))
			for j := 0; j < calls; j++ {
				key := "k" + strconv.Itoa(r.IntN(keys))
				mode := goneMode(r.IntN(int(goneModes)))
				ctx, g := goneContext(mode)
				var opts []Option
				if mode == goneWaiting {
					opts = append(opts, WithWait(faultLease))
				}
				ran := false
				v, err := Do(ctx, k, scope, key, func(opCtx context.Context) (string, error) {
					ran = true
					done := l.start(opCtx, key)
					switch mode {
					case goneFnGivesUp:
						g.cancel()
						<-opCtx.Done()
						if errors.Is(context.Cause(opCtx), ErrLeaseLost) {
							assert.Failf(t, "violation", "%s: the lease was lost", key)
						}
						done(true)
						return "", opCtx.Err()
					case goneFnGoesOn:
						g.cancel()
						<-opCtx.Done()
						time.Sleep(rand.N(30 * time.Millisecond))
					default:
						time.Sleep(rand.N(2 * time.Millisecond))
					}
					done(false)
					return fnValue(key), nil
				}, opts...)
				g.cancel()
				l.checkGone(key, mode, g, ran, v, err, allowed...)
			}
		}()
	}
	wg.Wait()
	stopCuts()
	p.Set(faultproxy.Faults{})

	// Once the lease has run out, every key answers a caller without faults,
	// and its stored result is that of the highest token handed out for it.
	time.Sleep(faultLease + 50*time.Millisecond)
	direct, err := keeperOn(&fenceStore{recordStore: clean, f: f}, WithLease(faultLease), WithRetention(time.Minute))
	require.NoError(t, err)
	ctx := context.Background()
	all := make([]string, 0, keys+longOps)
	for n := 0; n < keys; n++ {
		all = append(all, "k"+strconv.Itoa(n))
	}
	for n := 0; n < longOps; n++ {
		all = append(all, "long"+strconv.Itoa(n))
	}
	for _, key := range all {
		v, err := Do(ctx, direct, scope, key, l.op(key, 0))
		if err != nil {
			assert.Failf(t, "violation", "%s after the faults stopped and the lease ran out: %v", key, err)
		}
		l.outcome(key, v, err)
		out, err := direct.Begin(ctx, scope, key)
		if assert.NoError(t, err, key) && assert.True(t, out.Replayed, key) {
			assert.Equal(t, f.highest(recordID(scope, key)), out.Token, "%s: the stored result is not the last holder's", key)
		}
	}

	runs, nkeys := l.totalRuns()
	f.mu.Lock()
	defer f.mu.Unlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	t.Logf("%d runs of fn on %d keys (%d recovered re-runs, %d after a failed run), %d overlapping; %d probes of the long operations answered in progress; answers: %s; cancellations: %s; fn ran: %s; completions %d, stale refused %d, stale accepted %d; proxy %+v",
		runs, nkeys, l.recovered, l.afterGiveUp, l.overlaps, probes.Load(), sortedCounts(l.errs), sortedCounts(l.gone), sortedCounts(l.ranGone),
		f.completed, f.staleRefused, f.nStale, p.Stats())
	for _, v := range l.violations {
		assert.Fail(t, v)
	}
	for _, s := range f.staleAccepted {
		assert.Failf(t, "violation", "stale completion accepted: %s", s)
	}
	assert.Positive(t, probes.Load(), "the long operations were never probed while they ran")
	for _, mode := range []goneMode{goneBefore, goneInClaim, goneAnswered, goneFnGivesUp, goneFnGoesOn, goneComplete} {
		assert.Positive(t, l.gone[goneModeNames[mode]], "no call was %s", goneModeNames[mode])
	}
	for _, mode := range []goneMode{goneFnGivesUp, goneFnGoesOn, goneComplete} {
		assert.Positive(t, l.ranGone[goneModeNames[mode]], "fn never ran with a caller %s", goneModeNames[mode])
	}
	if st := p.Stats(); st.Cuts+st.DroppedReplies+st.DelayedReplies == 0 {
		assert.Failf(t, "violation", "the proxy put in no fault: %+v", st)
	}
}

// TestLateClaimIsRenewedBeforeItRuns guards a fixed bug: KeepAlive now
// renews a claim that has less than a third of its lease left before the
// operation starts (and the operation does not start if the lease is lost).
// The bug: a claim answered late
// (its reply delayed past the read timeout, then go-redis's retry answered
// by the script's same-attempt path, which neither checks nor renews the
// lease) reaches Do after its lease has run out by the process's own clock.
// Do runs fn on it all the same, with a context that is not cancelled, and
// schedules the first renewal a third of a lease later: meanwhile another
// caller takes the key over (Recovered) and runs it beside the first.
// The same happens, in a narrower window, to a claim answered after two
// thirds of its lease: its first renewal comes after the lease ended.
func TestLateClaimIsRenewedBeforeItRuns(t *testing.T) {
	redistest.Long(t)
	b := redistest.Real(t)
	rs, err := openRedisStore(b.Client)
	require.NoError(t, err)
	const lease = 3 * time.Second // the renewal, a second after fn starts, comes far later than the second caller
	late, err := keeperOn(&lateStore{recordStore: rs, lag: lease + 100*time.Millisecond}, WithLease(lease))
	require.NoError(t, err)
	other, err := keeperOn(rs, WithLease(lease))
	require.NoError(t, err)
	ctx := context.Background()
	var live, overlaps atomic.Int32
	ran := false
	_, err = Do(ctx, late, "s", "k", func(opCtx context.Context) (string, error) {
		ran = true
		live.Add(1)
		defer live.Add(-1)
		_, err := Do(ctx, other, "s", "k", func(context.Context) (string, error) {
			if live.Load() > 0 {
				overlaps.Add(1)
			}
			return "second", nil
		})
		assert.ErrorIs(t, err, ErrInProgress, "another caller while the first run is alive")
		return "first", nil
	})
	assert.Zero(t, overlaps.Load(), "the key ran twice at once")
	if !ran {
		// Refusing the late claim is a fix too: then the caller is told.
		assert.True(t, errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrUnavailable), "the late claim was refused with %v", err)
	}
}

// TestSlowFailedRenewalKeepsTheLease guards a fixed bug: after a failed
// renewal, KeepAlive now tries again within a third of what is left of the
// lease. The bug: after a renewal failed, KeepAlive scheduled the next one a full third of a lease after the
// failure returned, whatever is left of the lease. A renewal that fails
// slowly (every try of go-redis waits out its read timeout) thus leaves the
// lease to run out unrenewed although the outage was far shorter than the
// lease, and another caller takes the key over while the holder, healthy
// again, still runs. Here the lease is 3s, renewed at 1s; the renewal at 2s
// hangs 1.5s and fails; the next comes at 4.5s, the lease ends at 4s. At
// go-redis's defaults (read timeout 3s, 3 retries: a failed command takes
// over 12s) and idem's default lease (30s, renewed every 10s), one failed
// renewal is enough.
func TestSlowFailedRenewalKeepsTheLease(t *testing.T) {
	redistest.Long(t)
	b := redistest.Real(t)
	rs, err := openRedisStore(b.Client)
	require.NoError(t, err)
	const lease = 3 * time.Second
	holder, err := keeperOn(&slowFailStore{recordStore: rs, hang: lease / 2}, WithLease(lease))
	require.NoError(t, err)
	other, err := keeperOn(rs, WithLease(lease))
	require.NoError(t, err)
	ctx := context.Background()
	var live, overlaps atomic.Int32
	first := make(chan error, 1)
	go func() {
		_, err := Do(ctx, holder, "s", "k", func(opCtx context.Context) (string, error) {
			live.Add(1)
			defer live.Add(-1)
			time.Sleep(2 * lease)
			return "first", nil
		})
		first <- err
	}()
	// Another caller asks every 20ms while the first runs.
	for done := false; !done; {
		select {
		case err := <-first:
			assert.NoError(t, err, "the holder's renewals got through again after a failure shorter than its lease")
			done = true
		case <-time.After(20 * time.Millisecond):
			_, err := Do(ctx, other, "s", "k", func(context.Context) (string, error) {
				if live.Load() > 0 {
					overlaps.Add(1)
				}
				return "second", nil
			})
			assert.True(t, err == nil || errors.Is(err, ErrInProgress), "the other caller: %v", err)
		}
	}
	assert.Zero(t, overlaps.Load(), "the key ran twice at once")
}

// slowFailStore fails the second renewal after hang, as a renewal whose
// every try waited out the read timeout; the other calls pass.
type slowFailStore struct {
	recordStore
	n    atomic.Int32
	hang time.Duration
}

func (s *slowFailStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	if s.n.Add(1) == 2 {
		time.Sleep(s.hang)
		return errors.New("read tcp 127.0.0.1: i/o timeout")
	}
	return s.recordStore.Extend(ctx, id, token, lease, keep)
}

// lateStore answers claims lag after Redis ran them.
type lateStore struct {
	recordStore
	lag time.Duration
}

func (s *lateStore) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	r, err := s.recordStore.Claim(ctx, id, req)
	if err == nil && r.Status == statusClaimed {
		time.Sleep(s.lag)
	}
	return r, err
}

// TestLeaseExpiryChaos: handlers that pause past their lease at random, on
// keys that several workers claim at once. A completion by a holder whose key
// was taken over must be refused (stale completions accepted: must be 0), and
// the stored result of every key must be the one of its last holder, whose
// token is the highest ever handed out for the key.
func TestLeaseExpiryChaos(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	c := srv.Client(t)
	const lease = 40 * time.Millisecond
	k := clusterKeeper(t, c, []Option{WithPrefix("chaos:")}, WithLease(lease), WithRetention(time.Minute))
	ctx := context.Background()
	start := time.Now()

	type grant struct {
		token int64
		at    time.Duration // when Begin returned the claim
	}
	var (
		mu            sync.Mutex
		grants        = map[string][]grant{}
		staleAccepted int
		staleRefused  int
		paused        int
		completed     int
		untyped       []error
	)
	const keys, workers = 60, 6
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 7))
			for n := 0; n < keys; n++ {
				key := "k" + strconv.Itoa(n)
				for try := 0; try < 50; try++ {
					out, err := k.Begin(ctx, "chaos", key)
					if errors.Is(err, ErrInProgress) {
						time.Sleep(time.Duration(5+r.IntN(20)) * time.Millisecond)
						continue
					}
					if err != nil {
						mu.Lock()
						untyped = append(untyped, err)
						mu.Unlock()
						break
					}
					if out.Replayed {
						break
					}
					cl := out.Claim
					mu.Lock()
					grants[key] = append(grants[key], grant{cl.Token(), time.Since(start)})
					mu.Unlock()
					// Pause past the lease now and then, as a GC pause or a
					// stalled disk would.
					if r.IntN(3) == 0 {
						mu.Lock()
						paused++
						mu.Unlock()
						time.Sleep(lease + time.Duration(10+r.IntN(40))*time.Millisecond)
					}
					called := time.Since(start)
					err = cl.Complete(ctx, []byte(strconv.FormatInt(cl.Token(), 10)), 0)
					mu.Lock()
					overtaken := false
					for _, g := range grants[key] {
						if g.token > cl.Token() && g.at < called {
							overtaken = true
						}
					}
					switch {
					case err == nil && overtaken:
						staleAccepted++
					case err == nil:
						completed++
					case errors.Is(err, ErrLeaseLost):
						staleRefused++
					default:
						untyped = append(untyped, err)
					}
					mu.Unlock()
					break
				}
			}
		}()
	}
	wg.Wait()
	assert.Empty(t, untyped, "failures")
	for n := 0; n < keys; n++ {
		key := "k" + strconv.Itoa(n)
		out, err := k.Begin(ctx, "chaos", key)
		require.NoError(t, err, "%s at the end", key)
		require.True(t, out.Replayed, "%s at the end: %+v; want its stored result", key, out)
		var last int64
		for _, g := range grants[key] {
			last = max(last, g.token)
		}
		assert.Equal(t, strconv.FormatInt(out.Token, 10), string(out.Value), "%s: the stored result is its completer's", key)
		assert.Equal(t, last, out.Token, "%s: the stored result is the last holder's", key)
	}
	t.Logf("lease chaos: %d pauses past the lease, %d completions accepted, %d stale completions refused, %d stale completions accepted",
		paused, completed, staleRefused, staleAccepted)
	require.Zero(t, staleAccepted, "stale completions accepted")
	require.Positive(t, staleRefused, "no completion was ever stale: the chaos did not happen")
}

// TestRestartWithAOF: with appendonly yes and appendfsync always, records
// survive a restart of Redis: completed ones replay without running the
// operation again, a pending one is still in progress, a released one is
// claimed again with a higher token.
func TestRestartWithAOF(t *testing.T) {
	srv := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	c := srv.Client(t)
	k := clusterKeeper(t, c, []Option{WithPrefix("aof:")}, WithLease(time.Minute), WithRetention(time.Hour))
	ctx := context.Background()
	var runs atomic.Int32
	fn := func(i int) func(context.Context) (int, error) {
		return func(context.Context) (int, error) { runs.Add(1); return i * i, nil }
	}
	const n = 50
	for i := 0; i < n; i++ {
		_, err := Do(ctx, k, "aof", strconv.Itoa(i), fn(i))
		require.NoError(t, err)
	}
	pending, err := k.Begin(ctx, "aof", "pending")
	require.NoError(t, err)
	require.NotNil(t, pending.Claim)
	released, err := k.Begin(ctx, "aof", "released")
	require.NoError(t, err)
	require.NotNil(t, released.Claim)
	require.NoError(t, released.Claim.Release(ctx))

	srv.Restart(t)

	for i := 0; i < n; i++ {
		v, err := Do(ctx, k, "aof", strconv.Itoa(i), fn(i))
		require.NoError(t, err, "Do %d after the restart", i)
		require.Equal(t, i*i, v, "Do %d after the restart", i)
	}
	require.EqualValues(t, n, runs.Load(), "operations ran again: the restart lost results")
	_, err = k.Begin(ctx, "aof", "pending")
	require.ErrorIs(t, err, ErrInProgress, "pending record after the restart")
	require.NoError(t, pending.Claim.Complete(ctx, []byte("done"), 0), "the holder completes after the restart")
	again, err := k.Begin(ctx, "aof", "released")
	require.NoError(t, err, "released record after the restart")
	require.NotNil(t, again.Claim, "released record after the restart: %+v", again)
	assert.Greater(t, again.Token, released.Token)
	assert.Equal(t, 2, again.Claim.Attempt())
}

// lateClaims is a redisStore whose claim answers come back only after late
// has run: a reply held up (a slow network, a resend after a lost reply, a
// paused process) while the lease goes on running in Redis.
type lateClaims struct {
	*redisStore
	late func()
}

func (s *lateClaims) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	r, err := s.redisStore.Claim(ctx, id, req)
	s.late()
	return r, err
}

func (s *lateClaims) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	r := s.redisStore.ClaimBatch(ctx, req)
	s.late()
	return r
}

func lateKeeper(t *testing.T, b *redistest.Backend, key string) (*Keeper, **Claim) {
	rs, err := openRedisStore(b.Client)
	require.NoError(t, err)
	var other *Claim
	s := &lateClaims{redisStore: rs, late: func() { other = takeOver(t, b, "s", key) }}
	k, err := keeperOn(s, WithLease(300*time.Millisecond), WithRetention(time.Minute))
	require.NoError(t, err)
	return k, &other
}

// TestDoDoesNotRunALateClaimTakenOver: the single-key reference of
// TestConsumeDoesNotRunALateClaimTakenOver (consume_run_lease_test.go).
func TestDoDoesNotRunALateClaimTakenOver(t *testing.T) {
	b := redistest.Real(t)
	k, other := lateKeeper(t, b, "single")
	var ran atomic.Bool
	_, err := Do(context.Background(), k, "s", "single", func(ctx context.Context) (int, error) { ran.Store(true); return 1, nil })
	assert.ErrorIs(t, err, ErrLeaseLost)
	assert.False(t, ran.Load(), "Do ran a function whose claim was taken over before its answer came")
	require.NotNil(t, *other)
}
