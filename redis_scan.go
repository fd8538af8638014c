package idem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"iter"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// ScanOptions chooses the records Scan lists and how much it asks of Redis at
// once. The zero value lists every record under the store's prefix, 100 keys
// at a time.
type ScanOptions struct {
	// State keeps only the records in this state: StatePending lists the
	// operations in progress and the abandoned claims (LeaseLeft <= 0).
	// Default: StateAbsent, which keeps every record.
	State RecordState
	// Batch is the COUNT of each SCAN call and the most records read in one
	// round trip. Default: DefaultScanBatch (100); at most MaxScanBatch.
	Batch int
	// Limit ends the listing after this many records. Default: 0, no limit.
	Limit int
	// PrefixMatch, when set, is a Redis glob pattern that stands in for the
	// store's prefix, such as "idem-demo:*:" for the records of every
	// prefix it matches; each Record's Key shows its own prefix, and only a
	// Keeper with that prefix can inspect or forget it by ID. It may not
	// contain '{' or '}'. Default: the store's prefix, matched exactly.
	PrefixMatch string
}

// Scan lists the store's records; see Keeper.Scan.
func (s *redisStore) Scan(ctx context.Context, opts ScanOptions) iter.Seq2[Record, error] {
	return func(yield func(Record, error) bool) {
		sc, err := s.newScanner(opts)
		if err != nil {
			yield(Record{}, err)
			return
		}
		nodes, err := s.scanNodes(ctx)
		if err == nil {
			err = s.layoutReady(ctx)
		}
		if err != nil {
			yield(Record{}, err)
			return
		}
		// The call records: their base and 6 bytes ('*', not six '?':
		// miniredis's '?' is a UTF-8 character).
		calls := sc.prefix + "c3:*"
		if s.compact.cluster {
			calls = sc.prefix + "{*}c3:*"
		}
		for _, n := range nodes {
			if !sc.walk(ctx, n, sc.match, sc.read, yield) || !sc.walk(ctx, n, calls, sc.readCalls, yield) {
				return
			}
		}
	}
}

// scanClient is a connection to one server that Scan can walk.
type scanClient interface {
	redis.Scripter
	Scan(ctx context.Context, cursor uint64, match string, count int64) *redis.ScanCmd
	HGet(ctx context.Context, key, field string) *redis.StringCmd
	Pipeline() redis.Pipeliner
}

var (
	_ scanClient = (*redis.Client)(nil)
	_ scanClient = (*redis.Conn)(nil)
)

// scanner is one listing: its options and how many records it may still
// yield.
type scanner struct {
	opts ScanOptions
	// prefix is the pattern of the prefix; match that of the keys of
	// records, whose ids placed or not (see redisStore.key) read picks out
	// of it.
	prefix, match string
	// left is how many records may still be yielded; -1: no limit.
	left int
}

func (s *redisStore) newScanner(opts ScanOptions) (*scanner, error) {
	switch {
	case opts.Batch < 0 || opts.Batch > MaxScanBatch:
		return nil, fmt.Errorf("%w: scan batch %d is not between 1 and %d", ErrInvalidConfig, opts.Batch, MaxScanBatch)
	case opts.Limit < 0:
		return nil, fmt.Errorf("%w: scan limit %d is negative", ErrInvalidConfig, opts.Limit)
	case opts.State > StateReleased:
		return nil, fmt.Errorf("%w: scan state %s unknown", ErrInvalidConfig, opts.State)
	case strings.ContainsAny(opts.PrefixMatch, "{}"):
		return nil, fmt.Errorf("%w: prefix pattern %q holds '{' or '}'", ErrInvalidConfig, opts.PrefixMatch)
	}
	if opts.Batch == 0 {
		opts.Batch = DefaultScanBatch
	}
	prefix := opts.PrefixMatch
	if prefix == "" {
		prefix = escapeGlob(s.prefix)
	}
	sc := &scanner{opts: opts, prefix: prefix, match: prefix + "{*", left: -1}
	if opts.Limit > 0 {
		sc.left = opts.Limit
	}
	return sc, nil
}

