package idem

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem/internal/slot"
	"github.com/redis/go-redis/v9"
)

// Compact claims and markers: how a RedisStore keeps the claims of a batch
// without a Redis key each, and what a message handled that way leaves: the
// index of their entries, its layout and the compact scripts. See
// lua/compact_claim.lua for the layout.
var (
	//go:embed lua/compact_claim.lua
	compactClaimBody string
	//go:embed lua/compact_settle.lua
	compactSettleBody string
	//go:embed lua/compact_move.lua
	compactMoveBody     string
	compactClaimScript  = newLuaScript(compactClaimBody)
	compactSettleScript = newLuaScript(compactSettleBody)
	compactMoveScript   = newLuaScript(compactMoveBody)
)

// compactLayout is where a RedisStore keeps its index of compact claims
// and markers: one index key on one server, one per slot on a Cluster. Each
// index key sizes itself (see lib.lua): where an entry lives within it
// follows from the key's own state, which every script reads, never from a
// setting of the store.
type compactLayout struct {
	// cluster is set for a *redis.ClusterClient: each slot has its own index
	// key and call records, so that a record and its entry share a slot.
	cluster bool
	// keyNames holds the names of the index keys: on one server, the one;
	// on a Cluster, each slot's.
	keyNames []string
}

func newCompactLayout(cluster bool, prefix string) *compactLayout {
	l := &compactLayout{cluster: cluster}
	if cluster {
		l.keyNames = make([]string, redisClusterSlots)
		for slot := range l.keyNames {
			l.keyNames[slot] = prefix + "{" + slotTag(uint16(slot)) + "}i"
		}
	} else {
		// i:0, the name an index of the first layout had: a store of this
		// version refuses it rather than miss its markers.
		l.keyNames = []string{prefix + "i:0"}
	}
	return l
}

// redisClusterSlots is the number of hash slots of a Redis Cluster.
const redisClusterSlots = slot.Slots

// indexDigest writes the digest of record id the index places and knows
// its entry by into dst: the 16 bytes of SHA-256 a Keeper's id is in
// canonical base64url, or the first 16 bytes of the SHA-256 of an id of
// any other form (one whose last character carries padding bits that are
// not zero included, so that two ids never share a digest by their
// encoding).
func indexDigest(dst *[16]byte, id string) {
	if len(id) == idLen {
		if n, err := base64.RawURLEncoding.Strict().Decode(dst[:], []byte(id)); err == nil && n == len(dst) {
			return
		}
	}
	sum := sha256.Sum256([]byte(id))
	copy(dst[:], sum[:16])
}

// entryOf is where the index keeps the entry of record id: its index key
// and the first 8 bytes of its digest, which the entry starts with; bytes 5
// to 8 of those choose its block (see lib.lua). Within a block every entry
// shares the low bits of those 4 bytes that chose it, so an entry is told
// from the others of its block by the remaining 64 - log2(blocks) bits.
type entryOf struct {
	key string
	d8  [8]byte
}

// entry returns where the index keeps the entry of record id.
func (s *RedisStore) entry(id string) entryOf { return s.entryAt(id, s.key(id)) }

// entryAt is entry for record id, whose Redis key is key.
func (s *RedisStore) entryAt(id, key string) entryOf {
	var d [16]byte
	indexDigest(&d, id)
	var e entryOf
	copy(e.d8[:], d[:8])
	if s.compact.cluster {
		e.key = s.compact.keyNames[keySlot(key)]
	} else {
		e.key = s.compact.keyNames[0]
	}
	return e
}

// callBase is the start of the call record keys of the records whose Redis
// key is recordKey: the store's own on one server, its slot's on a Cluster.
func (s *RedisStore) callBase(recordKey string) string {
	if !s.compact.cluster {
		return s.prefix + "c:"
	}
	return s.prefix + "{" + slotTag(keySlot(recordKey)) + "}c:"
}

// slotTags[s] is a hash tag of slot s, made once when a Cluster first needs
// one: the shortest string of letters and digits whose slot is s.
var slotTags struct {
	once sync.Once
	tags []string
}

