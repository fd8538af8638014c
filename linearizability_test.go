package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// The sequential model of one record, for porcupine. The lease is long (a
// minute) so that it never runs out within a history: takeover after a lease
// is proven by the takeover tests, not here.

type linOpKind uint8

const (
	linClaim linOpKind = iota
	linComplete
	linRelease
	linExtend
)

// linInput is one call on the Store.
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
	status    ClaimStatus
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
		if out.status != StatusClaimed || out.token <= o.state.maxToken || out.attempt != o.out.attempt || out.recovered {
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
			return []linOutcome{{state: s, out: linOutput{status: StatusMismatch}}}
		}
		switch s.st {
		case 'C':
			return []linOutcome{{state: s, out: linOutput{status: StatusCompleted, token: s.token, attempt: s.n, value: s.value}}}
		case 'P':
			if s.attempt != in.attempt {
				return []linOutcome{{state: s, out: linOutput{status: StatusInProgress}}}
			}
			if s.token == -1 {
				o := linOutcome{state: s, out: linOutput{attempt: s.n}, anyNewToken: true}
				return []linOutcome{o}
			}
			return []linOutcome{{state: s, out: linOutput{status: StatusClaimed, token: s.token, attempt: s.n}}}
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

// linModel is the record as the Store documents it; linModelStrict also
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
func linRun(ctx context.Context, s Store, id string, seed uint64, clients, calls int) []porcupine.Operation {
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
					var rep ClaimReply
					rep, err = s.Claim(ctx, id, ClaimRequest{Fingerprint: in.fp, Attempt: in.attempt, Lease: time.Minute, Keep: time.Minute})
					out = linOutput{status: rep.Status, token: rep.Token, attempt: rep.Attempt, recovered: rep.Recovered, value: string(rep.Value)}
					if err == nil && rep.Status == StatusClaimed {
						token = rep.Token
					}
				case linComplete:
					err = s.Complete(ctx, id, in.token, []byte(in.value), time.Minute)
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
	p, err := faultproxy.New(srv.Addr, 42)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.Set(faultproxy.Faults{DropReply: 0.05, Cut: 0.03})
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 4 * time.Millisecond})
	defer c.Close()
	s, err := NewRedisStore(c, WithPrefix("lin:"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	histories := 200
	if testing.Short() {
		histories = 50
	}
	var violations, undecided, ops, unknown, retriedReleases int
	for h := 0; h < histories; h++ {
		history := linRun(ctx, s, recordID("lin", strconv.Itoa(h)), uint64(h), 3, 6)
		ops += len(history)
		for _, op := range history {
			if op.Output.(linOutput).unknown {
				unknown++
			}
		}
		switch porcupine.CheckOperationsTimeout(linModel, history, 10*time.Second) {
		case porcupine.Illegal:
			violations++
			if violations <= 3 {
				t.Errorf("history %d is not linearizable:\n%s", h, linDescribe(history))
			}
		case porcupine.Unknown:
			undecided++
		case porcupine.Ok:
			if porcupine.CheckOperationsTimeout(linModelStrict, history, 10*time.Second) == porcupine.Illegal {
				retriedReleases++
			}
		}
	}
	t.Logf("linearizability: %d histories, %d calls (%d with unknown outcome), %d violations, %d undecided, %d linearizable only because a retried Release answered ErrLeaseLost after releasing; proxy %+v",
		histories, ops, unknown, violations, undecided, retriedReleases, p.Stats())
	if violations != 0 || undecided != 0 {
		t.Fatalf("%d of %d histories not linearizable, %d undecided", violations, histories, undecided)
	}
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
	claimed := func(tok int64, n int) linOutput { return linOutput{status: StatusClaimed, token: tok, attempt: n} }
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
			op(1, claim("b"), linOutput{status: StatusCompleted, token: 10, attempt: 1, value: "y"}, 4, 5),
		},
		"not seen after completion": {
			op(0, claim("a"), claimed(10, 1), 0, 1),
			op(0, linInput{kind: linComplete, token: 10, value: "x"}, linOutput{}, 2, 3),
			op(1, claim("b"), claimed(11, 2), 4, 5),
		},
	}
	for name, h := range cases {
		if porcupine.CheckOperations(linModel, h) || porcupine.CheckOperations(linModelStrict, h) {
			t.Errorf("%s: the model accepts it", name)
		}
	}
	ok := []porcupine.Operation{
		op(0, claim("a"), claimed(10, 1), 0, 1),
		op(1, claim("b"), linOutput{status: StatusInProgress}, 2, 3),
		op(0, linInput{kind: linComplete, token: 10, value: "x"}, linOutput{unknown: true}, 4, linUnknownReturn),
		op(1, claim("b"), linOutput{status: StatusCompleted, token: 10, attempt: 1, value: "x"}, 5, 6),
	}
	if !porcupine.CheckOperations(linModel, ok) || !porcupine.CheckOperations(linModelStrict, ok) {
		t.Error("the model refuses a linearizable history")
	}
	// A Release whose reply was lost, retried after another claim took the
	// record: it released, yet answers ErrLeaseLost.
	retried := []porcupine.Operation{
		op(0, claim("a"), claimed(10, 1), 0, 1),
		op(0, linInput{kind: linRelease, token: 10}, linOutput{leaseLost: true}, 2, 7),
		op(1, claim("b"), claimed(11, 2), 3, 4),
	}
	if !porcupine.CheckOperations(linModel, retried) || porcupine.CheckOperations(linModelStrict, retried) {
		t.Error("the retried Release is not told apart")
	}
}
