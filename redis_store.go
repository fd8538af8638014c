package idem

import (
	"context"
	_ "embed"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// The scripts, one per state transition: each is its file in lua/ after the
// definitions of lua/format.lua and lua/lib.lua it uses (see luaSource),
// wrapped once in a redis.Script: Run sends EVALSHA and falls back to EVAL
// on NOSCRIPT.
var (
	//go:embed lua/claim.lua
	claimBody string
	//go:embed lua/complete.lua
	completeBody string
	//go:embed lua/release.lua
	releaseBody string
	//go:embed lua/extend.lua
	extendBody string

	claimScript    = newLuaScript("claim", claimBody)
	completeScript = newLuaScript("complete", completeBody)
	releaseScript  = newLuaScript("release", releaseBody)
	extendScript   = newLuaScript("extend", extendBody)
)

// The go-redis clients redisStore works with.
var (
	_ redis.Scripter = (*redis.Client)(nil)
	_ redis.Scripter = (*redis.ClusterClient)(nil)
	_ redis.Scripter = (*redis.Ring)(nil)
	_ redis.Scripter = (*redis.Conn)(nil)
	_ recordStore    = (*redisStore)(nil)
)

// redisStore is a store on Redis. Each record is one Redis string under
// prefix + "{" + id + "}", or for an id placed by WithScopeShards
// prefix + "{" + shard + "}" + digest: the hash tag keeps every key of a
// record in one Cluster slot. Beside them, prefix + "layout" says how the
// prefix's keys are written (the layout and WithScopeShards' n), so that a
// Keeper that would write them otherwise is refused: written by the first
// Keeper that writes under the prefix, read by each store once, never
// expiring. It uses the client it is given and never dials its own. It is
// safe for concurrent use.
type redisStore struct {
	client redis.Scripter
	prefix string
	// durable is the setting of WithReplicas; nil: no waiting.
	durable *durability
	// boxes holds the script arguments of the durations the store is given.
	boxes millisBoxes
	// compact is the layout of the index of compact claims and markers,
	// which every claim looks at; layout holds off its first use until it
	// is known (see layoutReady). noCompact is set for a store made
	// WithoutMarkers: it keeps no compact claims of its own.
	compact   *compactLayout
	layout    layoutGate
	noCompact bool
	// prefixGate holds the prefix's record, how its keys are written,
	// once read (see checkPlacement).
	prefixGate prefixGate
	// v3 is where the store keeps its compact claims (redis_v3.go).
	v3 *v3Layout
}

// WithPrefix sets the start of every Redis key the store writes, so that
// several applications can share one Redis. It may not contain '{' or '}'.
// Default: "idem:" (DefaultPrefix). Applies to a Keeper (NewRedis).
func WithPrefix(prefix string) Option {
	return Option{name: "WithPrefix", to: toStore, set: func(s *settings) { s.prefix = prefix }}
}

// openRedisStore returns a store on client, which may be any go-redis client
// that runs scripts: *redis.Client, *redis.ClusterClient, *redis.Ring, a
// failover client, or an AutoPipeliner. A nil client or a prefix holding '{'
// or '}' is refused with ErrInvalidConfig.
//
// Options that apply to a redisStore: WithPrefix ("idem:"), WithReplicas
// (no waiting) and WithoutMarkers (compact claims on); others are refused with ErrInvalidConfig.
//
// With an AutoPipeliner (client.AutoPipelineWithOptions; docs/benchmarks.md
// has a setting that suits idem), concurrent calls share pipelines. Three things
// hold then: a call's deadline is not honoured once its command is queued,
// so bound calls with the client's ReadTimeout and WriteTimeout; a batch that
// fails on a network error is sent again whole, which every script
// tolerates; and WithReplicas cannot be used. Call LoadScripts at start, so
// that the first batches do not all fall back to EVAL.
func openRedisStore(client redis.Scripter, opts ...Option) (*redisStore, error) {
	s := defaultSettings()
	if err := s.apply(toStore, "NewRedisStore", opts); err != nil {
		return nil, err
	}
	return newRedisStore(client, &s)
}

// newRedisStore returns a redisStore with the store's part of s.
func newRedisStore(client redis.Scripter, s *settings) (*redisStore, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: nil redis client", ErrInvalidConfig)
	}
	if strings.ContainsAny(s.prefix, "{}") {
		return nil, fmt.Errorf("%w: prefix %q holds '{' or '}', which would break the hash tag", ErrInvalidConfig, s.prefix)
	}
	if s.replicas != nil {
		if err := s.replicas.check(client); err != nil {
			return nil, err
		}
	}
	_, cluster := client.(*redis.ClusterClient)
	st := &redisStore{client: client, prefix: s.prefix, durable: s.replicas, compact: &compactLayout{cluster: cluster}, noCompact: s.noMarkers}
	st.v3 = newV3Layout(st)
	return st, nil
}