// escapeGlob escapes the characters that Redis's glob patterns give a
// meaning to, so that s matches itself only.
func escapeGlob(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if strings.IndexByte(`*?[]\`, s[i]) >= 0 {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// scanNodes returns a client of every server that holds records, in the
// order of their addresses.
func (s *redisStore) scanNodes(ctx context.Context) ([]scanClient, error) {
	switch c := s.client.(type) {
	case *redis.ClusterClient:
		return eachNode(ctx, c.ForEachMaster)
	case *redis.Ring:
		return eachNode(ctx, c.ForEachShard)
	case *redis.AutoPipeliner:
		// On a ClusterClient it would scan one node: refused on any client.
	case scanClient:
		return []scanClient{c}, nil
	}
	return nil, fmt.Errorf("idem: scan: client %T cannot list records (use a *redis.Client, *redis.ClusterClient or *redis.Ring): %w", s.client, errors.ErrUnsupported)
}

// eachNode gathers the clients forEach visits (ForEachMaster, ForEachShard).
func eachNode(ctx context.Context, forEach func(context.Context, func(context.Context, *redis.Client) error) error) ([]scanClient, error) {
	var (
		mu    sync.Mutex
		nodes []*redis.Client
	)
	err := forEach(ctx, func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		nodes = append(nodes, c)
		mu.Unlock()
		return nil
	})
	if err != nil {
		return nil, storeError(ctx, "scan: listing the nodes", err)
	}
	slices.SortFunc(nodes, func(a, b *redis.Client) int { return cmp.Compare(a.Options().Addr, b.Options().Addr) })
	out := make([]scanClient, len(nodes))
	for i, n := range nodes {
		out[i] = n
	}
	return out, nil
}

// walk lists the keys of one server that match, and has read yield what
// they hold; it returns false when the listing must end.
func (sc *scanner) walk(ctx context.Context, node scanClient, match string,
	read func(context.Context, scanClient, []string, func(Record, error) bool) bool, yield func(Record, error) bool) bool {
	var cursor uint64
	for {
		keys, next, err := node.Scan(ctx, cursor, match, int64(sc.opts.Batch)).Result()
		if err != nil {
			yield(Record{}, storeError(ctx, "scan", err))
			return false
		}
		for chunk := range slices.Chunk(keys, sc.opts.Batch) {
			if !read(ctx, node, chunk, yield) {
				return false
			}
		}
		if next == 0 {
			return true
		}
		cursor = next
	}
}

// read reads the records at keys in one round trip and yields those that
// State keeps; it returns false when the listing must end.
func (sc *scanner) read(ctx context.Context, node scanClient, keys []string, yield func(Record, error) bool) bool {
	keys = slices.DeleteFunc(slices.Clone(keys), func(k string) bool { return checkRecordID(idOfKey(k)) != nil })
	cmds, err := inspectEach(ctx, node, keys)
	if err != nil {
		yield(Record{}, storeError(ctx, "scan", err))
		return false
	}
	for i, key := range keys {
		r, err := readScanned(key, cmds[i])
		if !sc.give(r, err, yield) {
			return false
		}
	}
	return true
}

// give yields r, or err, unless r is absent (gone since SCAN listed it) or
// not in the state asked for; it returns false when the listing must end.
func (sc *scanner) give(r Record, err error, yield func(Record, error) bool) bool {
	if err == nil && (r.State == StateAbsent || sc.opts.State != StateAbsent && r.State != sc.opts.State) {
		return true
	}
	if !yield(r, err) {
		return false
	}
	if sc.left > 0 {
		if sc.left--; sc.left == 0 {
			return false
		}
	}
	return true
}

// readCalls reads the call records at keys, with Redis's clock, in one
// round trip, and yields for each the Records of its compact claims and
// markers, a Record for each state; it returns false when the listing must
// end.
func (sc *scanner) readCalls(ctx context.Context, node scanClient, keys []string, yield func(Record, error) bool) bool {
	if len(keys) == 0 {
		return true
	}
	pipe := node.Pipeline()
	now := pipe.Time(ctx)
	gets := make([]*redis.StringCmd, len(keys))
	ttls := make([]*redis.DurationCmd, len(keys))
	for i, k := range keys {
		gets[i], ttls[i] = pipe.Get(ctx, k), pipe.PTTL(ctx, k)
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) && now.Err() != nil {
		yield(Record{}, storeError(ctx, "scan", err))
		return false
	}
	at := now.Val()
	for i, key := range keys {
		v, err := gets[i].Result()
		if errors.Is(err, redis.Nil) {
			continue // gone since SCAN listed it
		}
		var recs []Record
		if err == nil {
			recs, err = readCall(key, v, ttls[i].Val(), at)
		}
		if err != nil {
			if !sc.give(Record{Key: key}, fmt.Errorf("idem: scan: %s: %w", key, err), yield) {
				return false
			}
			continue
		}
		for _, r := range recs {
			if !sc.give(r, nil, yield) {
				return false
			}
		}
	}
	return true
}

// readCall reads the call record v at key (see format.go, "The v3
// layout"), whose PTTL is ttl, at Redis's time now: a Record for each
// state its places are in, pending, completed (markers) and released, in
// that order.
func readCall(key, v string, ttl time.Duration, now time.Time) ([]Record, error) {
	c, ok := parseV3Call(v)
	if !ok {
		return nil, fmt.Errorf("%w: call record %.40q", ErrCorrupt, v)
	}
	return readV3Call(key, c, ttl, now)
}

// readV3Call is readCall of the v3 call record c at key (see format.go),
// whose name holds its token's low 48 bits.
func readV3Call(key string, c v3Call, ttl time.Duration, now time.Time) ([]Record, error) {
	if len(key) < 6 {
		return nil, fmt.Errorf("%w: v3 call record key %q", ErrCorrupt, key)
	}
	return callRecords(key, v3WholeToken(be48(key[len(key)-6:]), now.UnixMicro()), c.fpw > 0, c.until, c.done, c.states, ttl, now), nil
}

// callRecords is a Record for each state the places of a call record are
// in, pending, completed (markers) and released, in that order.
func callRecords(key string, tok int64, fp bool, until, done int64, states string, ttl time.Duration, now time.Time) []Record {
	base := Record{
		Key: key, Token: tok, Attempt: 1, Compact: true, Fingerprint: fp,
		ExpiresIn: ttl, Age: max(0, now.Sub(time.UnixMicro(tok))), ReadAt: now,
	}
	var out []Record
	for _, st := range []struct {
		b     byte
		state RecordState
	}{{'P', StatePending}, {'C', StateCompleted}, {'R', StateReleased}} {
		n := strings.Count(states, string(st.b))
		if n == 0 {
			continue
		}
		r := base
		r.State, r.Claims = st.state, n
		switch st.state {
		case StatePending:
			r.LeaseLeft = time.UnixMicro(until).Sub(now)
		case StateCompleted:
			r.Stored, r.CompletedAgo = StoredBytes, max(0, now.Sub(time.UnixMicro(done)))
		}
		out = append(out, r)
	}
	return out
}

// idOfKey returns the id of a record key (see redisStore.key), or "".
func idOfKey(key string) string {
	n := len(key)
	if n >= idLen+2 && key[n-1] == '}' && key[n-idLen-2] == '{' {
		return key[n-idLen-1 : n-1]
	}
	const digest = idLen - placedTagLen
	if n < idLen+2 || key[n-digest-1] != '}' || key[n-idLen-2] != '{' {
		return ""
	}
	if id := key[n-digest:] + key[n-idLen-1:n-digest-1]; placedID(id) {
		return id
	}
	return ""
}

// inspectEach runs inspect.lua on every key in one pipeline. If the server
// has lost the script, it loads it and runs the pipeline once more. An error
// Redis answered for one key stays in its command; any other error is the
// batch's.
func inspectEach(ctx context.Context, node scanClient, keys []string) ([]*redis.Cmd, error) {
	cmds, err := pipeInspect(ctx, node, keys)
	if err != nil && slices.ContainsFunc(cmds, func(c *redis.Cmd) bool { return redis.HasErrorPrefix(c.Err(), "NOSCRIPT") }) {
		if err = inspectScript.Load(ctx, node).Err(); err == nil {
			cmds, err = pipeInspect(ctx, node, keys)
		}
	}
	var reply redis.Error
	if err != nil && !errors.As(err, &reply) {
		return nil, err
	}
	return cmds, nil
}

func pipeInspect(ctx context.Context, node scanClient, keys []string) ([]*redis.Cmd, error) {
	if len(keys) == 0 {
		return nil, nil
	}
	pipe := node.Pipeline()
	cmds := make([]*redis.Cmd, len(keys))
	for i, k := range keys {
		cmds[i] = inspectScript.EvalSha(ctx, pipe, []string{k})
	}
	_, err := pipe.Exec(ctx)
	return cmds, err
}

// readScanned turns the reply of inspect.lua for key into a Record.
func readScanned(key string, cmd *redis.Cmd) (Record, error) {
	id := idOfKey(key)
	res, err := cmd.Slice()
	if err != nil {
		return Record{ID: id, Key: key}, fmt.Errorf("idem: scan: %s: %w", key, err)
	}
	code, r, err := parseRecordReply(id, key, res)
	if err == nil && code != recordNone && code != recordDone {
		err = unexpected(res)
	}
	return r, err
}
