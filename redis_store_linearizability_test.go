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

	"github.com/anishathalye/porcupine"
	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The sequential model of one record, for porcupine. It has no expiry: the
// lease is long (a minute) so that it never runs out within a history, or,
// in TestLinearizabilityOutlivesCaller, renewed for as long as the
// operation runs. Takeover after a lease is proven by the takeover tests,
// not here.

type linOpKind uint8

const (
	linClaim linOpKind = iota
	linComplete
	linRelease
	linExtend
)

// linInput is one call on the store.
type linInput struct {
	kind    linOpKind
	fp      string // claim
	attempt string // claim
	token   int64  // complete, release, extend
	value   string // complete
}

// linOutput is what the call answered. unknown: the call failed with an error
// other than ErrLeaseLost, so it may or may not have taken effect.
type linOutput struct {
	unknown bool
	// claim
	status    claimStatus
	token     int64
	attempt   int
	recovered bool
	value     string
	// complete, release, extend
	leaseLost bool
}

// linState is the record: absent ('A'), pending ('P'), completed ('C') or
// released ('R'). token is -1 for a pending record made by a claim whose
// answer was lost: its token is unknown but above maxToken.
type linState struct {
	st       byte
	token    int64
	attempt  string
	fp       string
	n        int
	value    string
	maxToken int64
}

// linStep gives the states the record may be in after in answered out. With
// retriedRelease, a Release that answered ErrLeaseLost may have released the
// record all the same: its first run released it, the reply was lost,
// another claim took the record, and go-redis's retry of the Release found
// the new holder (see TestLinearizability).
func linStep(s linState, in linInput, out linOutput, retriedRelease bool) []any {
	var next []linState
	if retriedRelease && in.kind == linRelease && out.leaseLost && s.st == 'P' && s.token == in.token {
		next = append(next, linOutcomes(s, in)[0].state)
	}
	if out.unknown {
		next = append(next, s) // it did not happen
		for _, o := range linOutcomes(s, in) {
			next = append(next, o.state)
		}
	} else {
		for _, o := range linOutcomes(s, in) {
			if o.matches(out) {
				next = append(next, o.state)
			}
		}
	}
	res := make([]any, len(next))
	for i, n := range next {
		res[i] = n
	}
	return res
}

// linOutcome is one way the record may answer a call, with the state after.
type linOutcome struct {
	state linState
	out   linOutput
	// anyNewToken: the claim hands out a fresh token, any value above
	// state.maxToken before the call; state.token is then set from out.
	anyNewToken bool
}

func (o *linOutcome) matches(out linOutput) bool {
	if o.anyNewToken {
		if out.status != statusClaimed || out.token <= o.state.maxToken || out.attempt != o.out.attempt || out.recovered {
			return false
		}
		o.state.token, o.state.maxToken = out.token, out.token
		return true
	}
	return o.out == out
}

// linOutcomes lists the outcomes of in on s (a deterministic record gives
// one; a fresh claim's token is only known from the answer).
func linOutcomes(s linState, in linInput) []linOutcome {
	lost := linOutcome{state: s, out: linOutput{leaseLost: true}}
	ok := linOutcome{state: s, out: linOutput{}}
	switch in.kind {
	case linClaim:
		if s.st != 'A' && s.st != 'R' && s.fp != in.fp {
			return []linOutcome{{state: s, out: linOutput{status: statusMismatch}}}
		}
		switch s.st {
		case 'C':
			return []linOutcome{{state: s, out: linOutput{status: statusCompleted, token: s.token, attempt: s.n, value: s.value}}}
		case 'P':
			if s.attempt != in.attempt {
				return []linOutcome{{state: s, out: linOutput{status: statusInProgress}}}
			}
			if s.token == -1 {
				o := linOutcome{state: s, out: linOutput{attempt: s.n}, anyNewToken: true}
				return []linOutcome{o}
			}
			return []linOutcome{{state: s, out: linOutput{status: statusClaimed, token: s.token, attempt: s.n}}}
		}
		n := 1
		if s.st == 'R' {
			n = s.n + 1
		}
		ns := linState{st: 'P', token: -1, attempt: in.attempt, fp: in.fp, n: n, maxToken: s.maxToken}
		return []linOutcome{{state: ns, out: linOutput{attempt: n}, anyNewToken: true}}
	case linComplete:
		if s.token != in.token || s.st == 'A' || s.st == 'R' {
			return []linOutcome{lost}
		}
		if s.st == 'C' {
			return []linOutcome{ok}
		}
		ns := s
		ns.st, ns.value, ns.attempt = 'C', in.value, ""
		return []linOutcome{{state: ns}}
	case linRelease:
		if s.token != in.token || s.st == 'A' || s.st == 'C' {
			return []linOutcome{lost}
		}
		if s.st == 'R' {
			return []linOutcome{ok}
		}
		ns := s
		ns.st, ns.attempt, ns.fp = 'R', "", ""
		return []linOutcome{{state: ns}}
	case linExtend:
		if s.token != in.token || s.st != 'P' {
			return []linOutcome{lost}
		}
		return []linOutcome{ok}
	}
	return nil
}

