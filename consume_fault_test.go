package idem

// Consume and the batch calls (BeginBatch with and without compact claims,
// CompleteBatch, ReleaseBatch, ExtendBatch) under the faults a consumer
// meets: claims answered after their lease ran out, replies lost and sent
// again, a node whose replies never come, a Redis that fails then heals, a
// full Redis (OOM) and a read-only one. Several consumers and a batch worker
// race for the same messages, as a broker that redelivers whatever was not
// acknowledged would make them, and every answer is checked against the
// promises of the contract:
//
//   - never two live runs of a key: a handler starts while another holder's
//     handler of the key runs with its lease alive by its own process's
//     clock; and a handler whose key another holder took over has its
//     context cancelled (within a bound, not a margin);
//   - fencing tokens strictly increase from run to run of a key;
//   - no stale completion accepted: a completion by a token lower than one
//     the store had handed out for the record before it was sent never
//     succeeds, and the answer stored for a key is that of the highest token
//     handed out for it, with the value that holder stored;
//   - ErrLeaseLost from a completion means nothing was written;
//   - every error is typed;
//   - nothing acknowledged that did not take effect: MessageHandled only for
//     a message whose handler succeeded in that call, MessageReplayed only
//     for a key whose handler succeeded before; no run of a key after it was
//     acknowledged;
//   - no message lost: once the faults stop, every message is acknowledged
//     within a bounded number of redeliveries.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
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

// cfStore is what a Keeper uses of a redisStore: its store. The wrappers
// below embed one and change some of its steps.
type cfStore = recordStore

// overrunBound bounds how long a handler whose key another holder took over
// may go on with its context live: its lease had run out by its process's
// clock before the other holder could claim the key, so the Keeper's watch
// cancels it at once, or its next renewal finds the lease lost, within a
// third of a lease. A bound, not a margin: a busy machine meets it by far,
// a Keeper that never cancels never does.
const overrunBound = 10 * time.Second

// errFlaky is a handler's transient failure: the message is released and
// runs again.
var errFlaky = errors.New("downstream failed")

// typedErr reports whether err is nil or one of the errors the contract
// names for a claim, a settlement or a message, or one of own (the
// handler's own errors, which Consume hands back).
func typedErr(err error, own ...error) bool {
	if err == nil {
		return true
	}
	var final *FinalError
	for _, want := range append([]error{ErrUnavailable, ErrLeaseLost, ErrInProgress, ErrMismatch, ErrCorrupt,
		ErrResultExpired, ErrDuplicate, context.Canceled, context.DeadlineExceeded}, own...) {
		if errors.Is(err, want) {
			return true
		}
	}
	return errors.As(err, &final)
}

// cfKind names an error for the tallies.
func cfKind(err error) string {
	var final *FinalError
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, ErrLeaseLost):
		return "lease lost"
	case errors.Is(err, ErrUnavailable):
		return "unavailable"
	case errors.Is(err, ErrInProgress):
		return "in progress"
	case errors.Is(err, ErrDuplicate):
		return "duplicate"
	case errors.Is(err, ErrResultExpired):
		return "result expired"
	case errors.Is(err, ErrMismatch):
		return "mismatch"
	case errors.Is(err, ErrCorrupt):
		return "corrupt"
	case errors.Is(err, errFlaky):
		return "handler failed"
	case errors.As(err, &final):
		return "final"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "canceled"
	}
	return "untyped"
}

// msgRun is one run of a handler for a key.
type msgRun struct {
	key   string
	token int64
	claim *Claim
	ctx   context.Context
	// batch is set for a run of the batch worker, whose work no context
	// stops: a pause past its lease is the worker's own, and what matters
	// is that its completion is then refused.
	batch bool
	// overrun is set when another holder of the key started while this
	// run's context was live and its lease had run out by this process's
	// clock: its context must end within overrunBound.
	overrun bool
	by      int64 // the token of that holder
}

// msgLedger follows the runs of handlers and the acknowledgements per key.
type msgLedger struct {
	mu        sync.Mutex
	live      map[string][]*msgRun
	lastTok   map[string]int64
	succeeded map[string]bool
	acked     map[string]string // how the key was first acknowledged
	runs      int
	successes int
	// overruns counts holders that started while the previous holder's
	// handler was still live, past its lease, before its context was
	// cancelled; staleBatch, batch runs that started after a newer holder.
	overruns, staleBatch int
	tally                map[string]int
	violations           []string
	nViolations          int
	// bound is overrunBound, or shorter in the ledger's own test.
	bound time.Duration
}

func newMsgLedger() *msgLedger {
	return &msgLedger{live: map[string][]*msgRun{}, lastTok: map[string]int64{}, succeeded: map[string]bool{},
		acked: map[string]string{}, tally: map[string]int{}, bound: overrunBound}
}

// violate records a violation; l.mu is held.
func (l *msgLedger) violate(format string, args ...any) {
	l.nViolations++
	if len(l.violations) < 40 {
		l.violations = append(l.violations, fmt.Sprintf(format, args...))
	}
}

func (l *msgLedger) violation(format string, args ...any) {
	l.mu.Lock()
	l.violate(format, args...)
	l.mu.Unlock()
}

func (l *msgLedger) count(what string) {
	l.mu.Lock()
	l.tally[what]++
	l.mu.Unlock()
}