// NewRedis returns a Keeper that keeps its records on the Redis client
// reaches: a *redis.Client, *redis.ClusterClient, *redis.Ring, *redis.Conn,
// or an AutoPipeliner on one of them. Each step on a record is one Lua
// script and one round trip (one per Redis node, for a batch). It sends
// nothing: the first call, or LoadScripts, reads the prefix's record.
//
// Options and their defaults: WithPrefix ("idem:", DefaultPrefix),
// WithLease (30s, DefaultLease), WithRetention (24h, DefaultRetention),
// WithErrorRetention (the retention), WithMarkerRetention (7 days,
// DefaultMarkerRetention), WithoutMarkers (markers on), WithCodec
// (msgpack), WithCoalescing (off), WithWait (0), WithClock
// (time.Now), WithScopeShards (ClusterScopeShards on a
// *redis.ClusterClient, else 0), WithReplicas (no waiting),
// WithReplayCache (none), WithObserver (none). Invalid settings, and
// options that apply only to a call, are refused with ErrInvalidConfig.
func NewRedis(client redis.Scripter, opts ...Option) (*Keeper, error) {
	s := defaultSettings()
	if err := s.apply(toKeeper|toStore, "NewRedis", opts); err != nil {
		return nil, err
	}
	store, err := newRedisStore(client, &s)
	if err != nil {
		return nil, err
	}
	return buildKeeper(store, &s)
}

// RecordKey returns the Redis key under which the store keeps the record of
// (scope, key) for a Keeper without scope shards (WithScopeShards(0), or
// the default on one server or a Ring), for an operator or a test that
// looks at Redis directly. Record.Key (Keeper.Inspect) is any record's,
// whatever its Keeper's placement.
func (s *redisStore) RecordKey(scope, key string) string {
	return s.key(recordID(scope, key))
}

// key returns the Redis key of the record id: prefix + "{" + id + "}", or
// for a placed id (see WithScopeShards) prefix + "{" + its last 6
// characters + "}" + its first 16, so that the keys of a scope's shard
// share a hash tag.
func (s *redisStore) key(id string) string {
	var buf [128]byte
	return string(s.appendKey(buf[:0], id))
}

// appendKey appends the Redis key of the record id (see key) to b; it is
// len(s.prefix) + len(id) + 2 bytes long either way.
func (s *redisStore) appendKey(b []byte, id string) []byte {
	b = append(append(b, s.prefix...), '{')
	if placedID(id) {
		tag := idLen - placedTagLen
		return append(append(append(b, id[tag:]...), '}'), id[:tag]...)
	}
	return append(append(b, id...), '}')
}

