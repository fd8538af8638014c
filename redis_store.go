package idem

import (
	"context"
	_ "embed"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The scripts, one per state transition. Each is wrapped once in a
// redis.Script: Run sends EVALSHA and falls back to EVAL on NOSCRIPT.
var (
	//go:embed lua/claim.lua
	claimLua string
	//go:embed lua/complete.lua
	completeLua string
	//go:embed lua/release.lua
	releaseLua string
	//go:embed lua/extend.lua
	extendLua string

	claimScript    = redis.NewScript(claimLua)
	completeScript = redis.NewScript(completeLua)
	releaseScript  = redis.NewScript(releaseLua)
	extendScript   = redis.NewScript(extendLua)
)

// The go-redis clients RedisStore works with.
var (
	_ redis.Scripter = (*redis.Client)(nil)
	_ redis.Scripter = (*redis.ClusterClient)(nil)
	_ redis.Scripter = (*redis.Ring)(nil)
	_ redis.Scripter = (*redis.Conn)(nil)
	_ Store          = (*RedisStore)(nil)
)

// DefaultPrefix starts every Redis key of a RedisStore unless WithPrefix says
// otherwise.
const DefaultPrefix = "idem:"

// RedisStore is a Store on Redis. Each record is one Redis string under
// prefix + "{" + id + "}": the hash tag keeps every key of a record in one
// Cluster slot. It uses the client it is given and never dials its own. It is
// safe for concurrent use.
type RedisStore struct {
	client redis.Scripter
	prefix string
	// durable is the setting of WithReplicas; nil: no waiting.
	durable *durability
}

// WithPrefix sets the start of every Redis key the store writes, so that
// several applications can share one Redis. It may not contain '{' or '}'.
// Default: "idem:" (DefaultPrefix). Applies to a RedisStore.
func WithPrefix(prefix string) Option {
	return Option{name: "WithPrefix", to: toStore, set: func(s *settings) { s.prefix = prefix }}
}

// NewRedisStore returns a Store on client, which may be any go-redis client
// that runs scripts: *redis.Client, *redis.ClusterClient, *redis.Ring, a
// failover client, or an AutoPipeliner. A nil client or a prefix holding '{'
// or '}' is refused with ErrInvalidConfig.
//
// Options that apply to a RedisStore: WithPrefix ("idem:") and WithReplicas
// (no waiting); others are refused with ErrInvalidConfig.
//
// With an AutoPipeliner (client.AutoPipelineWithOptions; the README has a
// setting that suits idem), concurrent calls share pipelines. Three things
// hold then: a call's deadline is not honoured once its command is queued,
// so bound calls with the client's ReadTimeout and WriteTimeout; a batch that
// fails on a network error is sent again whole, which every script
// tolerates; and WithReplicas cannot be used. Call LoadScripts at start, so
// that the first batches do not all fall back to EVAL.
func NewRedisStore(client redis.Scripter, opts ...Option) (*RedisStore, error) {
	s := defaultSettings()
	if err := s.apply(toStore, "NewRedisStore", opts); err != nil {
		return nil, err
	}
	return newRedisStore(client, &s)
}

// newRedisStore returns a RedisStore with the store's part of s.
func newRedisStore(client redis.Scripter, s *settings) (*RedisStore, error) {
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
	return &RedisStore{client: client, prefix: s.prefix, durable: s.replicas}, nil
}

// NewRedis returns a Keeper on a RedisStore on client: NewRedisStore then
// New, each with the options that apply to it. Options that apply to
// neither are refused with ErrInvalidConfig.
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
// (scope, key), for an operator or a test that looks at Redis directly.
func (s *RedisStore) RecordKey(scope, key string) string {
	return s.key(recordID(scope, key))
}

// key returns the Redis key of the record id.
func (s *RedisStore) key(id string) string {
	return s.prefix + "{" + id + "}"
}

// Claim implements Store.
func (s *RedisStore) Claim(ctx context.Context, id string, req ClaimRequest) (ClaimReply, error) {
	if !isBase64URL(req.Fingerprint) || !isBase64URL(req.Attempt) || req.Attempt == "" {
		return ClaimReply{}, fmt.Errorf("%w: fingerprint and attempt must be base64url", ErrInvalidConfig)
	}
	res, err := s.runScript(ctx, claimScript, []string{s.key(id)},
		req.Fingerprint, req.Attempt, millis(req.Lease), millis(req.Keep)).Slice()
	if err != nil {
		return ClaimReply{}, err
	}
	return claimReply(res)
}

// claimReply reads what claim.lua, or one record of batch_claim.lua, answered.
func claimReply(res []any) (ClaimReply, error) {
	switch replyCode(res) {
	case 1:
		if len(res) == 4 || len(res) == 5 {
			tok, ok1 := res[1].(int64)
			n, ok2 := res[2].(int64)
			rec, ok3 := res[3].(int64)
			if ok1 && ok2 && ok3 {
				return withCheckpoints(ClaimReply{Status: StatusClaimed, Token: tok, Attempt: int(n), Recovered: rec == 1}, res[4:])
			}
		}
	case 2:
		if len(res) == 2 {
			if rec, ok := res[1].(string); ok {
				return parseCompleted(rec)
			}
		}
	case 3:
		if len(res) == 2 {
			if ms, ok := res[1].(int64); ok {
				return ClaimReply{Status: StatusInProgress, LeaseLeft: time.Duration(ms) * time.Millisecond}, nil
			}
		}
	case 4:
		return ClaimReply{Status: StatusMismatch}, nil
	case 5:
		return ClaimReply{}, corrupt(res)
	}
	return ClaimReply{}, unexpected(res)
}

// parseCompleted splits a completed record,
// "i1C" TOKEN ":" ATTEMPT ":" REC ":" UNTIL ":" ATTEMPT_ID ":" FP ":" PAYLOAD,
// whose header the script has already matched.
func parseCompleted(rec string) (ClaimReply, error) {
	r := ClaimReply{Status: StatusCompleted}
	rest, ok := strings.CutPrefix(rec, "i1C")
	var fields [6]string
	for i := 0; ok && i < len(fields); i++ {
		fields[i], rest, ok = strings.Cut(rest, ":")
	}
	if !ok {
		return r, fmt.Errorf("%w: completed record header", ErrCorrupt)
	}
	tok, err1 := strconv.ParseInt(fields[0], 10, 64)
	n, err2 := strconv.Atoi(fields[1])
	if err1 != nil || err2 != nil {
		return r, fmt.Errorf("%w: completed record header", ErrCorrupt)
	}
	r.Token, r.Attempt, r.Value = tok, n, []byte(rest)
	return r, nil
}

// Complete implements Store.
func (s *RedisStore) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) error {
	return s.transition(ctx, completeScript, id, token, value, millis(keep))
}