// slotTag returns a hash tag whose Cluster slot is slot.
func slotTag(slot uint16) string {
	slotTags.once.Do(func() {
		tags := make([]string, redisClusterSlots)
		left := redisClusterSlots
		const chars = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
		var buf [4]byte
		for n := 1; left > 0 && n <= len(buf); n++ {
			idx := make([]int, n)
			for {
				for i, c := range idx {
					buf[i] = chars[c]
				}
				if s := keySlot(string(buf[:n])); tags[s] == "" {
					tags[s] = string(buf[:n])
					left--
				}
				i := n - 1
				for i >= 0 && idx[i] == len(chars)-1 {
					idx[i] = 0
					i--
				}
				if i < 0 {
					break
				}
				idx[i]++
			}
		}
		slotTags.tags = tags
	})
	return slotTags.tags[slot]
}

// layoutGate holds off the store's first use of the index until its layout
// is known: a client other than a *redis.Client, a *redis.Conn or a
// *redis.ClusterClient (an AutoPipeliner, a Ring, a failover client) may
// reach a Cluster, whose index keys must carry their slot's tag, so the
// store asks the server once.
type layoutGate struct {
	mu    sync.Mutex
	ready bool
}

// layoutReady makes sure the store's layout is known before its first use
// of the index: for a client of an unknown kind, INFO cluster tells whether
// the server is a Cluster node. The answer is kept.
func (s *RedisStore) layoutReady(ctx context.Context) error {
	g := &s.layout
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ready {
		return nil
	}
	switch s.client.(type) {
	case *redis.Client, *redis.Conn, *redis.ClusterClient:
	default:
		c, ok := s.client.(interface {
			Do(ctx context.Context, args ...any) *redis.Cmd
		})
		if ok {
			info, err := c.Do(ctx, "info", "cluster").Text()
			var reply redis.Error
			switch {
			case errors.As(err, &reply):
				info = "" // a server that has no such section is no Cluster
			case err != nil:
				return err
			}
			if strings.Contains(info, "cluster_enabled:1") {
				s.compact = newCompactLayout(true, s.prefix)
			}
		}
	}
	g.ready = true
	return nil
}

// layoutErrPrefix starts what a script answers when the index key it is
// given is of another layout (written by another version of idem), before
// what its field "" holds.
const layoutErrPrefix = "IDEMLAYOUT "

// layoutError turns a script's answer that the index holds another layout
// into ErrInvalidConfig; other errors are returned as they are.
func (s *RedisStore) layoutError(err error) error {
	if err == nil || !redis.HasErrorPrefix(err, strings.TrimSpace(layoutErrPrefix)) {
		return err
	}
	found := strings.TrimPrefix(err.Error(), layoutErrPrefix)
	return fmt.Errorf("%w: the index of prefix %q is laid out as %q, which this version of idem does not read: use another prefix",
		ErrInvalidConfig, s.prefix, found)
}

// clusterCompactMin is the fewest records of one slot that a claim on a
// Cluster keeps compactly: a slot's share of a batch is one or two of its
// records far more often than not (a batch of 500 falls in about 490 of
// 16,384 slots), and a call record for so few costs more Redis memory and
// work than a record each (measured by idembench -cluster: 281 bytes and
// 49 µs of Redis CPU a message compactly, 226 bytes and 26 µs in records).
// Such claims are kept in records, which a claim that asked for compact
// ones completes as markers (see Claim.marks): the answers and the
// retentions are the same.
const clusterCompactMin = 4

// compactHead is what compact_claim.lua's call for n records, the first's
// key recordKey, is given before the records' own arguments.
func (s *RedisStore) compactHead(req *BatchClaimRequest, recordKey string, n int) []any {
	callKeep := req.Lease + max(req.Keep-req.Lease, req.MarkerRetention)
	mode := "r"
	if req.Compact && (!s.compact.cluster || n >= clusterCompactMin) {
		mode = "c"
	}
	return []any{req.Attempt, millis(req.Lease), millis(req.Keep), millis(callKeep), s.callBase(recordKey), mode}
}

