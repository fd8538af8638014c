package idem

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/idemkit/idem/internal/slot"
	"github.com/redis/go-redis/v9"
)

// The batch scripts: each takes one step for many records in one call, with
// the rules of its single-record script.
var (
	//go:embed lua/batch_complete.lua
	batchCompleteBody string
	//go:embed lua/batch_release.lua
	batchReleaseBody string
	//go:embed lua/batch_extend.lua
	batchExtendBody string

	batchCompleteScript = newLuaScript("batch_complete", batchCompleteBody)
	batchReleaseScript  = newLuaScript("batch_release", batchReleaseBody)
	batchExtendScript   = newLuaScript("batch_extend", batchExtendBody)
)

var _ recordStore = (*redisStore)(nil)

// batchChunk is the most records one batch script call holds. A script holds
// Redis while it runs, a few microseconds per record, so a larger batch is
// sent as several calls of batchChunk records, in one pipeline: other
// clients' commands wait at most one chunk (well under a millisecond on a
// current server), and the batch still costs one round trip.
const batchChunk = 200

// ClaimBatch implements recordStore.
//
// On a *redis.Client or *redis.Conn, the records go in chunks of at most
// 200 (a script holds Redis while it runs), every chunk in one pipeline:
// one round trip. On a *redis.ClusterClient each call holds records of one slot only (a script may not reach across slots;
// every record has its own hash tag, so most calls hold one record), and
// go-redis sends each node's calls in one pipeline, the nodes at once: one
// round trip per node. On other clients (a Ring, an AutoPipeliner) each call
// holds one record, all in one pipeline. A node that cannot be reached fails
// its records only. With WithReplicas, each call is sent with WAIT, as a
// single claim is, and the calls run a few at a time.
func (s *redisStore) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	out := make([]batchClaimReply, len(req.IDs))
	fail := func(i int, err error) { out[i].Err = err }
	if !isBase64URL(req.Attempt) || req.Attempt == "" {
		failAll(len(out), fail, fmt.Errorf("%w: attempt must be base64url", ErrInvalidConfig))
		return out
	}
	if req.Fingerprints != nil && len(req.Fingerprints) != len(req.IDs) {
		failAll(len(out), fail, fmt.Errorf("%w: %d fingerprints for %d ids", ErrInvalidConfig, len(req.Fingerprints), len(req.IDs)))
		return out
	}
	fp := func(i int) string {
		if req.Fingerprints == nil {
			return ""
		}
		return req.Fingerprints[i]
	}
	todo := make([]int, 0, len(req.IDs))
	var seen map[string]struct{}
	if !req.distinct {
		seen = make(map[string]struct{}, len(req.IDs))
	}
	for i, id := range req.IDs {
		_, dup := seen[id]
		switch {
		case dup:
			fail(i, fmt.Errorf("%w: id %s given twice in one batch", ErrInvalidConfig, id))
		case !isBase64URL(fp(i)):
			fail(i, fmt.Errorf("%w: fingerprint must be base64url", ErrInvalidConfig))
		default:
			if seen != nil {
				seen[id] = struct{}{}
			}
			todo = append(todo, i)
		}
	}
	if s.noCompact {
		req.Compact = false
	}
	if len(todo) == 0 {
		return out
	}
	if err := s.layoutReady(ctx); err != nil {
		for _, i := range todo {
			out[i].Err = err
		}
		return out
	}
	s.v3.claim(ctx, s, &req, todo, out)
	return out
}

// CompleteBatch is SettleBatch without releases; its calls go as
// ClaimBatch's do. A compact claim (claimFence.Ref) completed with an empty
// result leaves a marker: one call per call record completes all of its
// claims. One completed with a value is first moved to a record of its own,
// in the same pipeline (and completed in a second round trip when the move
// ran after the completion, sent again after NOSCRIPT).
func (s *redisStore) CompleteBatch(ctx context.Context, items []batchCompletion) []error {
	errs := make([]error, len(items))
	calls, after := s.completeCalls(items, errs)
	s.runCalls(ctx, calls)
	after()
	s.runCalls(ctx, movedCalls(s, s.completeStep(items, errs), errs))
	return errs
}

// errMoved is the answer of a compact claim that its call record says was
// moved to a record of its own (by a checkpoint, a completion with a value,
// or Abandon) whose reply its holder may not have had: the step is then
// taken on that record, fenced by the claim's token (movedCalls).
var errMoved = errors.New("idem: compact claim moved to a record of its own")