// linModel is the record as the store documents it; linModelStrict also
// takes ErrLeaseLost from Release to mean that nothing was written.
var (
	linModel       = linNewModel(true)
	linModelStrict = linNewModel(false)
)

func linNewModel(retriedRelease bool) porcupine.Model {
	return (&porcupine.NondeterministicModel{
		Init: func() []any { return []any{linState{st: 'A'}} },
		Step: func(state, input, output any) []any {
			return linStep(state.(linState), input.(linInput), output.(linOutput), retriedRelease)
		},
		Equal: func(a, b any) bool { return a.(linState) == b.(linState) },
		DescribeOperation: func(input, output any) string {
			return fmt.Sprintf("%+v -> %+v", input, output)
		},
	}).ToModel()
}

// linUnknownReturn is the return time of a call whose outcome is unknown: it
// may take effect at any time after it was made.
const linUnknownReturn = int64(1) << 62

// linRun runs one history of clients × calls on the record id and returns it.
func linRun(ctx context.Context, s recordStore, id string, seed uint64, clients, calls int) []porcupine.Operation {
	var (
		mu   sync.Mutex
		ops  []porcupine.Operation
		wg   sync.WaitGroup
		base = time.Now()
	)
	start := make(chan struct{})
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, uint64(c)))
			var attempt string
			var token int64 = 1 // a token no claim ever hands out: stale
			<-start
			for i := 0; i < calls; i++ {
				var in linInput
				switch x := r.IntN(10); {
				case x < 4:
					if attempt == "" || r.IntN(3) > 0 {
						attempt = newAttemptID()
					}
					in = linInput{kind: linClaim, fp: "A", attempt: attempt}
					if r.IntN(10) == 0 {
						in.fp = "B"
					}
				case x < 7:
					in = linInput{kind: linComplete, token: token, value: fmt.Sprintf("c%d-%d", c, i)}
				case x < 8:
					in = linInput{kind: linRelease, token: token}
				default:
					in = linInput{kind: linExtend, token: token}
				}
				call := time.Since(base).Nanoseconds()
				var out linOutput
				var err error
				switch in.kind {
				case linClaim:
					var rep claimReply
					rep, err = s.Claim(ctx, id, claimRequest{Fingerprint: in.fp, Attempt: in.attempt, Lease: time.Minute, Keep: time.Minute})
					out = linOutput{status: rep.Status, token: rep.Token, attempt: rep.Attempt, recovered: rep.Recovered, value: string(rep.Value)}
					if err == nil && rep.Status == statusClaimed {
						token = rep.Token
					}
				case linComplete:
					err = errOf(s.Complete(ctx, id, in.token, []byte(in.value), time.Minute))
				case linRelease:
					err = s.Release(ctx, id, in.token, time.Minute)
				case linExtend:
					err = s.Extend(ctx, id, in.token, time.Minute, time.Minute)
				}
				ret := time.Since(base).Nanoseconds()
				switch {
				case err == nil:
				case errors.Is(err, ErrLeaseLost):
					out = linOutput{leaseLost: true}
				default:
					out, ret = linOutput{unknown: true}, linUnknownReturn
				}
				mu.Lock()
				ops = append(ops, porcupine.Operation{ClientId: c, Input: in, Call: call, Output: out, Return: ret})
				mu.Unlock()
			}
		}()
	}
	close(start)
	wg.Wait()
	return ops
}

