package idem

import (
	"bytes"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// WithReplayCache keeps, in this process, up to maxEntries completed results
// taking up to maxBytes, so that a Begin or Do that would replay one of them
// is answered from memory, without a round trip, as the store would have
// answered: the same Value (each caller its own copy), Token and final
// error. Default: off.
//
// A result enters the cache when this Keeper stores it (Claim.Complete, Do;
// not a second Complete of a claim, which writes nothing) or replays it, and
// leaves it, least recently used first, to make room, when this Keeper
// forgets the key, or when it expires: at most maxAge after this process saw
// it, and never past the retention it was stored with (a replayed result,
// whose retention left is not known: the smaller of maxAge and the Keeper's
// retention). So a key that left the store otherwise (forgotten through
// another Keeper, deleted, evicted, expired early) may still be replayed
// from the cache for up to maxAge: choose maxAge as the longest such delay
// you accept (docs/core.md). Claims, operations in progress, mismatches,
// errors and another fingerprint than the entry's always go to the store;
// Consume neither reads nor fills the cache.
//
// maxEntries and maxBytes must be at least 1, and maxAge more than 0;
// otherwise NewRedis refuses them with ErrInvalidConfig. The bounds are
// split evenly among up to 16 shards (one per 128 entries); a result larger
// than its shard's share of maxBytes (counted as its Value, its id and
// fingerprint, and 128 bytes) is not cached. Applies to a Keeper.
func WithReplayCache(maxEntries int, maxBytes int64, maxAge time.Duration) Option {
	return Option{name: "WithReplayCache", to: toKeeper, set: func(s *settings) {
		s.replayCache = &replayCacheConfig{entries: maxEntries, bytes: maxBytes, age: maxAge}
	}}
}

// replayCacheConfig is what WithReplayCache set.
type replayCacheConfig struct {
	entries int
	bytes   int64
	age     time.Duration
}

// ReplayCacheStats counts what a Keeper's replay cache (WithReplayCache) did
// since the Keeper was made. All zero without the cache.
type ReplayCacheStats struct {
	// Hits counts calls answered from the cache.
	Hits uint64
	// Misses counts calls that looked in the cache and went to the store:
	// the key was not there, had expired, or had another fingerprint.
	Misses uint64
	// Entries and Bytes are what the cache holds now (Bytes as it is
	// counted against maxBytes).
	Entries int
	Bytes   int64
}

// ReplayCacheStats returns the counts of the Keeper's replay cache.
func (k *Keeper) ReplayCacheStats() ReplayCacheStats {
	if k.cache == nil {
		return ReplayCacheStats{}
	}
	return k.cache.stats()
}

// cacheEntryOverhead is what an entry is counted for beside its Value and id.
const cacheEntryOverhead = 128

// maxCacheShards is how many shards a large cache is split into, so that
// callers of different keys rarely meet on one lock.
const maxCacheShards = 16

// replayCache is an LRU of completed results per record id, in shards each
// with its own bounds. The zero value is not usable; see newReplayCache.
type replayCache struct {
	age          time.Duration
	shards       []cacheShard
	hits, misses atomic.Uint64
}

// cacheShard is one LRU: a map for lookups and a ring for recency, both
// guarded by mu.
type cacheShard struct {
	mu sync.Mutex
	m  map[string]*cacheEntry
	// root is the ring's sentinel: root.next is the most recently used.
	root                cacheEntry
	maxEntries, entries int
	maxBytes, bytes     int64
}

// cacheEntry is one completed result. Its fields other than prev and next
// are written before it is put in a shard and never after; value is never
// written, so readers share it outside the lock (Outcome.shared).
type cacheEntry struct {
	id, fp     string
	token      int64
	attempt    int
	kind       byte
	value      []byte
	expires    time.Time
	size       int64
	prev, next *cacheEntry
}

func (c *replayCacheConfig) validate() error {
	switch {
	case c.entries < 1:
		return fmt.Errorf("%w: replay cache of %d entries", ErrInvalidConfig, c.entries)
	case c.bytes < 1:
		return fmt.Errorf("%w: replay cache of %d bytes", ErrInvalidConfig, c.bytes)
	case c.age <= 0:
		return fmt.Errorf("%w: replay cache max age %s is not positive", ErrInvalidConfig, c.age)
	}
	return nil
}

// newReplayCache returns a cache of cfg's bounds, split in as many shards
// (a power of two, up to maxCacheShards) as leave each 64 entries or more.
func newReplayCache(cfg *replayCacheConfig) *replayCache {
	n := 1
	for n < maxCacheShards && cfg.entries/(2*n) >= 64 {
		n *= 2
	}
	c := &replayCache{age: cfg.age, shards: make([]cacheShard, n)}
	for i := range c.shards {
		s := &c.shards[i]
		s.m = make(map[string]*cacheEntry)
		s.root.prev, s.root.next = &s.root, &s.root
		s.maxEntries = max(cfg.entries/n, 1)
		s.maxBytes = max(cfg.bytes/int64(n), 1)
	}
	return c
}

// shard returns the shard of id, a record id: a digest in base64url, whose
// first characters are uniform (its last one is not).
func (c *replayCache) shard(id string) *cacheShard {
	if len(c.shards) == 1 {
		return &c.shards[0]
	}
	h := uint32(2166136261) // FNV-1a of the first 4 characters
	for i := range min(4, len(id)) {
		h = (h ^ uint32(id[i])) * 16777619
	}
	return &c.shards[h&uint32(len(c.shards)-1)]
}

// get returns the replay of id for a call with fingerprint fp at now, or
// false. Its Value is the entry's, shared (Outcome.shared).
func (c *replayCache) get(id, fp string, now time.Time) (Outcome, bool) {
	s := c.shard(id)
	s.mu.Lock()
	e := s.m[id]
	switch {
	case e == nil || e.fp != fp:
		e = nil
	case !now.Before(e.expires):
		s.remove(e)
		e = nil
	default:
		s.touch(e)
	}
	s.mu.Unlock()
	if e == nil {
		c.misses.Add(1)
		return Outcome{}, false
	}
	c.hits.Add(1)
	out := Outcome{Replayed: true, Value: e.value, Token: e.token, attempt: e.attempt, kind: e.kind, shared: true}
	out.Err, _ = replayedFinal(e.kind, out.Value) // it opened when the entry was put
	return out, true
}

// put keeps value, the completed result of id for fingerprint fp, until
// expires, unless it is too large for its shard; it reports whether it kept
// it. The cache owns value from then on: nobody may write it. Callers that
// do not own value hand over a copy.
func (c *replayCache) put(id, fp string, token int64, attempt int, kind byte, value []byte, expires time.Time) bool {
	s := c.shard(id)
	size := int64(len(value)+len(id)+len(fp)) + cacheEntryOverhead
	if size > s.maxBytes {
		return false
	}
	e := &cacheEntry{id: id, fp: fp, token: token, attempt: attempt, kind: kind, value: value, expires: expires, size: size}
	s.mu.Lock()
	defer s.mu.Unlock()
	if old := s.m[id]; old != nil {
		s.remove(old)
	}
	for s.entries >= s.maxEntries || s.bytes+size > s.maxBytes {
		s.remove(s.root.prev)
	}
	s.m[id] = e
	e.prev, e.next = &s.root, s.root.next
	e.prev.next, e.next.prev = e, e
	s.entries++
	s.bytes += size
	return true
}

// drop removes the entry of id, if any.
func (c *replayCache) drop(id string) {
	s := c.shard(id)
	s.mu.Lock()
	if e := s.m[id]; e != nil {
		s.remove(e)
	}
	s.mu.Unlock()
}

func (c *replayCache) stats() ReplayCacheStats {
	st := ReplayCacheStats{Hits: c.hits.Load(), Misses: c.misses.Load()}
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		st.Entries += s.entries
		st.Bytes += s.bytes
		s.mu.Unlock()
	}
	return st
}