// begin is called by a handler of key as it starts, with its context.
func (l *msgLedger) begin(ctx context.Context, key string, batch bool) *msgRun {
	c, ok := ClaimFromContext(ctx)
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	run := &msgRun{key: key, claim: c, ctx: ctx, batch: batch}
	l.runs++
	if !ok {
		l.violate("%s: the handler's context carries no claim", key)
		return run
	}
	run.token = c.Token()
	if how, done := l.acked[key]; done {
		l.violate("%s: a handler ran (token %d) after the message was acknowledged (%s)", key, run.token, how)
	}
	switch last := l.lastTok[key]; {
	case run.token == last:
		l.violate("%s: token %d handed to two runs", key, run.token)
	case run.token < last:
		// A newer holder started first: this run's claim was taken over
		// before its handler began. Its lease had run out by this
		// process's clock (the newer claim came after it ended in Redis,
		// which never ends before the process's view of it).
		if now.Before(c.localLeaseEnd()) {
			l.violate("%s: a handler with token %d started after one with token %d, its lease alive by its process's clock", key, run.token, last)
		}
		if batch {
			l.staleBatch++
		} else {
			run.overrun, run.by = true, last
		}
	default:
		l.lastTok[key] = run.token
	}
	for _, other := range l.live[key] {
		if other.token == run.token {
			continue // reported above
		}
		alive := other.batch || other.ctx.Err() == nil
		if !alive {
			continue
		}
		if other.claim != nil && now.Before(other.claim.localLeaseEnd()) {
			l.violate("%s: two live runs: token %d started while token %d runs with its lease alive by its process's clock (%s left)",
				key, run.token, other.token, other.claim.localLeaseEnd().Sub(now).Round(time.Millisecond))
			continue
		}
		if !other.batch && !other.overrun {
			other.overrun, other.by = true, run.token
		}
	}
	l.live[key] = append(l.live[key], run)
	return run
}

// end is called by a handler as it returns, after waitCancelled: success
// says whether it returned nil or a Final error.
func (l *msgLedger) end(run *msgRun, success bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.live[run.key] = slices.DeleteFunc(l.live[run.key], func(r *msgRun) bool { return r == run })
	if success {
		l.succeeded[run.key] = true
		l.successes++
	}
}

// waitCancelled holds a handler whose key another holder took over, with its
// context still live, until its context ends, for at most overrunBound.
func (l *msgLedger) waitCancelled(run *msgRun) {
	l.mu.Lock()
	over, by := run.overrun, run.by
	l.mu.Unlock()
	if !over || run.ctx.Err() != nil {
		return
	}
	l.count("overrun")
	t := time.NewTimer(l.bound)
	defer t.Stop()
	select {
	case <-run.ctx.Done():
	case <-t.C:
		l.violation("%s: the handler with token %d still runs, its context live, %s after token %d took its key over",
			run.key, run.token, l.bound, by)
	}
}

// acknowledged records that key was acknowledged (how: the status), and
// checks that it took effect: ranOK says whether its handler succeeded in
// the call that acknowledged it.
func (l *msgLedger) acknowledged(key, how string, ranOK bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch how {
	case "handled", "completed":
		if !ranOK {
			l.violate("%s acknowledged (%s) although its handler did not succeed in that call", key, how)
		}
	default:
		if !l.succeeded[key] {
			l.violate("%s acknowledged (%s) although no handler of it ever succeeded", key, how)
		}
	}
	if _, ok := l.acked[key]; !ok {
		l.acked[key] = how
	}
}

func (l *msgLedger) isAcked(key string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.acked[key]
	return ok
}

// check fails t with every violation recorded.
func (l *msgLedger) check(t *testing.T, context string) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, v := range l.violations {
		assert.Fail(t, "violation", "%s: %s", context, v)
	}
	if l.nViolations > len(l.violations) {
		assert.Failf(t, "violation", "%s: %d violations in all", context, l.nViolations)
	}
}

// fenceBook follows, per record, the fencing tokens the store handed out
// and what each token's completions sent and were answered.
type fenceBook struct {
	mu      sync.Mutex
	highest map[string]int64
	sent    map[overlapPair][]byte // the envelope a token's completion sent, by (id, token)
	answers map[overlapPair][]string
	// stale lists the completions accepted for a token below one the store
	// had handed out before they were sent.
	stale    []string
	claims   int
	markers  int // claims answered from a marker
	accepted int
}

func newFenceBook() *fenceBook {
	return &fenceBook{highest: map[string]int64{}, sent: map[overlapPair][]byte{}, answers: map[overlapPair][]string{}}
}

func (b *fenceBook) claimed(id string, r claimReply, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err != nil {
		return
	}
	b.claims++
	if r.Marker {
		b.markers++
	}
	if r.Status == statusClaimed {
		b.highest[id] = max(b.highest[id], r.Token)
	}
}

func (b *fenceBook) top(id string) int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.highest[id]
}

// completed records a completion of id by token, sent when the highest token
// handed out was before, and its answer.
func (b *fenceBook) completed(id string, token, before int64, value []byte, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	p := overlapPair{id, token}
	if _, ok := markerUntil(value); ok {
		value = emptyBytes // a marker's empty result, kept in a record: replayed as empty
	}
	b.sent[p] = value
	b.answers[p] = append(b.answers[p], cfKind(err))
	if err == nil && before > token {
		b.stale = append(b.stale, fmt.Sprintf("record %s: completion by token %d accepted after the store handed out token %d", id, token, before))
	}
	if err == nil {
		b.accepted++
	}
}

// expect records what a completion by token of id sends for a handler that
// returned err (nil or Final), unless the store recorded it already: what
// Consume stores, for a Keeper on a store the book does not see.
func (b *fenceBook) expect(id string, token int64, err error) {
	env := emptyBytes
	var final *FinalError
	if errors.As(err, &final) {
		env = seal(sealFinal(final))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if p := (overlapPair{id, token}); b.sent[p] == nil {
		b.sent[p] = env
	}
}

// answered records how a Keeper answered the settlement of a run.
func (b *fenceBook) answered(p overlapPair, kind string) {
	b.mu.Lock()
	b.answers[p] = append(b.answers[p], kind)
	b.mu.Unlock()
}

// fencedBatches is a store that records in book the claims it answers and
// the completions it passes on.
type fencedBatches struct {
	cfStore
	book *fenceBook
}

func (s *fencedBatches) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	r, err := s.cfStore.Claim(ctx, id, req)
	s.book.claimed(id, r, err)
	return r, err
}

func (s *fencedBatches) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	out := s.cfStore.ClaimBatch(ctx, req)
	for j, r := range out {
		s.book.claimed(req.IDs[j], r.Reply, r.Err)
	}
	return out
}

func (s *fencedBatches) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (bool, error) {
	before := s.book.top(id)
	stored, err := s.cfStore.Complete(ctx, id, token, value, keep)
	s.book.completed(id, token, before, value, err)
	return stored, err
}