// TestLinearizability records histories of concurrent Claim, Complete,
// Release and Extend calls on one record, through a fault proxy that drops
// replies after execution and cuts connections while go-redis retries, and
// checks each with porcupine against the sequential model of a record.
func TestLinearizability(t *testing.T) {
	srv := redistest.Start(t)
	p := newFaultProxy(t, srv.Addr, 42)
	p.Set(faultproxy.Faults{DropReply: 0.05, Cut: 0.03})
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 4 * time.Millisecond})
	defer c.Close()
	s, err := openRedisStore(c, WithPrefix("lin:"))
	require.NoError(t, err)
	ctx := context.Background()
	histories := 200
	if testing.Short() {
		histories = 50
	}
	var tally linTally
	for h := 0; h < histories; h++ {
		tally.check(t, h, linRun(ctx, s, recordID("lin", strconv.Itoa(h)), uint64(h), 3, 6))
	}
	tally.report(t, p)
}

// linTally sums up the checks of histories.
type linTally struct {
	histories, ops, unknown, violations, undecided, retriedReleases int
}

// check checks one history with porcupine, and fails t if it is not
// linearizable (or porcupine cannot tell within 10 seconds).
func (s *linTally) check(t *testing.T, h int, history []porcupine.Operation) {
	t.Helper()
	s.histories++
	s.ops += len(history)
	for _, op := range history {
		if op.Output.(linOutput).unknown {
			s.unknown++
		}
	}
	switch porcupine.CheckOperationsTimeout(linModel, history, 10*time.Second) {
	case porcupine.Illegal:
		s.violations++
		if s.violations <= 3 {
			assert.Failf(t, "violation", "history %d is not linearizable:\n%s", h, linDescribe(history))
		}
	case porcupine.Unknown:
		s.undecided++
	case porcupine.Ok:
		if porcupine.CheckOperationsTimeout(linModelStrict, history, 10*time.Second) == porcupine.Illegal {
			s.retriedReleases++
		}
	}
}

func (s *linTally) report(t *testing.T, p *faultproxy.Proxy) {
	t.Helper()
	t.Logf("linearizability: %d histories, %d calls (%d with unknown outcome), %d violations, %d undecided, %d linearizable only because a retried Release answered ErrLeaseLost after releasing; proxy %+v",
		s.histories, s.ops, s.unknown, s.violations, s.undecided, s.retriedReleases, p.Stats())
	require.Zero(t, s.violations+s.undecided, "%d of %d histories not linearizable, %d undecided", s.violations, s.histories, s.undecided)
}

// linRecorder is a store that passes every call on and records it as an
// operation of a porcupine history, whatever made it: Begin, Do, Complete,
// Release, Extend, or KeepAlive's renewals. The client of an operation is
// the linClientKey of the call's context.
type linRecorder struct {
	recordStore
	base time.Time
	mu   sync.Mutex
	ops  []porcupine.Operation
}

type linClientKey struct{}

func newLinRecorder(s recordStore) *linRecorder {
	return &linRecorder{recordStore: s, base: time.Now()}
}

func (r *linRecorder) since() int64 { return time.Since(r.base).Nanoseconds() }

// add records a call made at call that answered out and err.
func (r *linRecorder) add(ctx context.Context, in linInput, call int64, out linOutput, err error) {
	op := linOperation(ctx, in, call, r.since(), out, err)
	r.mu.Lock()
	r.ops = append(r.ops, op)
	r.mu.Unlock()
}

