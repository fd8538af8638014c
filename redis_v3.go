package idem

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// The scripts of the v3 layout of compact claims and markers (see
// format.go, "The v3 layout"): a batch's claim, and its settle.
var (
	//go:embed lua/v3_claim.lua
	v3ClaimBody string
	//go:embed lua/v3_settle.lua
	v3SettleBody   string
	v3ClaimScript  = newLuaScript("v3_claim", v3ClaimBody)
	v3SettleScript = newLuaScript("v3_settle", v3SettleBody)
)

// v3Layout is where a store of the v3 layout keeps its compact claims: one
// index key and its call records on one server (on each shard of a Ring),
// one of each a slot on a Cluster (see redisStore.v3Names). A batch claim
// that asked for records of their own reads the same index and writes its
// claims in records; a checkpoint or a completion with a value moves a v3
// claim to a record of its own; Claim (Do, Begin) reads the v3 index
// (claim.lua).
type v3Layout struct {
	index, calls string
	// indexArg and callsArg are index and calls boxed once, for the
	// arguments of claim.lua (see nameArgs).
	indexArg, callsArg any
	// ls is the index's level and split point as the last reply said
	// (an empty index's before any), level<<24 | split: the next call
	// packs by them. On a Cluster, slots holds each slot's, made at the
	// first claim there.
	ls        atomic.Uint32
	slotsOnce sync.Once
	slots     []atomic.Uint32
	packers   sync.Pool
}

// v3Chunk is the most messages one v3 claim call holds: Lua's unpack of its
// keys and blocks stays far below the stack's limit.
const v3Chunk = 1000

// v3MaxHold is how long past its call record's keep a v3 entry may still be
// held by a call that renews its lease: past it, the entry is swept, or
// answers as absent when its call record is missing.
const v3MaxHold = time.Hour

// newV3Layout returns the v3 layout of store s. A store made
// WithoutMarkers takes it too: its claims are records of their own, and
// it reads the markers others left in the v3 index.
func newV3Layout(s *redisStore) *v3Layout {
	l := &v3Layout{index: v3IndexKey(s.prefix, false, 0), calls: v3CallBase(s.prefix, false, 0)}
	l.indexArg, l.callsArg = l.index, l.calls
	l.ls.Store(v3StartLevel << 24)
	return l
}

// stateOf is where the level and split point of the index of the record
// whose Redis key is key are kept.
func (l *v3Layout) stateOf(s *redisStore, key string) *atomic.Uint32 {
	if !s.compact.cluster {
		return &l.ls
	}
	l.slotsOnce.Do(func() {
		l.slots = make([]atomic.Uint32, redisClusterSlots)
		for i := range l.slots {
			l.slots[i].Store(v3StartLevel << 24)
		}
	})
	return &l.slots[keySlot(key)]
}

// v3Names returns the v3 index key and the start of the call record keys
// of the record whose Redis key is key: the store's own on one server and
// on a Ring (each shard has its own under the same names, and a call goes
// where its record is), its slot's on a Cluster.
func (s *redisStore) v3Names(key string) (index, calls string) {
	if !s.compact.cluster {
		return s.v3.index, s.v3.calls
	}
	slot := keySlot(key)
	return v3IndexKey(s.prefix, true, slot), v3CallBase(s.prefix, true, slot)
}

// nameArgs returns index and calls, which v3Names gave, as script
// arguments: boxed once for the store on one server, where they are the
// same for every key, and boxed now on a Cluster.
func (s *redisStore) nameArgs(index, calls string) (any, any) {
	if !s.compact.cluster {
		return s.v3.indexArg, s.v3.callsArg
	}
	return index, calls
}

// v3CallID is the call id of attempt: itself when it is one (11
// characters of base64url), else 64 bits of its SHA-256.
func v3CallID(attempt string) string {
	if len(attempt) == v3CallIDSize && isBase64URL(attempt) {
		return attempt
	}
	sum := sha256.Sum256([]byte(attempt))
	return base64.RawURLEncoding.EncodeToString(sum[:8])
}