// Release implements Store.
func (s *RedisStore) Release(ctx context.Context, id string, token int64, keep time.Duration) error {
	return s.transition(ctx, releaseScript, id, token, millis(keep))
}

// Extend implements Store.
func (s *RedisStore) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	return s.transition(ctx, extendScript, id, token, millis(lease), millis(keep))
}

// transition runs a script that answers {1} (done), {0} (lease lost) or
// {5, reason} (corrupt).
func (s *RedisStore) transition(ctx context.Context, sc *redis.Script, id string, args ...any) error {
	res, err := s.runScript(ctx, sc, []string{s.key(id)}, args...).Slice()
	if err != nil {
		return err
	}
	return transitionReply(res)
}

// transitionReply reads what a script that answers {1, ...}, {0} or
// {5, reason} answered.
func transitionReply(res []any) error {
	switch replyCode(res) {
	case 1:
		return nil
	case 0:
		return ErrLeaseLost
	case 5:
		return corrupt(res)
	}
	return unexpected(res)
}

// runScript runs sc as Script.Run does (EVALSHA, then EVAL on NOSCRIPT), and
// with WithReplicas, for the steps that need it, pipelines WAIT after it.
func (s *RedisStore) runScript(ctx context.Context, sc *redis.Script, keys []string, args ...any) *redis.Cmd {
	if s.durable != nil {
		if op := waitsAfter(sc); op != "" {
			return s.durable.run(ctx, s.client, op, sc, keys, args...)
		}
	}
	return sc.Run(ctx, s.client, keys, args...)
}

// LoadScripts loads every script into the script cache of the server the
// client reaches; a ClusterClient loads them on every node it knows. Calling
// it when the process starts is optional but spares the first calls a
// fallback, which matters with an AutoPipeliner, where a whole batch of calls
// would meet NOSCRIPT at once.
//
// The store recovers by itself when Redis loses its scripts later (a restart,
// a failover to a node that never saw them, SCRIPT FLUSH): a call whose
// EVALSHA is answered NOSCRIPT runs its script once by EVAL, which also loads
// it again, so the call costs one more round trip and the next ones none. An
// EVAL that fails is the call's error; nothing is tried a third time.
func (s *RedisStore) LoadScripts(ctx context.Context) error {
	for _, sc := range []*redis.Script{claimScript, completeScript, releaseScript, extendScript, inspectScript, forgetScript,
		checkpointScript, batchClaimScript, batchCompleteScript, batchReleaseScript, batchExtendScript} {
		if err := sc.Load(ctx, s.client).Err(); err != nil {
			return fmt.Errorf("%w: loading scripts: %w", ErrUnavailable, err)
		}
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

func unexpected(res []any) error {
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