// linOperation is the operation of a call made at call that returned at ret,
// answering out and err, by the client ctx names: ErrLeaseLost is an
// answer; any other error leaves the outcome unknown.
func linOperation(ctx context.Context, in linInput, call, ret int64, out linOutput, err error) porcupine.Operation {
	switch {
	case err == nil:
	case errors.Is(err, ErrLeaseLost):
		out = linOutput{leaseLost: true}
	default:
		out, ret = linOutput{unknown: true}, linUnknownReturn
	}
	client, _ := ctx.Value(linClientKey{}).(int)
	return porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret}
}

func (r *linRecorder) history() []porcupine.Operation {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.ops)
}

func (r *linRecorder) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	call := r.since()
	rep, err := r.recordStore.Claim(ctx, id, req)
	r.add(ctx, linInput{kind: linClaim, fp: req.Fingerprint, attempt: req.Attempt}, call,
		linOutput{status: rep.Status, token: rep.Token, attempt: rep.Attempt, recovered: rep.Recovered, value: string(rep.Value)}, err)
	return rep, err
}

func (r *linRecorder) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (bool, error) {
	call := r.since()
	stored, err := r.recordStore.Complete(ctx, id, token, value, keep)
	r.add(ctx, linInput{kind: linComplete, token: token, value: string(value)}, call, linOutput{}, err)
	return stored, err
}

func (r *linRecorder) Release(ctx context.Context, id string, token int64, keep time.Duration) error {
	call := r.since()
	err := r.recordStore.Release(ctx, id, token, keep)
	r.add(ctx, linInput{kind: linRelease, token: token}, call, linOutput{}, err)
	return err
}

func (r *linRecorder) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	call := r.since()
	err := r.recordStore.Extend(ctx, id, token, lease, keep)
	r.add(ctx, linInput{kind: linExtend, token: token}, call, linOutput{}, err)
	return err
}

// linGone is how the caller of one Keeper call goes away in
// TestLinearizabilityCallerGone.
type linGone int

const (
	linStays        linGone = iota // the caller stays
	linGoneAsSent                  // it goes as the store call starts: nothing is sent
	linGoneAnswered                // it goes once the store answered, before idem reads the answer
	linGoneFails                   // it goes as the store call fails on a reset connection
	linGoneTimer                   // a timer ends it at a random point of the call
	linOutlived                    // it had gone; the call is made on context.WithoutCancel of its context
	linGoneModes
)