// claim is ClaimBatch's compact claim of the records todo, answered into
// out: on one server in calls of v3Chunk, on a Cluster in calls of one
// slot each, on other clients (a Ring) in a call a record, sent where its
// record is; the calls go in one pipeline. todo is not empty, and the
// store's layout is known (layoutReady).
func (l *v3Layout) claim(ctx context.Context, s *redisStore, req *batchClaimRequest, todo []int, out []batchClaimReply) {
	keys := s.keysOf(req.IDs, todo)
	var groups [][]int
	route := 0
	switch s.client.(type) {
	case *redis.Client, *redis.Conn:
		groups = [][]int{todo}
	case *redis.ClusterClient:
		groups = bySlot(todo, func(i int) string { return keys[i] })
	default:
		groups = make([][]int, len(todo))
		for j := range todo {
			groups[j] = todo[j : j+1 : j+1]
		}
		route = v3ClaimRoutePos
	}
	var parts []*v3ClaimPart
	var calls []batchCall
	for c := 0; len(groups) > 0; c++ {
		g := groups[0]
		chunk := g[:min(len(g), v3Chunk)]
		if len(chunk) == len(g) {
			groups = groups[1:]
		} else {
			groups[0] = g[len(chunk):]
		}
		// Each call has an id of its own, the first the attempt's: a
		// call is not taken for the previous one to its index sent again.
		callID := v3CallID(req.Attempt)
		if c > 0 {
			callID = v3CallID(req.Attempt + "/" + strconv.Itoa(c))
		}
		// On a Cluster a slot's few claims go in records of their own, as
		// clusterCompactMin says.
		compact := req.Compact && (!s.compact.cluster || len(chunk) >= clusterCompactMin)
		part, call := l.prepare(s, req, chunk, keys, callID, compact, out)
		if part == nil {
			continue
		}
		call.route = route
		parts = append(parts, part)
		calls = append(calls, call)
	}
	var cmds []*redis.Cmd
	var waits []*redis.IntCmd
	if s.durable != nil {
		cmds, waits = s.sendWaiting(ctx, v3ClaimScript, calls)
	} else {
		cmds = s.sendCalls(ctx, &batchStep{script: v3ClaimScript}, calls)
	}
	var records []int
	for j, cmd := range cmds {
		var wait *redis.IntCmd
		if waits != nil {
			wait = waits[j]
		}
		records = l.answer(s, req, parts[j], cmd, wait, out, records)
	}
	// A record of its own to take over (released, or its lease ran out)
	// or to read a result from is claimed there, as Claim does, a round
	// trip each: its checkpoints or its result come with it. Such ids are
	// few (a claim moved by a checkpoint or a completion with a value or a
	// Final error; one Do or Begin made).
	for _, i := range records {
		fp := ""
		if req.Fingerprints != nil {
			fp = req.Fingerprints[i]
		}
		out[i].Reply, out[i].Err = s.Claim(ctx, req.IDs[i], claimRequest{Fingerprint: fp, Attempt: req.Attempt,
			Lease: req.Lease, Keep: req.Keep, Retention: req.Retention, MarkerRetention: req.MarkerRetention})
	}
}

// v3ClaimRoutePos is where a v3 claim call of one record has its record
// key in its command: after EVALSHA, the hash, the number of keys and the
// index key.
const v3ClaimRoutePos = 4

// v3ClaimPart is one v3 claim call on its way: its records, the packer
// that packed them and reads its reply, and the index state it updates.
type v3ClaimPart struct {
	chunk   []int
	p       *v3Packer
	ls      *atomic.Uint32
	compact bool
}

// prepare makes the claim call of the records chunk, of id callID,
// claiming compactly or in records of their own; keys are the records'
// keys (by the caller's index). A chunk that cannot be sent is answered
// into out, and prepare returns nil.
func (l *v3Layout) prepare(s *redisStore, req *batchClaimRequest, chunk []int, keys []string, callID string, compact bool, out []batchClaimReply) (*v3ClaimPart, batchCall) {
	fpw := 0
	if req.Fingerprints != nil {
		for _, i := range chunk {
			fpw = max(fpw, len(req.Fingerprints[i]))
		}
	}
	if fpw > v3MaxFingerprint {
		for _, i := range chunk {
			out[i].Err = fmt.Errorf("%w: a fingerprint of %d bytes, over %d", ErrInvalidConfig, fpw, v3MaxFingerprint)
		}
		return nil, batchCall{}
	}
	p, _ := l.packers.Get().(*v3Packer)
	if p == nil {
		p = &v3Packer{}
	}
	index, calls := s.v3Names(keys[chunk[0]])
	part := &v3ClaimPart{chunk: chunk, p: p, ls: l.stateOf(s, keys[chunk[0]]), compact: compact}
	ls := part.ls.Load()
	p.level, p.split = uint8(ls>>24), ls&(1<<24-1)
	vk := make([]v3Key, len(chunk))
	for j, i := range chunk {
		vk[j] = v3KeyOf(req.IDs[i])
	}
	arg, _ := p.pack(vk)
	rkeys := make([]string, 1+len(chunk))
	rkeys[0] = index
	var fps []byte
	if fpw > 0 {
		fps = make([]byte, 0, fpw*len(chunk))
	}
	for place := 1; place <= len(chunk); place++ {
		i := chunk[p.index(place)]
		rkeys[place] = keys[i]
		if fpw > 0 {
			fp := req.Fingerprints[i]
			fps = append(fps, fp...)
			for k := len(fp); k < fpw; k++ {
				fps = append(fps, '.')
			}
		}
	}
	state := []byte{p.level, byte(p.split >> 16), byte(p.split >> 8), byte(p.split)}
	callKeep := req.Lease + max(req.Keep-req.Lease, req.MarkerRetention)
	args := []any{millis(req.Lease), millis(callKeep), calls, arg, callID, fpw, fps, state, millis(callKeep + v3MaxHold), millis(req.Keep)}
	if !compact {
		// Records of their own, read from the same index.
		args = append(args, req.Attempt)
	}
	return part, batchCall{records: chunk, keys: rkeys, args: args}
}