// movedCalls returns the calls that take st on the records of the compact
// claims errs says were moved (errMoved), whose answers go into errs.
func movedCalls(s *redisStore, st *batchStep, errs []error) []batchCall {
	var moved []int
	for j, err := range errs {
		if err == errMoved {
			moved = append(moved, j)
			errs[j] = nil
		}
	}
	if len(moved) == 0 {
		return nil
	}
	calls := s.batchCalls(st, moved)
	for i := range calls {
		calls[i].step = st
	}
	return calls
}

// completeCalls returns the calls of CompleteBatch, whose answers go into
// errs once after is called.
func (s *redisStore) completeCalls(items []batchCompletion, errs []error) (calls []batchCall, after func()) {
	st := s.completeStep(items, errs)
	fence := func(j int) claimFence { return items[j].claimFence }
	compact, records := splitByRef(len(items), fence)
	var markers, moving []int
	var markerKeep time.Duration
	var until int64 // when the markers' results' retention ends; 0: Keep from now
	for _, j := range compact {
		u, marker := markerUntil(items[j].Value)
		if marker || isEmptyResult(items[j].Value) {
			markers = append(markers, j)
			markerKeep, until = max(markerKeep, items[j].Keep), max(until, u)
		} else {
			moving = append(moving, j)
		}
	}
	calls = s.v3.settleCalls(s, "C", markerKeep, until, s.compactGroups(markers, fence), fence, errs)
	calls = append(calls, s.v3.moveCalls(s, s.compactGroups(moving, fence), items, errs)...)
	for _, c := range s.batchCalls(st, records) {
		c.step = st
		calls = append(calls, c)
	}
	return calls, func() {
		for j, err := range errs {
			if err == errCompletedAsMarker {
				errs[j] = nil // a move of a claim completed before: the first result stays
			}
		}
	}
}

// completeStep is the step that completes records of items, with
// batch_complete.lua; its answers go into errs.
func (s *redisStore) completeStep(items []batchCompletion, errs []error) *batchStep {
	var keep time.Duration
	var keepArg any // millis(keep), boxed once for the items that share it
	st := &batchStep{
		op: "complete", script: batchCompleteScript, split: splitTransitions,
		key: func(i int) string { return s.key(items[i].ID) },
		args: func(dst []any, i int) []any {
			if keepArg == nil || items[i].Keep != keep {
				keep, keepArg = items[i].Keep, millis(items[i].Keep)
			}
			return append(dst, items[i].Token, strconv.FormatInt(items[i].Token, 36), keepArg, items[i].Value)
		},
		answer: transitionAnswers(errs),
	}
	if s.durable == nil {
		st.op = ""
	}
	return st
}

// ReleaseBatch is SettleBatch without completions; its calls go as
// ClaimBatch's do. The compact claims of one call are released in one call.
func (s *redisStore) ReleaseBatch(ctx context.Context, claims []claimFence, keep time.Duration) []error {
	errs := make([]error, len(claims))
	s.runCalls(ctx, s.releaseCalls(claims, keep, errs))
	s.runCalls(ctx, movedCalls(s, s.releaseStep(claims, keep, errs), errs))
	return errs
}

// releaseStep is the step that releases records of claims, with
// batch_release.lua; its answers go into errs.
func (s *redisStore) releaseStep(claims []claimFence, keep time.Duration, errs []error) *batchStep {
	return &batchStep{
		script: batchReleaseScript, split: splitTransitions,
		head:   []any{millis(keep)},
		key:    func(i int) string { return s.key(claims[i].ID) },
		args:   func(dst []any, i int) []any { return append(dst, claims[i].Token) },
		answer: transitionAnswers(errs),
	}
}

// releaseCalls returns the calls of ReleaseBatch, whose answers go into errs.
func (s *redisStore) releaseCalls(claims []claimFence, keep time.Duration, errs []error) []batchCall {
	st := s.releaseStep(claims, keep, errs)
	fence := func(j int) claimFence { return claims[j] }
	compact, records := splitByRef(len(claims), fence)
	calls := s.v3.settleCalls(s, "R", 0, 0, s.compactGroups(compact, fence), fence, errs)
	for _, c := range s.batchCalls(st, records) {
		c.step = st
		calls = append(calls, c)
	}
	return calls
}