// TestLinearizabilityCallerGone records histories of Begin, Complete,
// Release and Extend, made through a Keeper, on one record, through the
// fault proxy of TestLinearizability, with callers that go away at random
// points of their calls: as the command is sent, once Redis answered but
// before idem read the answer, as the call fails, at a random moment, or
// before a call that an operation makes on context.WithoutCancel after its
// caller left. Every store call the Keeper makes is recorded and each history
// is checked against the model of a record. Every answer is typed; a caller
// that went away before the answer was read gets its cancellation, never
// ErrUnavailable; a call made on context.WithoutCancel never answers with a
// cancellation.
func TestLinearizabilityCallerGone(t *testing.T) {
	srv := redistest.Start(t)
	p := newFaultProxy(t, srv.Addr, 43)
	p.Set(faultproxy.Faults{DropReply: 0.05, Cut: 0.03})
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 4 * time.Millisecond})
	defer c.Close()
	s, err := openRedisStore(c, WithPrefix("lingone:"))
	require.NoError(t, err)
	histories := 150
	if testing.Short() {
		histories = 40
	}
	var (
		tally   linTally
		mu      sync.Mutex
		answers = map[string]int{}
		fired   = map[linGone]int{}
	)
	for h := 0; h < histories; h++ {
		rec := newLinRecorder(s)
		k, err := keeperOn(goneStore{rec}, WithLease(time.Minute), WithRetention(time.Minute))
		require.NoError(t, err)
		key := strconv.Itoa(h)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for cl := 0; cl < 3; cl++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(uint64(h), uint64(cl)))
				var held *Claim
				<-start
				for i := 0; i < 8; i++ {
					mode := linStays
					if x := r.IntN(10); x >= 4 {
						mode = linGone(1 + r.IntN(int(linGoneModes)-1))
					}
					ctx, g := linGoneContext(mode, r)
					ctx = context.WithValue(ctx, linClientKey{}, cl)
					var err error
					switch x := r.IntN(10); {
					case held == nil || x < 4:
						fp := "A"
						if r.IntN(10) == 0 {
							fp = "B"
						}
						var out Outcome
						out, err = k.Begin(ctx, "lin", key, WithFingerprint([]byte(fp)))
						if err == nil && out.Claim != nil {
							held = out.Claim
						}
					case x < 7:
						err = held.Complete(ctx, []byte(fmt.Sprintf("c%d-%d", cl, i)), time.Minute)
					case x < 8:
						err = held.Release(ctx)
					default:
						err = held.Extend(ctx)
					}
					g.cancel()
					kind := errKind(err)
					wentBefore := g.fired.Load() && (mode == linGoneAsSent || mode == linGoneFails)
					mu.Lock()
					answers[kind]++
					if g.fired.Load() {
						fired[mode]++
					}
					mu.Unlock()
					switch {
					case !slices.Contains([]string{"", "in progress", "mismatch", "lease lost", "unavailable", "canceled"}, kind):
						assert.Failf(t, "violation", "history %d, client %d, mode %d: %s error: %v", h, cl, mode, kind, err)
					case wentBefore && !isGoneErr(err):
						assert.Failf(t, "violation", "history %d, client %d: the caller went away as its call was sent, and got %v; want its cancellation", h, cl, err)
					case mode == linGoneAnswered && g.fired.Load() && errors.Is(err, ErrUnavailable):
						assert.Failf(t, "violation", "history %d, client %d: the caller went away before idem read the answer, and got ErrUnavailable: %v", h, cl, err)
					case (mode == linStays || mode == linOutlived) && isGoneErr(err) && err != nil:
						assert.Failf(t, "violation", "history %d, client %d, mode %d: a call whose context did not end answered %v", h, cl, mode, err)
					}
				}
			}()
		}
		close(start)
		wg.Wait()
		tally.check(t, h, rec.history())
	}
	t.Logf("answers: %s; callers gone: %v", sortedCounts(answers), fired)
	for mode := linGoneAsSent; mode <= linGoneFails; mode++ {
		assert.Positive(t, fired[mode], "mode %d never happened", mode)
	}
	tally.report(t, p)
}

// linGoneContext returns the context of a call in mode, and its callerGone.
func linGoneContext(mode linGone, r *rand.Rand) (context.Context, *callerGone) {
	bg := context.Background()
	switch mode {
	case linGoneAsSent:
		return withCallerGone(bg, goneBeforeStore, goneOnAny)
	case linGoneAnswered:
		return withCallerGone(bg, goneAfterStore, goneOnAny)
	case linGoneFails:
		return withCallerGone(bg, goneStoreFails, goneOnAny)
	}
	ctx, g := withCallerGone(bg, 0, goneOnAny)
	switch mode {
	case linGoneTimer:
		time.AfterFunc(time.Duration(r.Int64N(int64(500*time.Microsecond))), g.cancel)
	case linOutlived:
		g.cancel()
		return context.WithoutCancel(ctx), g
	}
	return ctx, g
}