// claimCompact is ClaimBatch on a store that keeps compact claims: the
// records and the index are looked at, and new claims are kept compactly if
// req asks for it; todo are the records to ask for, out their answers. A
// call holds records whose entries are in one index key: on one server,
// almost always all of them; on a Cluster, those of one slot. todo is not
// empty, and the store's layout is known (layoutReady).
func (s *RedisStore) claimCompact(ctx context.Context, req *BatchClaimRequest, todo []int, out []BatchClaimReply) {
	entries := make([]entryOf, len(req.IDs))
	keys := s.keysOf(req.IDs, todo)
	for _, i := range todo {
		entries[i] = s.entryAt(req.IDs[i], keys[i])
	}
	// placeOf[i] is the place of record i in its call: the Ref of a
	// compact claim.
	placeOf := make([]int32, len(req.IDs))
	st := &batchStep{
		op: "claim", script: compactClaimScript, split: splitCompactClaims,
		key: func(i int) string { return keys[i] },
		answer: func(i int, res []any, err error) {
			out[i].Reply, out[i].Err = batchClaimAnswer(res, s.layoutError(err), int(placeOf[i]))
		},
		// A claim by this call, of its first run or of an earlier one whose
		// reply was lost (compactClaimedBefore), waits for the replicas as a new one does.
		wrote: func(res []any) bool {
			c := replyCode(res)
			return c == compactClaimRecord || c == compactClaimed || c == compactClaimedBefore
		},
	}
	if s.durable == nil {
		st.op = ""
	}
	var calls []batchCall
	for _, c := range s.batchCalls(st, todo) {
		c.step = st
		for p, i := range c.records {
			placeOf[i] = int32(p + 1)
		}
		c.keys = append(c.keys, entries[c.records[0]].key)
		c.args = append(make([]any, 0, 7+len(c.records)), s.compactHead(req, c.keys[0], len(c.records))...)
		// The entries' starts of the call, 10 bytes each: one argument, not
		// one per record.
		heads := make([]byte, 0, 10*len(c.records))
		for p, i := range c.records {
			heads = append(heads, entries[i].d8[:]...)
			heads = append(heads, byte((p+1)>>8), byte(p+1))
		}
		c.args = append(c.args, string(heads))
		if req.Fingerprints != nil {
			for _, i := range c.records {
				c.args = append(c.args, req.Fingerprints[i])
			}
		}
		calls = append(calls, c)
	}
	s.runCalls(ctx, calls)
}

// batchClaimAnswer reads one record's part of the reply of compact_claim.lua,
// as splitCompactClaims cut it: the
// answers of claimReply, {6, token} for a compact claim by this call (at
// place, the record's place in the call), {10, token, place} for one by an
// earlier run of it, {7, error} for a write Redis refused.
func batchClaimAnswer(res []any, err error, place int) (ClaimReply, error) {
	if err != nil {
		return ClaimReply{}, err
	}
	switch replyCode(res) {
	case compactClaimed:
		if len(res) == 2 {
			if tok, ok := res[1].(int64); ok && tok > 0 && place > 0 {
				return ClaimReply{Status: StatusClaimed, Token: tok, Attempt: 1, Ref: place}, nil
			}
		}
	case compactClaimedBefore:
		if len(res) == 3 {
			tok, ok1 := res[1].(int64)
			place, ok2 := res[2].(int64)
			if ok1 && ok2 && tok > 0 && place > 0 {
				return ClaimReply{Status: StatusClaimed, Token: tok, Attempt: 1, Ref: int(place)}, nil
			}
		}
	case compactClaimRefused:
		if len(res) == 2 {
			if msg, ok := res[1].(string); ok {
				return ClaimReply{}, errors.New(msg) // Redis refused a write: unavailable
			}
		}
	default:
		return claimReply(res)
	}
	return ClaimReply{}, unexpected(res)
}