// SettleBatch implements recordStore: CompleteBatch and ReleaseBatch in one
// pipeline, one round trip per node for a batch whose handlers returned,
// the failed ones too.
func (s *redisStore) SettleBatch(ctx context.Context, items []batchCompletion, claims []claimFence, keep time.Duration) (done, given []error) {
	switch {
	case len(claims) == 0:
		return s.CompleteBatch(ctx, items), []error{}
	case len(items) == 0:
		return []error{}, s.ReleaseBatch(ctx, claims, keep)
	}
	return s.settleBatch(ctx, items, claims, keep)
}

// settleBatch completes items and releases claims in one pipeline.
func (s *redisStore) settleBatch(ctx context.Context, items []batchCompletion, claims []claimFence, keep time.Duration) (done, given []error) {
	done, given = make([]error, len(items)), make([]error, len(claims))
	calls, after := s.completeCalls(items, done)
	calls = append(calls, s.releaseCalls(claims, keep, given)...)
	s.runCalls(ctx, calls)
	after()
	moved := movedCalls(s, s.completeStep(items, done), done)
	s.runCalls(ctx, append(moved, movedCalls(s, s.releaseStep(claims, keep, given), given)...))
	return done, given
}

// ExtendBatch implements recordStore; its calls go as ClaimBatch's do. The
// compact claims of one call share one lease, renewed in one call.
func (s *redisStore) ExtendBatch(ctx context.Context, claims []claimFence, lease, keep time.Duration) []error {
	errs := make([]error, len(claims))
	st := s.extendStep(claims, lease, keep, errs)
	fence := func(j int) claimFence { return claims[j] }
	compact, records := splitByRef(len(claims), fence)
	if len(compact) == 0 || s.compact == nil {
		s.runBatch(ctx, st, upTo(len(claims)))
		return errs
	}
	calls := s.v3.settleCalls(s, "E", keep, millis(lease), s.compactGroups(compact, fence), fence, errs)
	if s.durable == nil {
		st.op = ""
	}
	for _, c := range s.batchCalls(st, records) {
		c.step = st
		calls = append(calls, c)
	}
	s.runCalls(ctx, calls)
	s.runCalls(ctx, movedCalls(s, st, errs))
	return errs
}

// extendStep is the step that renews the leases of records of claims, with
// batch_extend.lua; its answers go into errs.
func (s *redisStore) extendStep(claims []claimFence, lease, keep time.Duration, errs []error) *batchStep {
	return &batchStep{
		op: "extend", script: batchExtendScript, split: splitTransitions,
		head:   []any{millis(lease), millis(keep)},
		key:    func(i int) string { return s.key(claims[i].ID) },
		args:   func(dst []any, i int) []any { return append(dst, claims[i].Token) },
		answer: transitionAnswers(errs),
	}
}

// batchStep is one step for many records: which script, and how each record
// goes into a call and comes out of its reply.
type batchStep struct {
	// op names the step for WithReplicas ("claim", "complete", "extend"), or
	// is "" for a step that does not wait for replicas.
	op     string
	script *luaScript
	// head are the arguments every call starts with.
	head []any
	// key is the Redis key of record i; args appends record i's arguments.
	key  func(i int) string
	args func(dst []any, i int) []any
	// split cuts the flat reply of a call of n records into each record's
	// reply, as the single-record script would answer it.
	split func(res []any, n int) ([][]any, error)
	// answer is told the reply of record i, or the error of its call.
	answer func(i int, res []any, err error)
	// wrote reports whether a record's reply says the script wrote it, for
	// WithReplicas; nil: its code is 1.
	wrote func(res []any) bool
}

// wroteRecord reports whether res, one record's reply, says st's script
// wrote it.
func (st *batchStep) wroteRecord(res []any) bool {
	if st.wrote != nil {
		return st.wrote(res)
	}
	return replyCode(res) == transitionDone
}

// batchCall is one script call of a batch: the records it holds, and the
// step it takes when it is not that of the batch it is sent with.
type batchCall struct {
	records []int
	keys    []string
	args    []any
	step    *batchStep
	// route is set for a call that goes where one of its keys or
	// arguments, a record key, is rather than where its first key is: its
	// position in the call's command (routedKeyPos for compact_settle.lua
	// and compact_move.lua, whose keys are the call record and the index
	// key). A client that places keys by hashing them (a Ring) sends the
	// call where that record is; 0: where its first key is.
	route int
}