// touch makes e the most recently used; s.mu is held.
func (s *cacheShard) touch(e *cacheEntry) {
	if s.root.next == e {
		return
	}
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = &s.root, s.root.next
	e.prev.next, e.next.prev = e, e
}

// remove takes e out of s; s.mu is held.
func (s *cacheShard) remove(e *cacheEntry) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
	delete(s.m, e.id)
	s.entries--
	s.bytes -= e.size
}

// cacheStored fills the cache, if the Keeper has one, with a result c stored
// for retention, the Complete having been sent at sent.
func (k *Keeper) cacheStored(c *Claim, kind byte, body []byte, retention time.Duration, sent time.Time) {
	if k.cache == nil || !c.fpKnown {
		return
	}
	// The caller of Complete may reuse body once it returns.
	k.cache.put(c.id, c.fp, c.token, c.attempt, kind, bytes.Clone(body), sent.Add(min(retention, k.cache.age)))
}

// cacheReplayed fills the cache, if the Keeper has one, with out, a replay
// of id the store gave a call with fingerprint fp at seen. The cache keeps
// out.Value itself, which the call owned: out shares it from then on.
func (k *Keeper) cacheReplayed(id, fp string, out *Outcome, seen time.Time) {
	if k.cache == nil || out.shared || out.marker {
		return // a marker's empty result: its retention is the store's to tell
	}
	keep := k.policy.retention
	if out.kind == kindError || out.kind == kindFinal {
		keep = k.policy.errorRetention
	}
	out.shared = k.cache.put(id, fp, out.Token, out.attempt, out.kind, out.Value, seen.Add(min(keep, k.cache.age)))
}