func (s *fencedBatches) SettleBatch(ctx context.Context, items []batchCompletion, release []claimFence, keep time.Duration) (done, given []error) {
	before := make([]int64, len(items))
	for j, it := range items {
		before[j] = s.book.top(it.ID)
	}
	done, given = s.cfStore.SettleBatch(ctx, items, release, keep)
	for j, it := range items {
		s.book.completed(it.ID, it.Token, before[j], it.Value, done[j])
	}
	return done, given
}

// lateBatches is a store whose claim answers, while on, sometimes come back
// late: held for a while after Redis answered, as a slow node holding up a
// batch, a resend after a lost reply or a paused process would.
type lateBatches struct {
	cfStore
	on       atomic.Bool
	mu       sync.Mutex
	rnd      *rand.Rand
	p        float64
	min, max time.Duration
	held     atomic.Int64
}

func (s *lateBatches) delay() {
	if !s.on.Load() {
		return
	}
	s.mu.Lock()
	late := s.rnd.Float64() < s.p
	d := s.min + time.Duration(s.rnd.Int64N(int64(s.max-s.min)))
	s.mu.Unlock()
	if late {
		s.held.Add(1)
		time.Sleep(d)
	}
}

func (s *lateBatches) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	r, err := s.cfStore.Claim(ctx, id, req)
	s.delay()
	return r, err
}

func (s *lateBatches) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	r := s.cfStore.ClaimBatch(ctx, req)
	s.delay()
	return r
}

// switchStore sends every call to the master, or, while toReplica is set,
// to a read-only replica of it: a client that reaches a replica (a
// failover under way, a wrong address).
type switchStore struct {
	master, replica cfStore
	toReplica       atomic.Bool
}

func (s *switchStore) cur() cfStore {
	if s.toReplica.Load() {
		return s.replica
	}
	return s.master
}

func (s *switchStore) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	return s.cur().Claim(ctx, id, req)
}

func (s *switchStore) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (bool, error) {
	return s.cur().Complete(ctx, id, token, value, keep)
}

func (s *switchStore) Release(ctx context.Context, id string, token int64, keep time.Duration) error {
	return s.cur().Release(ctx, id, token, keep)
}

func (s *switchStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	return s.cur().Extend(ctx, id, token, lease, keep)
}

func (s *switchStore) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	return s.cur().ClaimBatch(ctx, req)
}

func (s *switchStore) SettleBatch(ctx context.Context, items []batchCompletion, release []claimFence, keep time.Duration) (done, given []error) {
	return s.cur().SettleBatch(ctx, items, release, keep)
}

func (s *switchStore) ExtendBatch(ctx context.Context, claims []claimFence, lease, keep time.Duration) []error {
	return s.cur().ExtendBatch(ctx, claims, lease, keep)
}

func (s *switchStore) Checkpoint(ctx context.Context, claim claimFence, name string, value []byte, keep time.Duration) error {
	return s.cur().Checkpoint(ctx, claim, name, value, keep)
}

func (s *switchStore) Inspect(ctx context.Context, id string) (Record, error) {
	return s.cur().Inspect(ctx, id)
}

func (s *switchStore) Forget(ctx context.Context, id string, token int64, force bool) (Record, error) {
	return s.cur().Forget(ctx, id, token, force)
}

func (s *switchStore) Abandon(ctx context.Context, id string, token int64) (Record, error) {
	return s.cur().Abandon(ctx, id, token)
}

// errLostReply is what scriptFaults answers for a script whose reply it
// drops after Redis ran it, as go-redis does once every retry lost its
// reply.
var errLostReply = errors.New("read tcp 127.0.0.1:6379: i/o timeout")

// scriptFaults is a go-redis hook that, while on, sends every script call
// twice (go-redis sending again a command whose reply was lost: the first
// run's answer is thrown away) and, with the chance lost, drops the reply of
// one after Redis ran it (every retry lost: the caller sees a network
// error, the script took effect).
type scriptFaults struct {
	on     atomic.Bool
	resend bool
	lost   float64
	mu     sync.Mutex
	rnd    *rand.Rand

	resent, dropped atomic.Int64
}

func newScriptFaults(seed uint64, resend bool, lost float64) *scriptFaults {
	return &scriptFaults{resend: resend, lost: lost, rnd: rand.New(rand.NewPCG(seed, 77))}
}

func isScriptCmd(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "eval", "evalsha":
		return true
	}
	return false
}

func (h *scriptFaults) lose() bool {
	if h.lost == 0 {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.rnd.Float64() < h.lost
}

// DialHook implements redis.Hook.
func (h *scriptFaults) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (h *scriptFaults) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !h.on.Load() || !isScriptCmd(cmd) {
			return next(ctx, cmd)
		}
		if h.resend {
			_ = next(ctx, cmd)
			h.resent.Add(1)
		}
		err := next(ctx, cmd)
		if err == nil && h.lose() {
			h.dropped.Add(1)
			cmd.SetErr(errLostReply)
			return errLostReply
		}
		return err
	}
}

// ProcessPipelineHook implements redis.Hook.
func (h *scriptFaults) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if !h.on.Load() || !slices.ContainsFunc(cmds, isScriptCmd) {
			return next(ctx, cmds)
		}
		if h.resend {
			_ = next(ctx, cmds)
			h.resent.Add(1)
		}
		err := next(ctx, cmds)
		if err == nil && h.lose() {
			h.dropped.Add(1)
			for _, c := range cmds {
				c.SetErr(errLostReply)
			}
			return errLostReply
		}
		return err
	}
}