// routedKeyPos is where a compact settle or move call's record key is in
// its command: after EVALSHA, the hash, the number of keys and its first
// two keys (the call record and the index key): its first argument or, for
// a move of claims to records, its first record key.
const routedKeyPos = 5

// cmd returns the command of the routed call c: EVALSHA, or EVAL for eval,
// sent where its record key is.
func (c *batchCall) cmd(ctx context.Context, st *batchStep, eval bool) *redis.Cmd {
	sc := c.stepOf(st).script
	args := sc.evalArgs(len(c.args), c.keys...)
	if eval {
		args[0], args[1] = "eval", sc.srcArg
	}
	args = append(args, c.args...)
	cmd := redis.NewCmd(ctx, args...)
	cmd.SetFirstKeyPos(int8(c.route))
	return cmd
}

// run sends the routed call c through client, as Script.Run does: EVALSHA,
// then EVAL on NOSCRIPT.
func (c *batchCall) run(ctx context.Context, st *batchStep, client redis.Scripter) *redis.Cmd {
	p, ok := client.(processor)
	if !ok {
		return c.stepOf(st).script.Run(ctx, client, c.keys, c.args...)
	}
	cmd := c.cmd(ctx, st, false)
	_ = p.Process(ctx, cmd)
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		cmd = c.cmd(ctx, st, true)
		_ = p.Process(ctx, cmd)
	}
	return cmd
}

// stepOf returns the step call takes: its own, or st.
func (c *batchCall) stepOf(st *batchStep) *batchStep {
	if c.step != nil {
		return c.step
	}
	return st
}

// runBatch takes st for the records todo, and tells st.answer of each.
func (s *redisStore) runBatch(ctx context.Context, st *batchStep, todo []int) {
	if len(todo) == 0 {
		return
	}
	calls := s.batchCalls(st, todo)
	if s.durable != nil && st.op != "" {
		s.sendDurable(ctx, st, calls)
		return
	}
	cmds := s.sendCalls(ctx, st, calls)
	for j, call := range calls {
		answerCall(st, call, cmds[j].Slice)
	}
}

// runCalls sends calls that each take a step of their own, in one pipeline
// (with WithReplicas, those whose step waits go as sendDurable sends them),
// and tells each step's answer of its records.
func (s *redisStore) runCalls(ctx context.Context, calls []batchCall) {
	if len(calls) == 0 {
		return
	}
	if s.durable != nil {
		var plain []batchCall
		for _, c := range calls {
			if c.step.op != "" {
				s.sendDurable(ctx, c.step, []batchCall{c})
			} else {
				plain = append(plain, c)
			}
		}
		calls = plain
	}
	cmds := s.sendCalls(ctx, nil, calls)
	for j := range calls {
		answerCall(calls[j].step, calls[j], cmds[j].Slice)
	}
}

// batchCalls cuts todo into script calls (see ClaimBatch).
func (s *redisStore) batchCalls(st *batchStep, todo []int) []batchCall {
	var groups [][]int
	switch s.client.(type) {
	case *redis.Client, *redis.Conn:
		groups = [][]int{todo}
	case *redis.ClusterClient:
		groups = bySlot(todo, st.key)
	default:
		groups = make([][]int, len(todo))
		for j := range todo {
			groups[j] = todo[j : j+1 : j+1]
		}
	}
	var calls []batchCall
	for _, g := range groups {
		for len(g) > 0 {
			n := min(len(g), batchChunk)
			calls = append(calls, s.batchCall(st, g[:n]))
			g = g[n:]
		}
	}
	return calls
}

func (s *redisStore) batchCall(st *batchStep, records []int) batchCall {
	// One key more than the records, for a call that adds one (the index
	// key of compact_claim.lua); arguments for the records only when st
	// appends them (compact_claim.lua's are made by its caller).
	c := batchCall{records: records, keys: make([]string, len(records), len(records)+1)}
	perRecord := 0
	if st.args != nil {
		perRecord = 4
	}
	c.args = append(make([]any, 0, len(st.head)+perRecord*len(records)), st.head...)
	for j, i := range records {
		c.keys[j] = st.key(i)
		if st.args != nil {
			c.args = st.args(c.args, i)
		}
	}
	return c
}