// splitCompactClaims cuts compact_claim.lua's flat reply into each record's:
// those of claimReply ({1, ...} for code 13, a new record, too), {6 or 10,
// token, place} for a compact claim, {8 or 9, token} for a marker, {7,
// error} for a write Redis refused.
func splitCompactClaims(res []any, n int) ([][]any, error) {
	if len(res) < 2 {
		return nil, unexpected(res)
	}
	tok, ok1 := res[len(res)-2].(int64)
	now, ok2 := res[len(res)-1].(int64)
	if !ok1 || !ok2 {
		return nil, unexpected(res[len(res)-2:])
	}
	res = res[:len(res)-2]
	each := make([][]any, 0, n)
	six := []any{int64(compactClaimed), tok} // the answer of every new compact claim of the call, read only
	var fresh []any                          // that of every new record it claimed, read only
	for p := 0; p < len(res); {
		code, _ := res[p].(int64)
		switch code {
		case compactClaimed:
			each = append(each, six)
			p++
			continue
		case compactClaimNewRecord:
			// A new record: token Redis's clock, attempt 1, not recovered,
			// no checkpoints.
			if fresh == nil {
				fresh = []any{int64(compactClaimRecord), now, int64(1), int64(0)}
			}
			each = append(each, fresh)
			p++
			continue
		case compactClaimedBefore:
			if p+3 > len(res) {
				return nil, unexpected(res[p:])
			}
			each = append(each, res[p:p+3:p+3])
			p += 3
			continue
		case compactClaimRefused, compactClaimMarker, compactClaimMarkerExpired:
			if p+2 > len(res) {
				return nil, unexpected(res[p:])
			}
			each = append(each, res[p:p+2:p+2])
			p += 2
			continue
		case compactClaimMarked, compactClaimMarkedExpired:
			// A record whose result is a marker's: as a marker, with its
			// attempt count.
			if p+3 > len(res) {
				return nil, unexpected(res[p:])
			}
			marker := int64(compactClaimMarker)
			if code == compactClaimMarkedExpired {
				marker = compactClaimMarkerExpired
			}
			each = append(each, []any{marker, res[p+1], res[p+2]})
			p += 3
			continue
		}
		k := claimFields(code)
		if k < 0 || p+1+k > len(res) {
			return nil, unexpected(res[p:])
		}
		each = append(each, res[p:p+1+k:p+1+k])
		p += 1 + k
	}
	if len(each) != n {
		return nil, fmt.Errorf("%w: a batch script answered %d records for %d", ErrCorrupt, len(each), n)
	}
	return each, nil
}

// compactGroups groups the records picks names, whose fences have a Ref, by
// the call record that holds them, in the order of their first record. A
// call's token is unique only on the server that made it: on one server
// the token names the call; on a Cluster, where every slot has its own call
// records, the token and the slot; on other clients (a Ring, whose shards
// have clocks of their own, or an AutoPipeliner), whose every claim call
// holds one record, the token and the record.
func (s *RedisStore) compactGroups(picks []int, fence func(j int) Fence) (groups [][]int) {
	type call struct {
		token int64
		slot  uint16
		id    string
	}
	oneServer := false
	switch s.client.(type) {
	case *redis.Client, *redis.Conn:
		oneServer = true
	}
	at := map[call]int{}
	for _, j := range picks {
		f := fence(j)
		c := call{token: f.Token}
		switch {
		case s.compact.cluster:
			c.slot = keySlot(s.key(f.ID))
		case !oneServer:
			c.id = f.ID
		}
		g, ok := at[c]
		if !ok {
			g = len(groups)
			at[c] = g
			groups = append(groups, nil)
		}
		groups[g] = append(groups[g], j)
	}
	return groups
}

// settleCalls returns the calls that complete (target "C") or release ("R")
// the compact claims of groups, one call record each, kept at least keep
// when completing, their results' retention ending at until (Unix
// microseconds; 0: keep from now); their answers go into errs.
func (s *RedisStore) settleCalls(target string, keep time.Duration, until int64, groups [][]int, fence func(j int) Fence, errs []error) []batchCall {
	st := &batchStep{script: compactSettleScript, split: splitCompactTransitions, answer: compactAnswers(errs)}
	if s.durable != nil && target == "C" {
		st.op = "complete"
	}
	calls := make([]batchCall, 0, len(groups))
	for _, items := range groups {
		f := fence(items[0])
		key := s.key(f.ID)
		places := make([]byte, 0, 2*len(items))
		for _, j := range items {
			r := fence(j).Ref
			places = append(places, byte(r>>8), byte(r))
		}
		keys := []string{s.callBase(key) + strconv.FormatInt(f.Token, 10), s.entry(f.ID).key}
		args := []any{key, target, millis(keep), string(places), until}
		calls = append(calls, batchCall{records: items, keys: keys, args: args, step: st, route: routedKeyPos})
	}
	return calls
}