// cfEnv is one run of a fault scenario: a Redis, the path to it with its
// faults, the Keepers of the workers and the books.
type cfEnv struct {
	t       *testing.T
	sc      cfScenario
	seed    uint64
	lease   time.Duration
	markers bool
	prefix  string
	backend string // "redis" or "miniredis"

	srv     *redistest.Server // nil on miniredis
	mini    *redistest.Backend
	admin   redis.UniversalClient // straight to the server: no faults
	proxy   *faultproxy.Proxy     // nil on a Cluster
	faulty  redis.UniversalClient
	hooks   *scriptFaults
	late    *lateBatches
	swtch   *switchStore
	replica *redistest.Server

	book *fenceBook
	led  *msgLedger
	// top is the store stack the workers' Keepers use; clean, the stack on
	// admin (no faults) that the drain uses: both record in book. bare is
	// the redisStore under top, on the faulty path, or nil when the
	// scenario's faults are in the wrappers.
	top, clean cfStore
	bare       *redisStore
	keys       []string
}

// cfScenario is a fault and how it is put in and healed.
type cfScenario struct {
	name string
	// lease of the Keepers; serverArgs for redis-server.
	lease      time.Duration
	serverArgs []string
	// mini: the scenario also runs on miniredis (whose clock stands still:
	// no lease runs out while the faults last).
	mini bool
	// window: the faults last that long, while the workers go on; 0: for
	// the whole fault phase.
	window time.Duration
	// replica: the env has a read-only replica of the server (swtch).
	replica bool
	// setup, if set, prepares the env; on puts the faults in, off takes
	// them out.
	setup   func(e *cfEnv)
	on, off func(e *cfEnv)
	// proxied: the workers reach Redis through the fault proxy, with the
	// fault client's short timeouts.
	proxied bool
	// wrap, if set, is put on top of the workers' store stack.
	wrap func(e *cfEnv, s cfStore) cfStore
	// body, if set, picks what the handler of each message does (see
	// pickBody).
	body func(r *rand.Rand) string
}

// cfScenarios are the faults of the suites:
//
//   - late answers: three claims in ten are answered half a lease to 1.3
//     leases after Redis ran them, while the other workers redeliver the
//     same messages;
//   - lost replies: every script is sent twice (the first answer thrown
//     away, as when go-redis resends a command whose reply was lost), 3% of
//     replies are dropped after Redis ran the script (every retry lost),
//     and the proxy drops replies, cuts requests and delays replies past the
//     read timeout;
//   - hung node: for one and a half leases, requests reach Redis and run,
//     and no reply comes back: every call waits out the client's timeouts;
//   - fails then heals: for a lease, every request is cut before Redis sees
//     it;
//   - OOM: for a lease, maxmemory is below what Redis uses, under
//     noeviction: every write is refused, reads are not;
//   - READONLY: for a lease, every call reaches a read-only replica.
func cfScenarios() []cfScenario {
	return []cfScenario{
		{
			name: "late answers", lease: 600 * time.Millisecond, proxied: false,
			on:  func(e *cfEnv) { e.late.on.Store(true) },
			off: func(e *cfEnv) { e.late.on.Store(false) },
		},
		{
			name: "lost replies", lease: faultLease, proxied: true, mini: true,
			on: func(e *cfEnv) {
				e.hooks.on.Store(true)
				e.setProxy(faultproxy.Faults{DropReply: 0.08, Cut: 0.04, Delay: 3 * faultReadTimeout, Slow: 0.03})
			},
			off: func(e *cfEnv) { e.hooks.on.Store(false); e.setProxy(faultproxy.Faults{}) },
		},
		{
			name: "hung node", lease: faultLease, proxied: true, window: faultLease * 3 / 2,
			// Requests reach Redis and run; their replies never come back.
			on:  func(e *cfEnv) { e.proxy.Set(faultproxy.Faults{Delay: time.Hour}) },
			off: func(e *cfEnv) { e.proxy.Set(faultproxy.Faults{}); e.proxy.CutAll() },
		},
		{
			name: "fails then heals", lease: faultLease, proxied: true, mini: true, window: faultLease,
			// Every request is cut before Redis sees it.
			on:  func(e *cfEnv) { e.proxy.Set(faultproxy.Faults{Cut: 1}); e.proxy.CutAll() },
			off: func(e *cfEnv) { e.proxy.Set(faultproxy.Faults{}) },
		},
		{
			name: "OOM", lease: faultLease, proxied: false, window: faultLease,
			serverArgs: []string{"--maxmemory-policy", "noeviction"},
			setup: func(e *cfEnv) {
				ctx := context.Background()
				filler := strings.Repeat("x", 4096)
				for i := 0; i < 300; i++ {
					require.NoError(e.t, e.admin.Set(ctx, fmt.Sprintf("filler-%d", i), filler, 0).Err())
				}
			},
			on: func(e *cfEnv) {
				require.NoError(e.t, e.admin.ConfigSet(context.Background(), "maxmemory", "1mb").Err())
				require.ErrorContains(e.t, e.admin.Set(context.Background(), "probe", "x", 0).Err(), "OOM")
			},
			off: func(e *cfEnv) { require.NoError(e.t, e.admin.ConfigSet(context.Background(), "maxmemory", "0").Err()) },
		},
		{
			name: "READONLY", lease: faultLease, proxied: false, window: faultLease, replica: true,
			on:  func(e *cfEnv) { e.swtch.toReplica.Store(true) },
			off: func(e *cfEnv) { e.swtch.toReplica.Store(false) },
		},
	}
}

// cfSize is how much a run does: keys, and rounds per worker.
type cfSize struct{ keys, rounds int }

// runFaultScenario runs sc once on backend ("redis", "miniredis" or
// "cluster", a 3-master Cluster, where only the faults of hooks and
// wrappers apply), with markers on or WithoutMarkers, and returns its env:
// its ledger holds the violations.
func runFaultScenario(t *testing.T, sc cfScenario, backend string, markers bool, seed uint64, size cfSize) *cfEnv {
	return runFaultScenarioOn(t, sc, backend, nil, markers, seed, size)
}