// pipeliner is a client that can pipeline: every go-redis client does.
type pipeliner interface {
	Pipeline() redis.Pipeliner
}

// sendCalls sends every call, in one pipeline when there are several: EVALSHA,
// then, for the calls answered NOSCRIPT (which did not run), EVAL in one more.
// The calls that store an outcome or keep a lease (every step but a claim)
// that a Cluster refused before they ran are sent again (see
// resendRedirected).
func (s *redisStore) sendCalls(ctx context.Context, st *batchStep, calls []batchCall) []*redis.Cmd {
	cmds := s.sendOnce(ctx, st, calls)
	s.resendRedirected(ctx, st, calls, cmds)
	return cmds
}

// resendRedirected sends the calls whose cmds a Cluster refused before
// they ran (TRYAGAIN, MOVED, ASK, CLUSTERDOWN: see isClusterRedirect)
// again, with backoff, for up to tryAgainPatience or until ctx is done,
// and puts the new answers in cmds. A Cluster answers TRYAGAIN a script
// whose keys are split between the two nodes of a migrating slot (the
// index key moved and a call record not yet), and MOVED or ASK one sent
// by a slot map that a reshard has made stale, after go-redis's own
// redirects: the script did not run. A reshard keeps a slot split for
// longer than go-redis tries, and a completion given up then is a handler
// that runs again after its lease. Claims are not sent again: their
// messages are simply not claimed (unavailable), and nothing ran.
func (s *redisStore) resendRedirected(ctx context.Context, st *batchStep, calls []batchCall, cmds []*redis.Cmd) {
	wait, deadline := tryAgainFirst, time.Now().Add(tryAgainPatience)
	for {
		var todo []int
		for j, c := range calls {
			if c.stepOf(st).script != v3ClaimScript && isClusterRedirect(cmds[j].Err()) {
				todo = append(todo, j)
			}
		}
		if len(todo) == 0 || time.Now().Add(wait).After(deadline) {
			return
		}
		if cc, ok := s.client.(*redis.ClusterClient); ok {
			cc.ReloadState(ctx)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		again := make([]batchCall, len(todo))
		for i, j := range todo {
			again[i] = calls[j]
		}
		for i, cmd := range s.sendOnce(ctx, st, again) {
			cmds[todo[i]] = cmd
		}
		wait = min(2*wait, tryAgainCap)
	}
}

// sendOnce is sendCalls without sending again what a Cluster refused.
func (s *redisStore) sendOnce(ctx context.Context, st *batchStep, calls []batchCall) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(calls))
	p, ok := s.client.(pipeliner)
	if !ok || len(calls) == 1 {
		for j, c := range calls {
			if c.route != 0 {
				cmds[j] = c.run(ctx, st, s.client)
				continue
			}
			cmds[j] = c.stepOf(st).script.Run(ctx, s.client, c.keys, c.args...)
		}
		return cmds
	}
	pipe := p.Pipeline()
	for j, c := range calls {
		if c.route != 0 {
			cmds[j] = c.cmd(ctx, st, false)
			_ = pipe.Process(ctx, cmds[j])
			continue
		}
		cmds[j] = pipe.EvalSha(ctx, c.stepOf(st).script.Hash(), c.keys, c.args...)
	}
	_, _ = pipe.Exec(ctx)
	var again redis.Pipeliner
	for j, c := range calls {
		if redis.HasErrorPrefix(cmds[j].Err(), "NOSCRIPT") {
			if again == nil {
				again = p.Pipeline()
			}
			if c.route != 0 {
				cmds[j] = c.cmd(ctx, st, true)
				_ = again.Process(ctx, cmds[j])
				continue
			}
			cmds[j] = again.Eval(ctx, c.stepOf(st).script.src, c.keys, c.args...)
		}
	}
	if again != nil {
		_, _ = again.Exec(ctx)
	}
	return cmds
}

// maxDurableCalls bounds the calls a batch with WithReplicas has in flight.
const maxDurableCalls = 8

// sendDurable sends each call with WAIT after it, as a single step is sent
// with WithReplicas, a few calls at a time, and answers a record that the
// script wrote with a *ReplicationError when too few replicas acknowledged
// it.
func (s *redisStore) sendDurable(ctx context.Context, st *batchStep, calls []batchCall) {
	d := s.durable
	cmds, waits := s.sendWaiting(ctx, st.script, calls)
	for j, c := range calls {
		answerCall(&batchStep{split: st.split, answer: func(i int, res []any, err error) {
			if err == nil && st.wroteRecord(res) {
				err = d.replicated(st.op, waits[j])
			}
			st.answer(i, res, err)
		}}, c, cmds[j].Slice)
	}
}