// answer reads the reply cmd of the claim call part into out, and returns
// records with the records it answered K for (see claim) appended. With
// WithReplicas, wait is the WAIT sent after the call: a claim it made
// that too few replicas acknowledged answers a *ReplicationError.
func (l *v3Layout) answer(s *redisStore, req *batchClaimRequest, part *v3ClaimPart, cmd *redis.Cmd, wait *redis.IntCmd, out []batchClaimReply, records []int) []int {
	p, chunk := part.p, part.chunk
	defer l.packers.Put(p)
	fail := func(err error) []int {
		for _, i := range chunk {
			out[i].Err = err
		}
		return records
	}
	r, err := cmd.Text()
	if err != nil {
		return fail(s.layoutError(err))
	}
	ans := make([]v3Answer, len(chunk))
	tok, refusal, err := p.decode(r, ans)
	if err != nil {
		return fail(err)
	}
	part.ls.Store(uint32(p.level)<<24 | p.split)
	var replicated error
	if wait != nil {
		replicated = s.durable.replicated("claim", wait)
	}
	for j, i := range chunk {
		switch ans[j].code {
		case v3AnswerRefused:
			// Redis refused the call's write: unavailable, as a refused
			// single claim is.
			out[i].Err = errors.New(refusal)
		case v3AnswerRecord:
			records = append(records, i)
		default:
			ref := p.place(j)
			if !part.compact {
				ref = 0 // a record of its own
			}
			out[i].Reply, out[i].Err = v3Reply(ans[j], tok, ref, req.Lease)
			if out[i].Err == nil && out[i].Reply.Status == statusClaimed && replicated != nil {
				out[i].Reply, out[i].Err = claimReply{}, replicated
			}
		}
	}
	return records
}

// v3Reply is the claimReply of answer a of a v3 claim call of token tok,
// the message at place.
func v3Reply(a v3Answer, tok int64, place int, lease time.Duration) (claimReply, error) {
	switch a.code {
	case v3AnswerClaimed:
		return claimReply{Status: statusClaimed, Token: tok, Attempt: 1, Ref: place}, nil
	case v3AnswerTakenOver, v3AnswerReclaimed:
		return claimReply{Status: statusClaimed, Token: tok, Attempt: int(a.n), Recovered: a.code == v3AnswerTakenOver, Ref: place}, nil
	case v3AnswerEarlier:
		// The claim of an earlier run of this call, at its place in that
		// run's call record.
		return claimReply{Status: statusClaimed, Token: v3WholeToken(a.n, time.Now().UnixMicro()), Attempt: max(1, int(a.attempt%v3RecoveredBit)),
			Recovered: a.attempt >= v3RecoveredBit, Ref: int(a.place)}, nil
	case v3AnswerRepeat:
		// Another id of this call with the same 64 bits (see format.go):
		// as in progress, held by this call.
		return claimReply{Status: statusInProgress, LeaseLeft: lease}, nil
	case v3AnswerDone:
		return claimReply{Status: statusCompleted, Token: v3WholeToken(a.n, time.Now().UnixMicro()), Attempt: max(1, int(a.attempt)), Marker: true, Value: emptyBytes}, nil
	case v3AnswerExpired:
		return claimReply{Status: statusResultExpired, Token: v3WholeToken(a.n, time.Now().UnixMicro()), Attempt: max(1, int(a.attempt)), Marker: true}, nil
	case v3AnswerBusy:
		return claimReply{Status: statusInProgress, LeaseLeft: time.Duration(a.n) * time.Millisecond}, nil
	case v3AnswerMismatch:
		return claimReply{Status: statusMismatch}, nil
	case v3AnswerCallMissing:
		return claimReply{}, errCallMissing
	}
	return claimReply{}, fmt.Errorf("%w: the record's key holds a value that is not a record of ours", ErrCorrupt)
}