// runFaultScenarioOn is runFaultScenario, on cl for backend "cluster".
func runFaultScenarioOn(t *testing.T, sc cfScenario, backend string, cl *redistest.Cluster, markers bool, seed uint64, size cfSize) *cfEnv {
	e := &cfEnv{t: t, sc: sc, seed: seed, lease: sc.lease, markers: markers, backend: backend, book: newFenceBook(), led: newMsgLedger()}
	e.prefix = "cf" + strconv.FormatUint(seed, 10) + ":"
	var storeOpts, keeperOpts []Option
	storeOpts = append(storeOpts, WithPrefix(e.prefix))
	// Keys placed by their own digests, whatever the backend: the books
	// name records by RecordID, and the Keepers on wrapped stores (which
	// take no store's default) must place keys as the one on the clean
	// store does.
	keeperOpts = append(keeperOpts, WithLease(e.lease), WithRetention(time.Minute), WithScopeShards(0))
	if !markers {
		storeOpts = append(storeOpts, WithoutMarkers())
		keeperOpts = append(keeperOpts, WithoutMarkers())
	}
	e.hooks = newScriptFaults(seed, true, 0.03)
	var addr string
	switch backend {
	case "cluster":
		e.admin = cl.Client(t, nil)
		faulty := cl.Client(t, nil)
		faulty.AddHook(e.hooks)
		e.faulty = faulty
	case "miniredis":
		e.mini = redistest.Miniredis(t)
		e.admin = e.mini.Client
		addr = e.mini.Mini.Addr()
	default:
		e.srv = redistest.Start(t, sc.serverArgs...)
		e.admin = e.srv.Client(t)
		addr = e.srv.Addr
	}
	if backend != "cluster" {
		e.proxy = newFaultProxy(t, addr, seed)
		var client *redis.Client
		if sc.proxied {
			client = newFaultClient(t, e.proxy.Addr())
		} else {
			client = redistest.NewClient(t, addr)
		}
		client.AddHook(e.hooks)
		e.faulty = client
	}
	inner, err := openRedisStore(e.faulty, storeOpts...)
	require.NoError(t, err)
	var base cfStore = inner
	if sc.replica {
		e.replica = redistest.StartReplica(t, addr)
		rs, err := openRedisStore(e.replica.Client(t), storeOpts...)
		require.NoError(t, err)
		e.swtch = &switchStore{master: inner, replica: rs}
		base = e.swtch
	}
	if !sc.replica && sc.wrap == nil {
		e.bare = inner
	}
	fenced := &fencedBatches{cfStore: base, book: e.book}
	e.late = &lateBatches{cfStore: fenced, rnd: rand.New(rand.NewPCG(seed, 5)), p: 0.3, min: e.lease / 2, max: e.lease * 13 / 10}
	e.top = e.late
	if sc.wrap != nil {
		e.top = sc.wrap(e, e.top)
	}
	cleanInner, err := openRedisStore(e.admin, storeOpts...)
	require.NoError(t, err)
	e.clean = &fencedBatches{cfStore: cleanInner, book: e.book}
	if sc.setup != nil {
		sc.setup(e)
	}
	for i := 0; i < size.keys; i++ {
		e.keys = append(e.keys, "m"+strconv.Itoa(i))
	}

	newK := func(s recordStore) *Keeper {
		k, err := keeperOn(s, keeperOpts...)
		require.NoError(t, err)
		return k
	}
	// The fault phase: two consumers and a batch worker, each a Keeper of
	// its own (a process of its own), race for the keys while the faults
	// are in; a window's faults go in after the first rounds and out a
	// window later, while the workers go on.
	var phaseOver atomic.Bool
	var roundsDone atomic.Int64
	workers := 3
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// The first consumer's Keeper is on the redisStore itself, so
			// that Consume takes the paths it takes only there (its
			// completions and releases in one pipeline); the others' are
			// on the wrappers, which see every claim and completion.
			k := newK(e.top)
			if w == 0 && e.bare != nil {
				k = newK(e.bare)
			}
			r := rand.New(rand.NewPCG(seed, uint64(w)))
			for round := 0; round < 20*size.rounds && (round < size.rounds || !phaseOver.Load()); round++ {
				if w == workers-1 {
					e.batchRound(k, r, markers && round%2 == 0)
				} else {
					e.consumeRound(k, r)
				}
				roundsDone.Add(1)
			}
		}()
	}
	if sc.window == 0 {
		sc.on(e)
		phaseOver.Store(true)
		wg.Wait()
		sc.off(e)
	} else {
		for roundsDone.Load() < int64(workers) { // a round each first, without faults
			time.Sleep(5 * time.Millisecond)
		}
		sc.on(e)
		time.Sleep(sc.window)
		sc.off(e)
		phaseOver.Store(true)
		wg.Wait()
	}

	// The faults are out: a healthy consumer redelivers what was not
	// acknowledged until everything is; a message held by a claim that
	// its consumer could not settle waits for that lease to run out.
	drain := newK(e.clean)
	rounds := 0
	for ; rounds < 20; rounds++ {
		var left []msg
		for _, key := range e.keys {
			if !e.led.isAcked(key) {
				left = append(left, msg{ID: key, Body: "ok"})
			}
		}
		if len(left) == 0 {
			break
		}
		if rounds > 0 {
			if e.mini != nil {
				e.mini.Advance(e.lease)
			} else {
				time.Sleep(e.lease / 2)
			}
		}
		e.consume(drain, left, 1)
	}
	for _, key := range e.keys {
		if !e.led.isAcked(key) {
			e.led.violation("%s: never acknowledged, %d redeliveries after the faults stopped", key, rounds)
		}
	}
	e.verifyStored()

	e.report(t, e.name(sc), rounds)
	return e
}

func (e *cfEnv) name(sc cfScenario) string {
	return fmt.Sprintf("%s, %s, markers %v, seed %d", sc.name, e.backend, e.markers, e.seed)
}

// pickBody picks what the handler of a message does, which its Body says:
// "ok" returns at once, "slow" works for half a lease (its lease must be
// renewed), "fail" fails (released), "final" fails for good (a Final error
// is stored).
func (e *cfEnv) pickBody(r *rand.Rand) string {
	switch x := r.IntN(100); {
	case x < 6:
		return "slow"
	case x < 12:
		return "fail"
	case x < 16:
		return "final"
	}
	return "ok"
}