// compactAnswers answers each claim of a compact settle or move step into
// errs: as transitionAnswers, errMoved for a claim moved to a record of its
// own (3), errCompletedAsMarker for one completed already (4).
func compactAnswers(errs []error) func(i int, res []any, err error) {
	return func(i int, res []any, err error) {
		switch {
		case err == nil && len(res) == 1 && (res[0] == int64(compactSettleMoved) || res[0] == int64(compactMoveMoved)):
			err = errMoved
		case err == nil && len(res) == 1 && res[0] == int64(compactMoveCompleted):
			err = errCompletedAsMarker
		case err == nil:
			err = transitionReply(res)
		}
		errs[i] = err
	}
}

// errCompletedAsMarker answers the move of a compact claim that its call
// record says was completed already, with an empty result: a completion
// sent again, which keeps the first result.
var errCompletedAsMarker = errors.New("idem: compact claim completed already")

// moveCalls returns the calls that renew (mode "E") the compact claims of
// each group's call, with lease and keeping the call record at least keep,
// or move them ("M") to records of their own kept for keep; their answers
// go into errs.
func (s *RedisStore) moveCalls(mode string, lease, keep time.Duration, groups [][]int, fence func(j int) Fence, errs []error) []batchCall {
	st := &batchStep{script: compactMoveScript, split: splitCompactTransitions, answer: compactAnswers(errs)}
	if s.durable != nil && mode == "E" {
		st.op = "extend"
	}
	calls := make([]batchCall, 0, len(groups))
	for _, items := range groups {
		f := fence(items[0])
		// The call record and the index key, then, moving, the records it
		// writes: every key the script reads or writes.
		keys := make([]string, 2, 2+len(items))
		keys[0], keys[1] = s.callBase(s.key(f.ID))+strconv.FormatInt(f.Token, 10), s.entry(f.ID).key
		args := make([]any, 0, 5+2*len(items))
		args = append(args, s.key(f.ID), f.Token, mode, millis(lease), millis(keep))
		for _, j := range items {
			fj := fence(j)
			if mode == "M" {
				keys = append(keys, s.key(fj.ID))
			}
			e := s.entry(fj.ID)
			args = append(args, fj.Ref, string(e.d8[:]))
		}
		calls = append(calls, batchCall{records: items, keys: keys, args: args, step: st, route: routedKeyPos})
	}
	return calls
}

// splitCompactTransitions cuts a compact transition script's reply (1, 2,
// 0, or a reason, per claim) into the replies transitionReply reads.
func splitCompactTransitions(res []any, n int) ([][]any, error) {
	each, err := splitTransitions(res, n)
	for j, r := range each {
		if len(r) == 1 && r[0] == int64(compactSettleDoneBefore) {
			each[j] = replyDone // done before by the same claim: as done
		}
	}
	return each, err
}

// splitByRef returns the places in 0..n-1 whose fence has a Ref (compact
// claims) and those whose has none.
func splitByRef(n int, fence func(j int) Fence) (compact, records []int) {
	for j := 0; j < n; j++ {
		if fence(j).Ref > 0 {
			compact = append(compact, j)
		} else {
			records = append(records, j)
		}
	}
	return compact, records
}

// compactIndexArgs returns the arguments of claim.lua that let it look in
// the index: the first 8 bytes of the record's digest, its index key and
// the start of the call record keys.
func (s *RedisStore) compactIndexArgs(id string) (d8, index, calls string) {
	if s.v3 != nil {
		var d [16]byte
		indexDigest(&d, id)
		index, calls = s.v3Names(s.key(id))
		return string(d[:8]), index, calls
	}
	e := s.entry(id)
	return string(e.d8[:]), e.key, s.callBase(s.key(id))
}

// keysOf returns the Redis keys of the records ids[i] for i in todo (see
// RedisStore.key), made in one allocation; the others are "".
func (s *RedisStore) keysOf(ids []string, todo []int) []string {
	keys := make([]string, len(ids))
	n := 0
	for _, i := range todo {
		n += len(s.prefix) + len(ids[i]) + 2
	}
	buf := make([]byte, 0, n)
	for _, i := range todo {
		buf = s.appendKey(buf, ids[i])
	}
	all, at := string(buf), 0
	for _, i := range todo {
		l := len(s.prefix) + len(ids[i]) + 2
		keys[i], at = all[at:at+l], at+l
	}
	return keys
}