// Claim implements recordStore.
func (s *redisStore) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	if !isBase64URL(req.Fingerprint) || !isBase64URL(req.Attempt) || req.Attempt == "" {
		return claimReply{}, fmt.Errorf("%w: fingerprint and attempt must be base64url", ErrInvalidConfig)
	}
	if err := s.layoutReady(ctx); err != nil {
		return claimReply{}, err
	}
	key, call := s.key(id), ""
	d8, index, calls := s.claimIndexArgs(id, key)
	indexArg, callsArg := s.nameArgs(index, calls)
	for asked := 0; ; asked++ {
		// The record key, its index key and, once the script has named it,
		// the call record of its entry: every key the script reads.
		args := append(claimScript.evalArgs(9), key, indexArg)
		if call != "" {
			args = append(args, call)
		}
		args[2] = len(args) - 3 // the number of keys
		args = append(args, req.Fingerprint, req.Attempt, s.boxes.millis(boxLease, req.Lease), s.boxes.millis(boxKeep, req.Keep), d8, callsArg)
		res, err := s.eval(ctx, claimScript, args).Result()
		if err != nil {
			return claimReply{}, s.layoutError(err)
		}
		tok, ok := callAsked(res)
		if !ok {
			return claimAnswer(res)
		}
		if asked == maxCallAsks {
			return claimReply{}, fmt.Errorf("%w: the index entry of the key moved to another call %d times while it was claimed", ErrUnavailable, asked+1)
		}
		call = v3CallKey(calls, tok)
	}
}

// claimIndexArgs returns the arguments of claim.lua and the operator
// scripts that let them look in the index for the record id whose Redis
// key is key: the first 8 bytes of the id's index digest (an entry's
// digest and block hash), its index key and the start of its call record
// keys.
func (s *redisStore) claimIndexArgs(id, key string) (d8, index, calls string) {
	var d [16]byte
	indexDigest(&d, id)
	index, calls = s.v3Names(key)
	return string(d[:8]), index, calls
}

// maxCallAsks bounds how often Claim asks claim.lua again with the call
// record its answer named: once is enough unless another client keeps
// taking the entry over in between.
const maxCallAsks = 3

// callAsked reads claim.lua's answer {10, token}: the record's entry in the
// index is held by the call of token, whose call record the script must be
// given (declared) to read it.
func callAsked(res any) (int64, bool) {
	r, ok := res.([]any)
	if !ok || len(r) != 2 || replyCode(r) != replyAskAgain {
		return 0, false
	}
	tok, ok := r[1].(int64)
	return tok, ok && tok > 0
}

// claimAnswer reads what claim.lua answered: a new claim's token, a
// completed record, the lease left of another attempt (negated), or a table.
func claimAnswer(res any) (claimReply, error) {
	switch r := res.(type) {
	case int64:
		if r < 0 {
			return claimReply{Status: statusInProgress, LeaseLeft: time.Duration(-r) * time.Millisecond}, nil
		}
		if r > 0 {
			return claimReply{Status: statusClaimed, Token: r, Attempt: 1}, nil
		}
	case string:
		return parseCompleted(r)
	case []any:
		return parseClaimReply(r)
	}
	return claimReply{}, unexpected(res)
}

// parseClaimReply reads a table claim.lua answered.
func parseClaimReply(res []any) (claimReply, error) {
	switch replyCode(res) {
	case claimExisting:
		if len(res) == 4 || len(res) == 5 {
			tok, ok1 := res[1].(int64)
			n, ok2 := res[2].(int64)
			rec, ok3 := res[3].(int64)
			if ok1 && ok2 && ok3 {
				return withCheckpoints(claimReply{Status: statusClaimed, Token: tok, Attempt: int(n), Recovered: rec == 1}, res[4:])
			}
		}
	case claimMismatch:
		return claimReply{Status: statusMismatch}, nil
	case replyNotOurs:
		return claimReply{}, corrupt(res)
	case claimCallMissing:
		if len(res) == 1 {
			return claimReply{}, errCallMissing
		}
	case claimMarker, claimMarkerExpired:
		// A marker: {code, token}; or {code, token, attempt} for a record
		// whose result is a marker's.
		attempt, tok, ok := int64(1), int64(0), len(res) == 2 || len(res) == 3
		if ok && len(res) == 3 {
			attempt, ok = res[2].(int64)
		}
		if ok {
			tok, ok = res[1].(int64)
		}
		if ok && attempt >= 1 {
			if res[0] == int64(claimMarkerExpired) {
				return claimReply{Status: statusResultExpired, Token: tok, Attempt: int(attempt), Marker: true}, nil
			}
			return claimReply{Status: statusCompleted, Token: tok, Attempt: int(attempt), Marker: true, Value: emptyBytes}, nil
		}
	}
	return claimReply{}, unexpected(res)
}