// settleCalls returns the calls that complete (target "C"), release ("R")
// or renew ("E") the v3 compact claims of groups, one call record each;
// keep and arg as v3_settle.lua takes them (completing: the call record's
// keep and when the results' retention ends; renewing: the call record's
// keep and the lease). Their answers go into errs. A call carries the key
// of its first record as its last argument, which the script does not
// read: a Ring sends it there.
func (l *v3Layout) settleCalls(s *redisStore, target string, keep time.Duration, arg int64, groups [][]int, fence func(j int) claimFence, errs []error) []batchCall {
	answer := compactAnswers(errs)
	calls := make([]batchCall, 0, len(groups))
	for _, items := range groups {
		places := make([]byte, 0, 2*len(items))
		refs := make([]int, len(items))
		for k, j := range items {
			r := fence(j).Ref
			refs[k] = r
			places = append(places, byte(r>>8), byte(r))
		}
		st := &batchStep{script: v3SettleScript, split: v3SettleSplit(target[0], refs), answer: answer}
		switch {
		case s.durable == nil:
		case target == "C":
			st.op = "complete"
		case target == "E":
			st.op = "extend"
		}
		key := s.key(fence(items[0]).ID)
		index, base := s.v3Names(key)
		keys := []string{v3CallKey(base, fence(items[0]).Token), index}
		calls = append(calls, batchCall{records: items, keys: keys, args: []any{target, millis(keep), arg, string(places), key}, step: st, route: v3SettleRoutePos})
	}
	return calls
}

// v3SettleRoutePos is where a v3 settle call (C, R or E) has its record
// key in its command: after EVALSHA, the hash, the number of keys, its two
// keys and its first four arguments.
const v3SettleRoutePos = 9

// v3SettleSplit cuts the reply of v3_settle.lua to a call of mode (C, R or
// E) whose claims are at places refs into each claim's reply, as
// splitCompactTransitions gives them: the script answers with the call's
// place states before it ran, and a claim's answer is its place's state.
// With refs nil (mode M) it reads the reply of a move, an answer a claim.
func v3SettleSplit(mode byte, refs []int) func(res []any, n int) ([][]any, error) {
	return func(res []any, n int) ([][]any, error) {
		each := make([][]any, n)
		switch {
		case len(res) == 1 && res[0] == int64(transitionLost):
			for j := range each {
				each[j] = replyLost
			}
			return each, nil
		case len(res) == 2 && res[0] == int64(transitionLost):
			if why, ok := res[1].(string); ok {
				for j := range each {
					each[j] = []any{int64(replyNotOurs), why}
				}
				return each, nil
			}
		}
		before, ok := "", false
		if len(res) == 1 {
			before, ok = res[0].(string)
		}
		if !ok || refs == nil {
			return splitCompactTransitions(res, n)
		}
		if len(refs) != n {
			return nil, fmt.Errorf("%w: a v3 settle of %d claims for %d", ErrCorrupt, len(refs), n)
		}
		for j, p := range refs {
			if p < 1 || p > len(before) {
				return nil, fmt.Errorf("%w: a v3 call record of %d places has no place %d", ErrCorrupt, len(before), p)
			}
			switch s := before[p-1]; {
			case s == v3Held, s == mode && mode != 'E':
				each[j] = replyDone
			case s == v3Moved:
				each[j] = []any{int64(compactSettleMoved)}
			default:
				each[j] = replyLost
			}
		}
		return each, nil
	}
}

// moveCalls returns the calls that complete the v3 compact claims of
// groups, items' fences, with the values of items, each moved to a record
// of its own kept for its item's Keep (v3_settle.lua's 'M'); their answers
// go into errs.
func (l *v3Layout) moveCalls(s *redisStore, groups [][]int, items []batchCompletion, errs []error) []batchCall {
	st := &batchStep{script: v3SettleScript, split: v3SettleSplit(0, nil), answer: compactAnswers(errs)}
	if s.durable != nil {
		st.op = "complete"
	}
	calls := make([]batchCall, 0, len(groups))
	for _, g := range groups {
		tok := items[g[0]].Token
		places := make([]byte, 0, 2*len(g))
		keys := make([]string, 2, 2+len(g))
		index, base := s.v3Names(s.key(items[g[0]].ID))
		keys[0], keys[1] = v3CallKey(base, tok), index
		args := make([]any, 5, 5+2*len(g))
		for _, j := range g {
			r := items[j].Ref
			places = append(places, byte(r>>8), byte(r))
			keys = append(keys, s.key(items[j].ID))
			args = append(args, millis(items[j].Keep), items[j].Value)
		}
		args[0], args[1], args[2], args[3], args[4] = "M", 0, 0, string(places), strconv.FormatInt(tok, 36)
		calls = append(calls, batchCall{records: g, keys: keys, args: args, step: st, route: routedKeyPos})
	}
	return calls
}