// pick returns the keys of a batch: mostly messages not yet acknowledged,
// some acknowledged ones (redelivered), some repeated.
func (e *cfEnv) pick(r *rand.Rand, n int) []string {
	var open []string
	for _, key := range e.keys {
		if !e.led.isAcked(key) {
			open = append(open, key)
		}
	}
	out := make([]string, 0, n)
	for len(out) < n {
		switch x := r.IntN(10); {
		case x == 0 && len(out) > 0:
			out = append(out, out[r.IntN(len(out))])
		case x < 3 || len(open) == 0:
			out = append(out, e.keys[r.IntN(len(e.keys))])
		default:
			out = append(out, open[r.IntN(len(open))])
		}
	}
	return out
}

func (e *cfEnv) consumeRound(k *Keeper, r *rand.Rand) {
	keys := e.pick(r, 6+r.IntN(8))
	batch := make([]msg, len(keys))
	for i, key := range keys {
		if e.sc.body != nil {
			batch[i] = msg{ID: key, Body: e.sc.body(r)}
		} else {
			batch[i] = msg{ID: key, Body: e.pickBody(r)}
		}
	}
	e.consume(k, batch, 1+r.IntN(3))
}

// work is a handler's work for body: it waits on its context, and reports
// whether the handler succeeds.
func (e *cfEnv) work(ctx context.Context, body string) error {
	d := time.Duration(rand.IntN(2000)) * time.Microsecond
	if body == "slow" {
		d = e.lease / 2
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
	}
	switch body {
	case "fail":
		return errFlaky
	case "final":
		return Final(errors.New("declined"))
	}
	return nil
}

// consume runs one Consume of batch with n handlers at once, and checks
// every answer.
func (e *cfEnv) consume(k *Keeper, batch []msg, n int) {
	var mu sync.Mutex
	ok := map[string]bool{}   // the keys whose handler succeeded in this call
	tok := map[string]int64{} // the token of each key's run in this call
	handle := func(ctx context.Context, m msg) error {
		run := e.led.begin(ctx, m.ID, false)
		err := e.work(ctx, m.Body)
		e.led.waitCancelled(run)
		success := storesOutcome(err)
		e.led.end(run, success)
		if success {
			e.book.expect(recordID(cfScope, m.ID), run.token, err)
		}
		mu.Lock()
		ok[m.ID], tok[m.ID] = success, run.token
		mu.Unlock()
		return err
	}
	res, err := Consume(context.Background(), k, cfScope, batch, msgID, handle, WithConcurrency(n))
	if err != nil && !unreachableAnswer(res, err) {
		e.led.violation("Consume: %v", err)
		return
	}
	mu.Lock()
	defer mu.Unlock()
	for i, r := range res {
		key := batch[i].ID
		e.led.count("consume " + r.Status.String() + ": " + cfKind(r.Err))
		if !typedErr(r.Err, errFlaky) {
			e.led.violation("%s: Consume answered %s with an untyped error: %v", key, r.Status, r.Err)
		}
		switch r.Status {
		case MessageRejected:
			e.led.violation("%s: rejected (%v): a fault is never a poison message", key, r.Err)
		case MessageHandled:
			if !r.Ran || !r.Ack {
				e.led.violation("%s: handled with Ran %v, Ack %v", key, r.Ran, r.Ack)
			}
		case MessageReplayed:
			if r.Ran || !r.Ack {
				e.led.violation("%s: replayed with Ran %v, Ack %v", key, r.Ran, r.Ack)
			}
		case MessageRetry:
			if r.Ack {
				e.led.violation("%s: retry acknowledged", key)
			}
		}
		if r.Ack && r.Status != MessageDuplicate {
			e.led.acknowledged(key, r.Status.String(), ok[key])
		}
		if r.Ran && ok[key] {
			// What the settlement of this run answered, as Consume tells.
			p := overlapPair{recordID(cfScope, key), tok[key]}
			switch {
			case r.Status == MessageHandled:
				e.book.answered(p, "ok")
			case errors.Is(r.Err, ErrLeaseLost) || errors.Is(r.Err, ErrUnavailable):
				e.book.answered(p, cfKind(r.Err))
			}
		}
	}
}

// batchRound claims a batch with BeginBatch (compactly if compact), runs the
// work of each claim, renews the leases once with ExtendBatch, then settles:
// CompleteBatch for the work that succeeded (a value, or nothing, which a
// compact claim keeps as a marker), ReleaseBatch for the rest.
func (e *cfEnv) batchRound(k *Keeper, r *rand.Rand, compact bool) {
	ctx := context.Background()
	keys := e.pick(r, 4+r.IntN(8))
	var opts []Option
	if compact {
		opts = append(opts, withCompactClaims())
	}
	res, err := k.batchBegin(ctx, cfScope, keys, opts...)
	if err != nil {
		e.led.violation("BeginBatch: %v", err)
		return
	}
	var held []*Claim
	var heldKeys []string
	for i, br := range res {
		e.led.count("begin batch: " + cfKind(br.Err))
		if !typedErr(br.Err) {
			e.led.violation("%s: BeginBatch answered an untyped error: %v", keys[i], br.Err)
		}
		switch {
		case br.Err != nil:
			if errors.Is(br.Err, ErrMismatch) || errors.Is(br.Err, ErrCorrupt) {
				e.led.violation("%s: BeginBatch answered %v under faults", keys[i], br.Err)
			}
		case br.Outcome.Replayed:
			e.led.acknowledged(keys[i], "replayed", false)
		case br.Outcome.Claim != nil:
			held = append(held, br.Outcome.Claim)
			heldKeys = append(heldKeys, keys[i])
		}
	}
	var items []completion
	var itemKeys []string
	var give []*Claim
	for j, c := range held {
		// The worker honours its lease: it renews a claim with less than
		// half of it left before its work, and gives up one it cannot.
		if time.Until(c.localLeaseEnd()) < e.lease/2 {
			if err := k.extendClaims(ctx, []*Claim{c})[0]; err != nil {
				if !typedErr(err) {
					e.led.violation("%s: ExtendBatch answered an untyped error: %v", heldKeys[j], err)
				}
				give = append(give, c)
				continue
			}
		}
		run := e.led.begin(contextWithClaim(ctx, c), heldKeys[j], true)
		failed := r.IntN(10) == 0
		time.Sleep(time.Duration(r.IntN(1500)) * time.Microsecond)
		e.led.end(run, !failed)
		if failed {
			give = append(give, c)
			continue
		}
		var v []byte
		if r.IntN(2) == 0 {
			v = []byte("v:" + heldKeys[j] + ":" + strconv.FormatInt(c.Token(), 10))
		}
		items = append(items, completion{Claim: c, Value: v})
		itemKeys = append(itemKeys, heldKeys[j])
	}
	if len(items) > 0 {
		renew := make([]*Claim, len(items))
		for j, it := range items {
			renew[j] = it.Claim
		}
		for j, err := range k.extendClaims(ctx, renew) {
			e.led.count("extend batch: " + cfKind(err))
			if !typedErr(err) {
				e.led.violation("%s: ExtendBatch answered an untyped error: %v", itemKeys[j], err)
			}
		}
		for j, err := range k.completeClaims(ctx, items) {
			e.led.count("complete batch: " + cfKind(err))
			if !typedErr(err) {
				e.led.violation("%s: CompleteBatch answered an untyped error: %v", itemKeys[j], err)
			}
			if err == nil {
				e.led.acknowledged(itemKeys[j], "completed", true)
			}
		}
	}
	if len(give) > 0 {
		for _, err := range k.releaseClaims(ctx, give) {
			e.led.count("release batch: " + cfKind(err))
			if !typedErr(err) {
				e.led.violation("ReleaseBatch answered an untyped error: %v", err)
			}
		}
	}
}