// errCallMissing answers a claim whose index entry is younger than a call
// record lives and whose call record is missing: the entry is not stale,
// its call record is elsewhere (its slot migrates) or was lost, so the key
// is not claimed.
var errCallMissing = fmt.Errorf("%w: the call record of the key's index entry is missing (is its slot migrating?)", ErrUnavailable)

// Complete implements recordStore. A Complete that finds the record completed by
// the same token already (a retried call, or a second Complete of one claim)
// succeeds and writes nothing: the record keeps the first result and its
// retention, and stored is false.
func (s *redisStore) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (stored bool, err error) {
	return s.completeOnce(ctx, id, token, value, keep)
}

// completeOnce is Complete, and reports whether this call stored value:
// false when the record was completed by token already, and holds what that
// completion stored. (A call whose first run stored value and whose reply
// was lost, sent again by go-redis, reports false too.)
func (s *redisStore) completeOnce(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (stored bool, err error) {
	args := completeScript.evalArgs(4, s.key(id))
	args = append(args, token, strconv.FormatInt(token, 36), s.boxes.millis(boxRetention, keep), value)
	res, err := s.eval(ctx, completeScript, args).Result()
	if err != nil {
		return false, err
	}
	switch res {
	case int64(transitionDone):
		return true, nil
	case int64(completeDoneBefore):
		return false, nil
	case int64(transitionLost):
		return false, ErrLeaseLost
	}
	if r, ok := res.([]any); ok {
		return false, transitionReply(r)
	}
	return false, unexpected(res)
}

// Release implements recordStore.
func (s *redisStore) Release(ctx context.Context, id string, token int64, keep time.Duration) error {
	args := releaseScript.evalArgs(2, s.key(id))
	return s.transition(ctx, releaseScript, append(args, token, s.boxes.millis(boxKeep, keep)))
}

// Extend implements recordStore.
func (s *redisStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	args := extendScript.evalArgs(3, s.key(id))
	return s.transition(ctx, extendScript, append(args, token, s.boxes.millis(boxLease, lease), s.boxes.millis(boxKeep, keep)))
}

// transition runs a script that answers 1 (done), 0 (lease lost) or {5,
// reason} (corrupt).
func (s *redisStore) transition(ctx context.Context, sc *luaScript, args []any) error {
	res, err := s.eval(ctx, sc, args).Result()
	if err != nil {
		return err
	}
	switch res {
	case int64(transitionDone):
		return nil
	case int64(transitionLost):
		return ErrLeaseLost
	}
	if r, ok := res.([]any); ok {
		return transitionReply(r)
	}
	return unexpected(res)
}

// transitionReply reads what a script that answers {1, ...}, {0} or
// {5, reason} answered.
func transitionReply(res []any) error {
	switch replyCode(res) {
	case transitionDone:
		return nil
	case transitionLost:
		return ErrLeaseLost
	case replyNotOurs:
		return corrupt(res)
	}
	return unexpected(res)
}

// processor is a client that sends a command it is given: every go-redis
// client is one.
type processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// eval runs sc with args, which sc.evalArgs began, as Script.Run does
// (EVALSHA, then EVAL on NOSCRIPT), and with WithReplicas, for the steps
// that need it, pipelines WAIT after it. It sends args as they are when it
// can, rather than have go-redis copy them into a command of its own.
func (s *redisStore) eval(ctx context.Context, sc *luaScript, args []any) *redis.Cmd {
	if s.durable != nil {
		if op := waitsAfter(sc); op != "" {
			keys, rest := evalKeys(args)
			return s.durable.run(ctx, s.client, op, sc, keys, rest...)
		}
	}
	p, ok := s.client.(processor)
	if !ok {
		keys, rest := evalKeys(args)
		return sc.Run(ctx, s.client, keys, rest...)
	}
	cmd := process(ctx, p, args)
	if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		args[0], args[1] = "eval", sc.srcArg
		cmd = process(ctx, p, args)
	}
	return cmd
}

