package idem

import (
	"bytes"
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"errors"
	"fmt"
	"math/bits"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Compact claims and markers: how a RedisStore keeps the claims of a batch
// without a Redis key each, and what a message handled that way leaves. See
// lua/compact_claim.lua for the layout.
var (
	//go:embed lua/compact_claim.lua
	compactClaimLua string
	//go:embed lua/compact_settle.lua
	compactSettleLua string
	//go:embed lua/compact_move.lua
	compactMoveLua string

	compactClaimScript  = redis.NewScript(compactClaimLua)
	compactSettleScript = redis.NewScript(compactSettleLua)
	compactMoveScript   = redis.NewScript(compactMoveLua)
)

// Defaults of the markers.
const (
	// DefaultMarkerRetention is how long a marker answers for a handled
	// message unless WithMarkerRetention says otherwise: 7 days.
	DefaultMarkerRetention = 7 * 24 * time.Hour
	// DefaultMarkerScale is how many markers (and compact claims) a
	// RedisStore's index is sized for unless WithMarkerScale says
	// otherwise: 2^21, about two million.
	DefaultMarkerScale = 1 << 21
	// MaxMarkerScale is the largest WithMarkerScale: 2^34, about 17 billion.
	MaxMarkerScale = 1 << 34
)

// markerFill is how many entries an index key holds when the store holds as
// many markers as its scale: a small hash Redis keeps as a listpack, which
// costs about 20 bytes an entry, and is quick to search.
const markerFill = 128

// WithMarkerRetention sets how long a message handled by Consume (or a
// claim made by BeginBatch with WithCompactClaims and completed with an
// empty result) is remembered: for that long a redelivery is answered
// "handled before" (MessageReplayed) instead of running again. Such a
// message leaves a marker, about 20 bytes in Redis (see WithMarkerScale),
// instead of a record. For as long as the retention, Begin and Do answer
// such a key as completed with an empty result; after the retention and
// within the marker retention they answer ErrResultExpired: the operation
// ran, its result is not kept. It must be at least the retention and at
// most MaxDuration. Default: 7 days (DefaultMarkerRetention), or the
// retention if that is longer. Applies to a Keeper.
func WithMarkerRetention(d time.Duration) Option {
	return Option{name: "WithMarkerRetention", to: toKeeper, set: func(s *settings) { s.policy.markerRetention, s.policy.markerSet = d, true }}
}

// WithMarkerScale sizes a RedisStore's index of compact claims and markers
// for about n of them held at once: the messages handled within the marker
// retention, and the claims in progress. The index is n/128 small hashes
// (rounded up to a power of two; on a Cluster at least one per slot, 16384),
// each kept by Redis in its compact encoding (listpack) while it holds no
// more than 512 entries: about 20 bytes per marker. A store that holds many
// more than n markers still answers right, but its hashes grow past the
// compact encoding and cost about 80 bytes per marker; one that holds far
// fewer pays the hashes' own overhead, about 100 bytes each. MarkerStats
// says how full the index is.
//
// Every RedisStore on a prefix must have the same scale: the first to claim
// records it in Redis (under prefix + "{layout}"), and a store with another
// scale, or made WithoutMarkers, is refused at its first call with
// ErrInvalidConfig. n must be 1 to MaxMarkerScale. Default:
// DefaultMarkerScale (about two million). Applies to a RedisStore.
func WithMarkerScale(n int64) Option {
	return Option{name: "WithMarkerScale", to: toStore, set: func(s *settings) { s.markerScale = n }}
}

// WithoutMarkers turns compact claims and markers off: Consume keeps each
// message's claim and outcome in a record of its own, as Begin does, kept
// for the retention; and a RedisStore made with it does not look for
// markers. A prefix is either one or the other: a RedisStore made
// WithoutMarkers on a prefix where markers are in use is refused at its
// first call with ErrInvalidConfig, and the other way round (see
// WithMarkerScale). Default: markers on. Applies to a Keeper and a
// RedisStore.
func WithoutMarkers() Option {
	return Option{name: "WithoutMarkers", to: toKeeper | toStore, set: func(s *settings) { s.noMarkers = true }}
}

// WithCompactClaims makes BeginBatch claim the keys compactly, as Consume
// does: a claim of a key that has no record is kept as an entry in an index
// and a place in one record of the call, and completing it with an empty
// result leaves a marker (see WithMarkerRetention) instead of a record.
// Claims made so share one lease: renewing one renews every one of them the
// call still holds. Completing one with a value, or recording a
// Checkpoint, first moves it to a record of its own (one round trip more).
// Without it (the default) BeginBatch keeps each claim in a record of its
// own. It has no effect on a Keeper made WithoutMarkers, or on a store that
// keeps no compact claims. Applies to BeginBatch.
func WithCompactClaims() Option {
	return Option{name: "WithCompactClaims", to: toBatch, set: func(s *settings) { s.compact = true }}
}

// ErrResultExpired reports a key whose operation completed and whose result
// is no longer kept: all that is left of it is a marker (see
// WithMarkerRetention), past the retention and within the marker retention.
// The operation must not run again, and there is nothing to replay.
var ErrResultExpired = errors.New("idem: the operation completed; its result is no longer kept")

// compactLayout is how a RedisStore lays its index of compact claims out.
type compactLayout struct {
	// scale is WithMarkerScale's n.
	scale int64
	// total is how many index keys there are in all: scale / markerFill,
	// rounded up to a power of two.
	total int64
	// perBase is how many index keys there are under one base: total on
	// one server; total / 16384 (at least one) under each slot's base on a
	// Cluster.
	perBase int64
	// perBaseArg is perBase as a script argument; sweepArg the entries of
	// one index key past which a claim may sweep it.
	perBaseArg, sweepArg string
	// cluster is set for a *redis.ClusterClient: each slot has its own
	// bases, so that a record and its index entry share a slot.
	cluster bool
}

func newCompactLayout(scale int64, client redis.Scripter) (*compactLayout, error) {
	if scale < 1 || scale > MaxMarkerScale {
		return nil, fmt.Errorf("%w: marker scale %d is not between 1 and %d", ErrInvalidConfig, scale, int64(MaxMarkerScale))
	}
	l := &compactLayout{scale: scale}
	l.total = 1 << bits.Len64(uint64((scale+markerFill-1)/markerFill-1))
	l.perBase = l.total
	if _, ok := client.(*redis.ClusterClient); ok {
		l.cluster = true
		l.perBase = max(1, l.total/redisClusterSlots)
	}
	fill := max(1, scale/(l.perBase*l.slotsUsed()))
	l.perBaseArg = strconv.FormatInt(l.perBase, 10)
	l.sweepArg = strconv.FormatInt(min(400, max(32, 2*fill)), 10)
	return l, nil
}

// slotsUsed is how many bases the index has: one, or one per Cluster slot.
func (l *compactLayout) slotsUsed() int64 {
	if l.cluster {
		return redisClusterSlots
	}
	return 1
}

// redisClusterSlots is the number of hash slots of a Redis Cluster.
const redisClusterSlots = 16384

// describe is the layout as the store records it in Redis.
func (l *compactLayout) describe() string {
	if l == nil {
		return "none"
	}
	return "markers v1 scale=" + strconv.FormatInt(l.scale, 10)
}

// bases returns the start of the index keys and of the call record keys of
// the records whose Redis key is recordKey: the store's own on one server,
// its slot's on a Cluster.
func (s *RedisStore) bases(recordKey string) (index, calls string) {
	if !s.compact.cluster {
		return s.prefix + "m:", s.prefix + "c:"
	}
	tag := slotTag(keySlot(recordKey))
	return s.prefix + "{" + tag + "}m:", s.prefix + "{" + tag + "}c:"
}

// indexField writes the field of record id in the index into dst: 8 bytes
// of the digest the id is (a Keeper's ids are 16 bytes of SHA-256 in
// base64url), or of the SHA-256 of an id of another form.
func indexField(dst *[8]byte, id string) {
	var raw [16]byte
	if len(id) == idLen {
		if _, err := base64.RawURLEncoding.Decode(raw[:], []byte(id)); err == nil {
			copy(dst[:], raw[:8])
			return
		}
	}
	sum := sha256.Sum256([]byte(id))
	copy(dst[:], sum[:8])
}

// indexKey returns the index key of the field f under base: the script's
// choice, (f[0]<<16 | f[1]<<8 | f[2]) modulo the keys under a base.
func (l *compactLayout) indexKey(base string, f *[8]byte) string {
	n := (int64(f[0])<<16 | int64(f[1])<<8 | int64(f[2])) % l.perBase
	return base + strconv.FormatInt(n, 10)
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

// layoutGate records that a store has checked the layout in use on its
// prefix against its own.
type layoutGate struct {
	mu sync.Mutex
	ok bool
}

// layoutKey is where the layout in use on the store's prefix is recorded.
func (s *RedisStore) layoutKey() string { return s.prefix + "{layout}" }

// checkLayout makes sure, once per store, that every store on the prefix
// uses the same layout: it records the store's own under prefix +
// "{layout}" if there is none, and refuses to go on with ErrInvalidConfig if
// another is recorded there.
func (s *RedisStore) checkLayout(ctx context.Context) error {
	g := &s.layout
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ok {
		return nil
	}
	c, ok := s.client.(redis.Cmdable)
	if !ok {
		g.ok = true // a client that runs scripts only: nothing to check with
		return nil
	}
	key, want := s.layoutKey(), s.compact.describe()
	got, err := c.Get(ctx, key).Result()
	if errors.Is(err, redis.Nil) {
		// None is recorded: record this one, unless another store just did.
		got, err = c.SetArgs(ctx, key, want, redis.SetArgs{Mode: "NX", Get: true}).Result()
		switch {
		case errors.Is(err, redis.Nil):
			got, err = want, nil
		case err != nil && redis.HasErrorPrefix(err, "READONLY"):
			return nil // a replica: its master records it; check again next time
		}
	}
	if err != nil {
		return err
	}
	if got != want {
		return fmt.Errorf("%w: the records under prefix %q are kept with %q (%s), this store with %q: give every store on a prefix the same WithMarkerScale, or WithoutMarkers on all of them",
			ErrInvalidConfig, s.prefix, got, key, want)
	}
	g.ok = true
	return nil
}

// compactHead is what compact_claim.lua's call for some records of one base
// is given before the records' own arguments.
func (s *RedisStore) compactHead(req *BatchClaimRequest, recordKey string) []any {
	index, calls := s.bases(recordKey)
	callKeep := req.Lease + max(req.Keep-req.Lease, req.MarkerRetention)
	mode := "r"
	if req.Compact {
		mode = "c"
	}
	return []any{
		req.Attempt, millis(req.Lease), millis(req.Keep), millis(callKeep),
		millis(orForever(req.Retention)), millis(orForever(req.MarkerRetention)),
		index, s.compact.perBaseArg, calls, s.compact.sweepArg, mode,
	}
}

// orForever is d, or MaxDuration for zero: a marker of a request that says
// no retention answers as long as it is kept.
func orForever(d time.Duration) time.Duration {
	if d <= 0 {
		return MaxDuration
	}
	return d
}

// claimCompact is ClaimBatch on a store that keeps compact claims: the
// records and the index are looked at, and new claims are kept compactly if
// req asks for it; todo are the records to ask for, out their answers.
func (s *RedisStore) claimCompact(ctx context.Context, req *BatchClaimRequest, todo []int, out []BatchClaimReply) {
	if len(todo) == 0 {
		return
	}
	if err := s.checkLayout(ctx); err != nil {
		for _, i := range todo {
			out[i].Err = err
		}
		return
	}
	fields := make([]byte, 8*len(req.IDs))
	for _, i := range todo {
		indexField((*[8]byte)(fields[8*i:]), req.IDs[i])
	}
	fieldStr := string(fields)
	st := &batchStep{
		op: "claim", script: compactClaimScript, src: compactClaimLua, split: splitCompactClaims,
		key: func(i int) string { return s.key(req.IDs[i]) },
		answer: func(i int, res []any, err error) {
			out[i].Reply, out[i].Err = batchClaimAnswer(res, err)
		},
		wrote: func(res []any) bool { c := replyCode(res); return c == 1 || c == 6 },
	}
	if s.durable == nil {
		st.op = ""
	}
	calls := s.batchCalls(st, todo)
	for j := range calls {
		c := &calls[j]
		c.step = st
		c.args = append(make([]any, 0, 11+2*len(c.records)), s.compactHead(req, c.keys[0])...)
		for _, i := range c.records {
			c.args = append(c.args, fieldStr[8*i:8*i+8])
		}
		if req.Fingerprints != nil {
			for _, i := range c.records {
				c.args = append(c.args, req.Fingerprints[i])
			}
		}
	}
	s.runCalls(ctx, calls)
}

// batchClaimAnswer reads one record's part of the reply of compact_claim.lua
// or batch_claim.lua, as splitCompactClaims or splitClaims cut it: the
// answers of claimReply, {6 or 10, token, place} for a compact claim, {7,
// error} for a write Redis refused.
func batchClaimAnswer(res []any, err error) (ClaimReply, error) {
	if err != nil {
		return ClaimReply{}, err
	}
	switch replyCode(res) {
	case 6, 10:
		if len(res) == 3 {
			tok, ok1 := res[1].(int64)
			place, ok2 := res[2].(int64)
			if ok1 && ok2 && tok > 0 && place > 0 {
				return ClaimReply{Status: StatusClaimed, Token: tok, Attempt: 1, Ref: int(place)}, nil
			}
		}
	case 7:
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
// those of claimReply, {6 or 10, token, place} for a compact claim, {8 or
// 9, token} for a marker, {7, error} for a write Redis refused.
func splitCompactClaims(res []any, n int) ([][]any, error) {
	if len(res) < 2 {
		return nil, unexpected(res)
	}
	tok, ok := res[len(res)-2].(int64)
	if !ok {
		return nil, unexpected(res[len(res)-2:])
	}
	res = res[:len(res)-2]
	each := make([][]any, 0, n)
	for p := 0; p < len(res); {
		code, _ := res[p].(int64)
		switch code {
		case 6:
			each = append(each, []any{int64(6), tok, int64(len(each) + 1)})
			p++
			continue
		case 10:
			if p+3 > len(res) {
				return nil, unexpected(res[p:])
			}
			each = append(each, res[p:p+3:p+3])
			p += 3
			continue
		case 7, 8, 9:
			if p+2 > len(res) {
				return nil, unexpected(res[p:])
			}
			each = append(each, res[p:p+2:p+2])
			p += 2
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
// the call record that holds them (on a Cluster, where every slot has its
// own, the token and the slot), in the order of their first record.
func (s *RedisStore) compactGroups(picks []int, fence func(j int) Fence) (groups [][]int) {
	type call struct {
		token int64
		slot  uint16
	}
	at := map[call]int{}
	for _, j := range picks {
		f := fence(j)
		c := call{token: f.Token}
		if s.compact.cluster {
			c.slot = keySlot(s.key(f.ID))
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
// when completing; their answers go into errs.
func (s *RedisStore) settleCalls(target string, keep time.Duration, groups [][]int, fence func(j int) Fence, errs []error) []batchCall {
	st := &batchStep{script: compactSettleScript, src: compactSettleLua, split: splitCompactTransitions, answer: transitionAnswers(errs)}
	if s.durable != nil && target == "C" {
		st.op = "complete"
	}
	calls := make([]batchCall, len(groups))
	for g, items := range groups {
		f := fence(items[0])
		key := s.key(f.ID)
		_, cbase := s.bases(key)
		args := make([]any, 0, 3+len(items))
		args = append(args, cbase+strconv.FormatInt(f.Token, 10), target, millis(keep))
		for _, j := range items {
			args = append(args, fence(j).Ref)
		}
		calls[g] = batchCall{records: items, keys: []string{key}, args: args, step: st}
	}
	return calls
}

// moveCalls returns the calls that renew (mode "E") the compact claims of
// each group's call, with lease and keeping the call record at least keep,
// or move them ("M") to records of their own kept for keep; their answers
// go into errs.
func (s *RedisStore) moveCalls(mode string, lease, keep time.Duration, groups [][]int, fence func(j int) Fence, errs []error) []batchCall {
	st := &batchStep{script: compactMoveScript, src: compactMoveLua, split: splitCompactTransitions, answer: transitionAnswers(errs)}
	if s.durable != nil && mode == "E" {
		st.op = "extend"
	}
	calls := make([]batchCall, len(groups))
	for g, items := range groups {
		f := fence(items[0])
		index, cbase := s.bases(s.key(f.ID))
		keys := make([]string, len(items))
		args := make([]any, 0, 7+2*len(items))
		args = append(args, cbase+strconv.FormatInt(f.Token, 10), f.Token, mode, millis(lease), millis(keep), index, s.compact.perBaseArg)
		for k, j := range items {
			fj := fence(j)
			keys[k] = s.key(fj.ID)
			var field [8]byte
			indexField(&field, fj.ID)
			args = append(args, fj.Ref, string(field[:]))
		}
		calls[g] = batchCall{records: items, keys: keys, args: args, step: st}
	}
	return calls
}

// splitCompactTransitions cuts a compact transition script's reply (1, 2,
// 0, or a reason, per claim) into the replies transitionReply reads.
func splitCompactTransitions(res []any, n int) ([][]any, error) {
	each, err := splitTransitions(res, n)
	for j, r := range each {
		if len(r) == 1 && r[0] == int64(2) {
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

// isEmptyResult reports whether env is the envelope of an empty result of
// Claim.Complete, which a compact claim keeps as a marker.
func isEmptyResult(env []byte) bool { return bytes.Equal(env, emptyBytes) }

// compactIndexArgs returns the arguments of claim.lua that let it look in the
// index: the record's field, its index key and the start of the call record
// keys; three empty strings for a store that keeps no compact claims.
func (s *RedisStore) compactIndexArgs(id string) (field, index, calls string) {
	if s.compact == nil {
		return "", "", ""
	}
	var f [8]byte
	indexField(&f, id)
	ibase, cbase := s.bases(s.key(id))
	return string(f[:]), s.compact.indexKey(ibase, &f), cbase
}

// moveToRecords moves compact claims to records of their own, kept for
// keep, with the lease they have: after that they are records like any
// other (Checkpoint, Extend, Complete). A claim kept in a record already is
// answered nil.
func (s *RedisStore) moveToRecords(ctx context.Context, claims []Fence, keep time.Duration) []error {
	errs := make([]error, len(claims))
	fence := func(j int) Fence { return claims[j] }
	compact, _ := splitByRef(len(claims), fence)
	if s.compact != nil {
		s.runCalls(ctx, s.moveCalls("M", 0, keep, s.compactGroups(compact, fence), fence, errs))
	}
	return errs
}