// TestLinearizabilityOutlivesCaller records histories of Do on one record,
// through a fault proxy, from callers that go away while their operation
// runs: the operation outlives its caller by two to three leases (it goes on
// after its context was cancelled, on context.WithoutCancel, then returns a
// value), or gives up, while the other callers ask for the key every quarter
// of a lease. Every store call is recorded, the renewals of KeepAlive
// included. The model of a record has no expiry: a claim that took the
// record over from a holder that was still renewing (Recovered) is not
// linearizable. So each history checks that renewals kept the lease for as
// long as the operation ran, whatever its caller did, besides a counter of
// live runs (never above one) and that every caller that got a result got
// the same one.
//
// go-redis retries up to ten times here, so that no call's outcome stays
// unknown: an orphaned claim, never renewed, would expire and be taken
// over, which the model (without expiry) cannot tell from a bug.
func TestLinearizabilityOutlivesCaller(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	p := newFaultProxy(t, srv.Addr, 44)
	p.Set(faultproxy.Faults{DropReply: 0.05, Cut: 0.03})
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetries: 10, MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 4 * time.Millisecond, PoolSize: 64})
	defer c.Close()
	s, err := openRedisStore(c, WithPrefix("linout:"))
	require.NoError(t, err)
	const lease = faultLease
	histories := 10
	if testing.Short() {
		histories = 4
	}
	type result struct {
		rec      *linRecorder
		overlaps int32
		values   map[string]int
		outlived int
	}
	results := make([]result, histories)
	var wg sync.WaitGroup
	for h := range results {
		res := &results[h]
		res.rec = newLinRecorder(s)
		res.values = map[string]int{}
		k, err := keeperOn(goneStore{res.rec}, WithLease(lease), WithRetention(time.Minute))
		require.NoError(t, err)
		var live, overlaps, runs atomic.Int32
		var mu sync.Mutex
		var hw sync.WaitGroup
		for cl := 0; cl < 3; cl++ {
			hw.Add(1)
			go func() {
				defer hw.Done()
				r := rand.New(rand.NewPCG(uint64(h), uint64(cl)+100))
				for try := 0; try < 100; try++ {
					mode := r.IntN(8)
					var ctx context.Context
					var g *callerGone
					switch mode {
					case 6:
						ctx, g = withCallerGone(context.Background(), goneBeforeStore, goneOnClaim)
					case 7:
						ctx, g = withCallerGone(context.Background(), goneAfterStore, goneOnClaim)
					default:
						ctx, g = withCallerGone(context.Background(), 0, goneOnAny)
					}
					ctx = context.WithValue(ctx, linClientKey{}, cl)
					v, err := Do(ctx, k, "lin", "k"+strconv.Itoa(h), func(opCtx context.Context) (string, error) {
						if live.Add(1) > 1 {
							overlaps.Add(1)
						}
						defer live.Add(-1)
						if runs.Add(1) == 1 {
							mode = 3 // every history has one
						}
						switch mode {
						case 3, 4: // the caller leaves, the operation goes on
							g.cancel()
							<-opCtx.Done()
							mu.Lock()
							res.outlived++
							mu.Unlock()
							time.Sleep(2*lease + time.Duration(r.Int64N(int64(lease))))
						case 5: // the caller leaves, the operation gives up
							g.cancel()
							<-opCtx.Done()
							return "", opCtx.Err()
						default:
							time.Sleep(time.Duration(r.Int64N(int64(2 * time.Millisecond))))
						}
						return fmt.Sprintf("c%d-%d", cl, try), nil
					}, WithFingerprint([]byte("A")))
					g.cancel()
					if kind := errKind(err); !slices.Contains([]string{"", "in progress", "canceled"}, kind) {
						assert.Failf(t, "violation", "history %d, client %d: %s error: %v", h, cl, kind, err)
					}
					if err == nil {
						mu.Lock()
						res.values[v]++
						mu.Unlock()
						return
					}
					time.Sleep(lease/5 + time.Duration(r.Int64N(int64(lease/10))))
				}
				assert.Failf(t, "violation", "history %d, client %d never got a result", h, cl)
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			hw.Wait()
			res.overlaps = overlaps.Load()
		}()
	}
	wg.Wait()
	var tally linTally
	outlived := 0
	for h, res := range results {
		assert.Zero(t, res.overlaps, "history %d: the operation ran twice at once", h)
		assert.Len(t, res.values, 1, "history %d: callers got different results: %v", h, res.values)
		outlived += res.outlived
		tally.check(t, h, res.rec.history())
	}
	assert.Positive(t, outlived, "no operation outlived its caller")
	t.Logf("%d operations outlived their caller by two to three leases", outlived)
	tally.report(t, p)
}