// verifyStored checks, once every message was acknowledged, that the answer
// stored for each key is that of the highest token handed out for it, with
// the value that token's holder sent, and that no completion answered
// ErrLeaseLost took effect.
func (e *cfEnv) verifyStored() {
	ctx := context.Background()
	for _, key := range e.keys {
		id := recordID(cfScope, key)
		r, err := e.clean.Claim(ctx, id, claimRequest{Attempt: newAttemptID(), Lease: e.lease, Keep: e.lease + time.Minute, Retention: time.Minute, MarkerRetention: time.Minute})
		if err != nil || r.Status != statusCompleted {
			e.led.violation("%s after the run: status %d, %v; want its stored answer", key, r.Status, err)
			continue
		}
		e.led.mu.Lock()
		ran := e.led.lastTok[key] // the runs of the bare Keeper, which the book does not see
		e.led.mu.Unlock()
		e.book.mu.Lock()
		top := max(e.book.highest[id], ran)
		p := overlapPair{id, r.Token}
		sent, answers := e.book.sent[p], e.book.answers[p]
		e.book.mu.Unlock()
		if r.Token != top {
			e.led.violation("%s: the stored answer is by token %d; the highest handed out is %d", key, r.Token, top)
		}
		if sent == nil {
			e.led.violation("%s: the stored answer is by token %d, whose holder never sent a completion", key, r.Token)
		} else if !bytes.Equal(sent, r.Value) {
			e.led.violation("%s: the stored answer %q is not what token %d sent, %q", key, r.Value, r.Token, sent)
		}
		if len(answers) > 0 && !slices.ContainsFunc(answers, func(a string) bool { return a != "lease lost" }) {
			e.led.violation("%s: the completion by token %d (%q) was answered ErrLeaseLost %d time(s), yet it is the stored answer: ErrLeaseLost must mean that nothing was written", key, r.Token, sent, len(answers))
		}
	}
	e.book.mu.Lock()
	defer e.book.mu.Unlock()
	for _, s := range e.book.stale {
		e.led.violation("stale completion accepted: %s", s)
	}
}

// setProxy sets the proxy's faults, if there is a proxy.
func (e *cfEnv) setProxy(f faultproxy.Faults) {
	if e.proxy != nil {
		e.proxy.Set(f)
	}
}

func (e *cfEnv) proxyStats() string {
	if e.proxy == nil {
		return "none"
	}
	return fmt.Sprintf("%+v", e.proxy.Stats())
}

func (e *cfEnv) report(t *testing.T, name string, rounds int) {
	e.led.mu.Lock()
	defer e.led.mu.Unlock()
	e.book.mu.Lock()
	defer e.book.mu.Unlock()
	t.Logf("%s: %d keys, %d runs (%d succeeded), %d claims answered (%d from markers), %d completions accepted; %d holders started beside a handler not yet cancelled past its lease, %d batch runs after a newer holder; %d redelivery rounds to drain; answers: %s; proxy %+v; scripts sent twice %d, replies dropped %d; claims answered late %d",
		name, len(e.keys), e.led.runs, e.led.successes, e.book.claims, e.book.markers, e.book.accepted, e.led.tally["overrun"], e.led.staleBatch, rounds,
		sortedCounts(e.led.tally), e.proxyStats(), e.hooks.resent.Load(), e.hooks.dropped.Load(), e.late.held.Load())
}

// cfScope is the scope of the fault suites' messages.
const cfScope = "cf"

// TestConsumeFaults runs every fault scenario, with markers on and
// WithoutMarkers, on a redis-server and, where the scenario makes sense
// without a moving clock, on miniredis. Each run has a server of its own;
// the scenarios run two at a time.
func TestConsumeFaults(t *testing.T) {
	redistest.Long(t)
	size := cfSize{keys: 24, rounds: 6}
	for i, sc := range cfScenarios() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			for _, markers := range []bool{true, false} {
				seed := uint64(100*i) + map[bool]uint64{true: 1, false: 2}[markers]
				t.Run(map[bool]string{true: "markers", false: "records"}[markers], func(t *testing.T) {
					e := runFaultScenario(t, sc, "redis", markers, seed, size)
					e.led.check(t, e.name(sc))
					if sc.mini {
						e := runFaultScenario(t, sc, "miniredis", markers, seed+50, size)
						e.led.check(t, e.name(sc))
					}
				})
			}
		})
	}
}