// evalKeys splits the script call args, which evalArgs began, into its
// keys and its arguments.
func evalKeys(args []any) ([]string, []any) {
	n := args[2].(int)
	keys := make([]string, n)
	for i := range keys {
		keys[i] = args[3+i].(string)
	}
	return keys, args[3+n:]
}

// process sends the script call args (its key at 3) through p.
func process(ctx context.Context, p processor, args []any) *redis.Cmd {
	cmd := redis.NewCmd(ctx, args...)
	cmd.SetFirstKeyPos(3)
	_ = p.Process(ctx, cmd)
	return cmd
}

// millisBoxes holds the durations a store's scripts are given most, in
// milliseconds, boxed for the script's arguments: a Keeper passes the same
// lease, keep and retention on every call, which would otherwise be boxed
// (allocated) every time. A slot holds the last duration it was asked for.
type millisBoxes [3]atomic.Pointer[millisBox]

// The slots of millisBoxes.
const (
	boxLease = iota
	boxKeep
	boxRetention
)

type millisBox struct {
	d time.Duration
	v any // millis(d)
}

// millis returns millis(d), boxed, through the slot.
func (b *millisBoxes) millis(slot int, d time.Duration) any {
	if m := b[slot].Load(); m != nil && m.d == d {
		return m.v
	}
	m := &millisBox{d: d, v: millis(d)}
	b[slot].Store(m)
	return m.v
}

// LoadScripts loads the scripts and reads the prefix's record; see
// Keeper.LoadScripts.
func (s *redisStore) LoadScripts(ctx context.Context) error {
	for _, sc := range luaScripts {
		if err := sc.Load(ctx, s.client).Err(); err != nil {
			return fmt.Errorf("%w: loading scripts: %w", ErrUnavailable, err)
		}
	}
	if err := s.learnPrefix(ctx); err != nil {
		return storeError(ctx, "reading the prefix's record", err)
	}
	return nil
}

func replyCode(res []any) int64 {
	if len(res) == 0 {
		return -1
	}
	c, ok := res[0].(int64)
	if !ok {
		return -1
	}
	return c
}

func corrupt(res []any) error {
	if len(res) == 2 {
		if why, ok := res[1].(string); ok {
			return fmt.Errorf("%w: %s", ErrCorrupt, why)
		}
	}
	return ErrCorrupt
}

func unexpected(res any) error {
	return fmt.Errorf("%w: unexpected script reply %v", ErrCorrupt, res)
}

// isBase64URL reports whether s holds only base64url characters.
func isBase64URL(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// LoadScripts loads the Keeper's scripts into the script cache of the
// server its client reaches (of every node a ClusterClient knows). Calling
// it when the process starts is optional but spares the first calls a
// fallback, which matters with an AutoPipeliner, where a whole batch of
// calls would meet NOSCRIPT at once. Without it, a call whose EVALSHA is
// answered NOSCRIPT (a restart, a failover to a node that never saw the
// scripts, SCRIPT FLUSH) runs its script once by EVAL, which loads it
// again: one round trip more, once.
//
// It also reads the prefix's record, which is otherwise read on the first
// call, and writes it where there is none: a Keeper of another layout or
// placement (WithScopeShards) than the prefix's is refused then, with an
// error that wraps ErrInvalidConfig. Its other errors are a call's:
// ErrUnavailable when a server did not take a script or the prefix's record
// could not be read or written, and the caller's own cancellation.
func (k *Keeper) LoadScripts(ctx context.Context) error {
	rs, err := k.onRedis("LoadScripts")
	if err != nil {
		return err
	}
	return rs.LoadScripts(ctx)
}