func linDescribe(history []porcupine.Operation) string {
	var b []byte
	for _, op := range history {
		b = fmt.Appendf(b, "  client %d [%d, %d] %+v -> %+v\n", op.ClientId, op.Call, op.Return, op.Input, op.Output)
	}
	return string(b)
}

// TestLinearizabilityModelRejects makes sure the model is not vacuous: it
// refuses histories that break the contract.
func TestLinearizabilityModelRejects(t *testing.T) {
	claim := func(attempt string) linInput { return linInput{kind: linClaim, fp: "A", attempt: attempt} }
	claimed := func(tok int64, n int) linOutput { return linOutput{status: statusClaimed, token: tok, attempt: n} }
	op := func(c int, in linInput, out linOutput, call, ret int64) porcupine.Operation {
		return porcupine.Operation{ClientId: c, Input: in, Output: out, Call: call, Return: ret}
	}
	cases := map[string][]porcupine.Operation{
		"two holders at once": {
			op(0, claim("a"), claimed(10, 1), 0, 1),
			op(1, claim("b"), claimed(11, 1), 2, 3),
		},
		"token reused after release": {
			op(0, claim("a"), claimed(10, 1), 0, 1),
			op(0, linInput{kind: linRelease, token: 10}, linOutput{}, 2, 3),
			op(1, claim("b"), claimed(10, 2), 4, 5),
		},
		"stale completion accepted": {
			op(0, claim("a"), claimed(10, 1), 0, 1),
			op(0, linInput{kind: linRelease, token: 10}, linOutput{}, 2, 3),
			op(1, claim("b"), claimed(11, 2), 4, 5),
			op(0, linInput{kind: linComplete, token: 10, value: "x"}, linOutput{}, 6, 7),
		},
		"replay of another value": {
			op(0, claim("a"), claimed(10, 1), 0, 1),
			op(0, linInput{kind: linComplete, token: 10, value: "x"}, linOutput{}, 2, 3),
			op(1, claim("b"), linOutput{status: statusCompleted, token: 10, attempt: 1, value: "y"}, 4, 5),
		},
		"taken over while its holder renews": {
			op(0, claim("a"), claimed(10, 1), 0, 1),
			op(0, linInput{kind: linExtend, token: 10}, linOutput{}, 2, 3),
			op(1, claim("b"), linOutput{status: statusClaimed, token: 11, attempt: 2, recovered: true}, 4, 5),
		},
		"not seen after completion": {
			op(0, claim("a"), claimed(10, 1), 0, 1),
			op(0, linInput{kind: linComplete, token: 10, value: "x"}, linOutput{}, 2, 3),
			op(1, claim("b"), claimed(11, 2), 4, 5),
		},
	}
	for name, h := range cases {
		if porcupine.CheckOperations(linModel, h) || porcupine.CheckOperations(linModelStrict, h) {
			assert.Failf(t, "violation", "%s: the model accepts it", name)
		}
	}
	ok := []porcupine.Operation{
		op(0, claim("a"), claimed(10, 1), 0, 1),
		op(1, claim("b"), linOutput{status: statusInProgress}, 2, 3),
		op(0, linInput{kind: linComplete, token: 10, value: "x"}, linOutput{unknown: true}, 4, linUnknownReturn),
		op(1, claim("b"), linOutput{status: statusCompleted, token: 10, attempt: 1, value: "x"}, 5, 6),
	}
	if !porcupine.CheckOperations(linModel, ok) || !porcupine.CheckOperations(linModelStrict, ok) {
		assert.Fail(t, "the model refuses a linearizable history")
	}
	// A Release whose reply was lost, retried after another claim took the
	// record: it released, yet answers ErrLeaseLost.
	retried := []porcupine.Operation{
		op(0, claim("a"), claimed(10, 1), 0, 1),
		op(0, linInput{kind: linRelease, token: 10}, linOutput{leaseLost: true}, 2, 7),
		op(1, claim("b"), claimed(11, 2), 3, 4),
	}
	if !porcupine.CheckOperations(linModel, retried) || porcupine.CheckOperations(linModelStrict, retried) {
		assert.Fail(t, "the retried Release is not told apart")
	}
}