// sendWaiting sends each call of script with its WAIT (see durability.send
// and sendCluster), at most maxDurableCalls at a time, and returns each
// one's script and WAIT commands.
func (s *redisStore) sendWaiting(ctx context.Context, script *luaScript, calls []batchCall) ([]*redis.Cmd, []*redis.IntCmd) {
	d := s.durable
	cmds, waits := make([]*redis.Cmd, len(calls)), make([]*redis.IntCmd, len(calls))
	sem := make(chan struct{}, maxDurableCalls)
	if _, one := s.client.(*redis.Conn); one {
		sem = make(chan struct{}, 1) // one connection: one call at a time
	}
	var wg sync.WaitGroup
	for j, c := range calls {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			if cc, ok := s.client.(*redis.ClusterClient); ok {
				cmds[j], waits[j] = d.sendCluster(ctx, cc, script, c.keys, c.args)
			} else {
				cmds[j], waits[j] = d.send(ctx, s.client.(onePipeliner), false, script, c.keys, c.args)
			}
		}()
	}
	wg.Wait()
	return cmds, waits
}

// replicated returns nil if wait saw enough replicas acknowledge the write of
// op, and the *ReplicationError otherwise.
func (d *durability) replicated(op string, wait *redis.IntCmd) error {
	acked, err := wait.Result()
	if err == nil && acked >= int64(d.replicas) {
		return nil
	}
	if err != nil {
		acked = 0
	}
	return &ReplicationError{Op: op, Acked: int(acked), Wanted: d.replicas, Err: err}
}

// answerCall tells st.answer of each record of call its part of the reply
// that result gives.
func answerCall(st *batchStep, call batchCall, result func() ([]any, error)) {
	res, err := result()
	var each [][]any
	if err == nil {
		each, err = st.split(res, len(call.records))
	}
	for j, i := range call.records {
		if err != nil {
			st.answer(i, nil, err)
			continue
		}
		st.answer(i, each[j], nil)
	}
}

// splitTransitions cuts the flat reply of batch_complete.lua,
// batch_release.lua or batch_extend.lua (1, 0, or a reason) into the replies
// of complete.lua, release.lua or extend.lua ({1}, {0}, {5, reason}).
func splitTransitions(res []any, n int) ([][]any, error) {
	if len(res) != n {
		return nil, fmt.Errorf("%w: a batch script answered %d records for %d", ErrCorrupt, len(res), n)
	}
	each := make([][]any, n)
	for j, r := range res {
		switch r {
		case int64(transitionDone):
			each[j] = replyDone
		case int64(transitionLost):
			each[j] = replyLost
		default:
			if why, ok := r.(string); ok {
				each[j] = []any{int64(replyNotOurs), why}
			} else {
				each[j] = []any{r}
			}
		}
	}
	return each, nil
}

// The replies {1} and {0}, shared, read only.
var replyDone, replyLost = []any{int64(transitionDone)}, []any{int64(transitionLost)}

// transitionAnswers answers each record of a complete, release or extend step
// into errs.
func transitionAnswers(errs []error) func(i int, res []any, err error) {
	return func(i int, res []any, err error) {
		if err == nil {
			err = transitionReply(res)
		}
		errs[i] = err
	}
}

// bySlot groups records by the Cluster slot of their keys, in the order of
// their first record.
func bySlot(todo []int, key func(i int) string) [][]int {
	at := make(map[uint16]int, len(todo))
	var groups [][]int
	for _, i := range todo {
		slot := keySlot(key(i))
		g, ok := at[slot]
		if !ok {
			g = len(groups)
			at[slot] = g
			groups = append(groups, nil)
		}
		groups[g] = append(groups[g], i)
	}
	return groups
}

// keySlot is the Redis Cluster slot of key: CRC16 (XMODEM) of its hash tag,
// or of the whole key when it has none, modulo 16384.
func keySlot(key string) uint16 { return slot.Of(key) }

// upTo returns 0, 1, ..., n-1.
func upTo(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

func failAll(n int, fail func(i int, err error), err error) {
	for i := 0; i < n; i++ {
		fail(i, err)
	}
}