// TestMsgLedgerCatches makes sure the checks of the fault suites are not
// vacuous: the ledger and the fence book flag what breaks the contract, and
// nothing in a history that keeps it.
func TestMsgLedgerCatches(t *testing.T) {
	now := time.Now()
	claim := func(token int64, leaseLeft time.Duration) context.Context {
		return contextWithClaim(context.Background(), &Claim{token: token, leaseEnd: now.Add(leaseLeft)})
	}
	cases := map[string]func(l *msgLedger){
		"two live runs": func(l *msgLedger) {
			l.begin(claim(10, time.Minute), "k", false)
			l.begin(claim(11, time.Minute), "k", false)
		},
		"two live runs of a batch worker": func(l *msgLedger) {
			l.begin(claim(10, time.Minute), "k", true)
			l.begin(claim(11, time.Minute), "k", true)
		},
		"a stale run starts on a live lease": func(l *msgLedger) {
			l.begin(claim(11, time.Minute), "k", false)
			l.begin(claim(10, time.Minute), "k", false)
		},
		"a token handed out twice": func(l *msgLedger) {
			l.end(l.begin(claim(10, time.Minute), "k", false), false)
			l.begin(claim(10, time.Minute), "k", false)
		},
		"a run after the acknowledgement": func(l *msgLedger) {
			l.end(l.begin(claim(10, time.Minute), "k", false), true)
			l.acknowledged("k", "handled", true)
			l.begin(claim(11, time.Minute), "k", false)
		},
		"handled without success": func(l *msgLedger) {
			l.end(l.begin(claim(10, time.Minute), "k", false), false)
			l.acknowledged("k", "handled", false)
		},
		"replayed without any success": func(l *msgLedger) { l.acknowledged("k", "replayed", false) },
		"a handler past its lease never cancelled": func(l *msgLedger) {
			old := l.begin(claim(10, -time.Second), "k", false)
			l.begin(claim(11, time.Minute), "k", false)
			l.waitCancelled(old)
		},
	}
	for name, f := range cases {
		l := newMsgLedger()
		l.bound = 10 * time.Millisecond
		f(l)
		assert.Positive(t, l.nViolations, "%s: not caught", name)
	}

	// A history that keeps the contract: a holder past its lease is
	// cancelled when a new one takes over, a run after a failed one, a
	// replay after a success.
	l := newMsgLedger()
	l.bound = time.Second
	ctx, cancel := context.WithCancel(claim(10, -time.Second))
	old := l.begin(ctx, "k", false)
	next := l.begin(claim(11, time.Minute), "k", false)
	cancel()
	l.waitCancelled(old)
	l.end(old, false)
	l.end(next, false)
	l.end(l.begin(claim(12, time.Minute), "k", false), true)
	l.acknowledged("k", "handled", true)
	l.acknowledged("k", "replayed", false)
	assert.Zero(t, l.nViolations, "%v", l.violations)

	b := newFenceBook()
	b.completed("r", 10, 11, []byte("v"), nil)
	assert.Len(t, b.stale, 1, "a stale completion accepted is not caught")
	b.completed("r", 12, 12, []byte("v"), nil)
	b.completed("r", 10, 12, []byte("v"), ErrLeaseLost)
	assert.Len(t, b.stale, 1)
}

// TestConsumeFaultsCluster runs the scenarios that need no proxy (claims
// answered late; every script sent twice and some replies dropped after
// Redis ran them) on a 3-master Cluster, with markers on (an index key and
// call records per slot) and WithoutMarkers.
func TestConsumeFaultsCluster(t *testing.T) {
	redistest.Long(t)
	cl := redistest.StartCluster(t, 3, 0)
	for i, sc := range cfScenarios() {
		if sc.name != "late answers" && sc.name != "lost replies" {
			continue
		}
		t.Run(sc.name, func(t *testing.T) {
			for _, markers := range []bool{true, false} {
				t.Run(map[bool]string{true: "markers", false: "records"}[markers], func(t *testing.T) {
					e := runFaultScenarioOn(t, sc, "cluster", cl, markers, uint64(1000+10*i)+map[bool]uint64{true: 1, false: 2}[markers], cfSize{keys: 24, rounds: 6})
					e.led.check(t, e.name(sc))
				})
			}
		})
	}
}

// lyingClaims is a store that answers a claim of a key held by another
// holder as claimed, with a fresh token: what a store that forgets a live
// claim would do.
type lyingClaims struct{ cfStore }

func (s lyingClaims) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	out := s.cfStore.ClaimBatch(ctx, req)
	for j := range out {
		if out[j].Err == nil && out[j].Reply.Status == statusInProgress {
			out[j].Reply = claimReply{Status: statusClaimed, Token: time.Now().UnixMicro(), Attempt: 1}
		}
	}
	return out
}

// TestConsumeFaultsCatchABrokenStore runs the harness of the fault suites on
// a store that hands out claims of keys in progress: it must see two live
// runs.
func TestConsumeFaultsCatchABrokenStore(t *testing.T) {
	sc := cfScenario{
		name: "a store that forgets live claims", lease: time.Second,
		on: func(*cfEnv) {}, off: func(*cfEnv) {},
		wrap: func(e *cfEnv, s cfStore) cfStore {
			e.led.bound = 100 * time.Millisecond // a handler the lie ran beside is not waited for long
			return lyingClaims{s}
		},
		body: func(*rand.Rand) string { return "slow" }, // every holder holds its key for half a lease
	}
	e := runFaultScenario(t, sc, "redis", true, 7, cfSize{keys: 4, rounds: 4})
	e.led.mu.Lock()
	defer e.led.mu.Unlock()
	require.Positive(t, e.led.nViolations, "the harness did not notice a store that hands out claims of keys in progress")
	assert.True(t, slices.ContainsFunc(e.led.violations, func(v string) bool { return strings.Contains(v, "two live runs") }),
		"no two live runs among %v", e.led.violations)
}

// unreachableAnswer reports whether Consume's error err is its answer to a
// batch none of whose claims reached the store: wrapping ErrUnavailable,
// every message answered, none acknowledged.
func unreachableAnswer(res []MessageResult, err error) bool {
	if !errors.Is(err, ErrUnavailable) || res == nil {
		return false
	}
	for _, r := range res {
		if r.Ack || r.Ran {
			return false
		}
	}
	return true
}
