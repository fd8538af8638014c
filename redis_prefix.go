package idem

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// The prefix's record: one Redis string per prefix, at prefix + "layout",
// that says how the prefix is written (see prefixRecordFormat): the layout
// of its index and keys, and the placement (WithScopeShards) of the Keepers
// that write under it. A Keeper learns it before its first call and is
// refused if it would place keys otherwise, so that two placements never
// meet on one prefix: a key claimed once by each. It is written once, by
// the first Keeper that writes under the prefix, and never expires.
var (
	//go:embed lua/prefix.lua
	prefixBody   string
	prefixScript = newLuaScript("prefix", prefixBody)
)

// prefixRecordKey is where the record of prefix is kept.
func prefixRecordKey(prefix string) string { return prefix + "layout" }

// prefixRecord is what the record of a prefix says.
type prefixRecord struct {
	// raw is the record as stored; "" when the prefix has none (no Keeper
	// of this version has written under it yet).
	raw string
	// layout is its layout ("v2", "v3"); shards the placement of its
	// Keepers (WithScopeShards; 0: none), when the layout is the store's.
	layout string
	shards int
}

// prefixLayout is the layout of the index and keys a store writes, as the
// records of the prefixes it writes under say: a store refuses a prefix
// recorded in another (the layouts before v3 were "v1" and "v2").
const prefixLayout = "v3"

// parsePrefixRecord reads the record raw of a prefix for a store that
// writes layout:
//
//	LAYOUT " shards=" N
//
// LAYOUT is the layout of the prefix's index and keys ("v2", "v3"), N the
// scope shards (WithScopeShards, 0 for none) of the Keepers that write
// under it. Fields after them, " NAME=VALUE", are left for later versions:
// one that changes where or how a key is written comes with another
// LAYOUT. A record of another layout is read as its layout alone (ok,
// shards -1); a record of layout that does not say its shards is not ok.
func parsePrefixRecord(raw, layout string) (rec prefixRecord, ok bool) {
	rec.raw = raw
	fields := strings.Fields(raw)
	if len(fields) == 0 {
		return rec, false
	}
	rec.layout, rec.shards = fields[0], -1
	if rec.layout != layout {
		return rec, true
	}
	for _, f := range fields[1:] {
		if v, ok := strings.CutPrefix(f, "shards="); ok {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 || n > maxScopeShards || strconv.Itoa(n) != v {
				return rec, false
			}
			rec.shards = n
			return rec, true
		}
	}
	return rec, false
}

// prefixGate holds what the store learned of its prefix's record, and the
// placements of the Keepers made on it, which LoadScripts writes the record
// for.
type prefixGate struct {
	mu sync.Mutex
	// read is set once the record has been read; rec is what it says
	// (rec.raw "" for none). A record once read is kept for the store's
	// life: only a Keeper's first call, and one that finds no record yet,
	// ask Redis.
	read bool
	rec  prefixRecord
	// keepers are the scope shards of the Keepers made on the store (New,
	// NewRedis), each once.
	keepers []int
}

// addKeeper notes that a Keeper of shards scope shards uses the store.
func (s *redisStore) addKeeper(shards int) {
	g := &s.prefixGate
	g.mu.Lock()
	defer g.mu.Unlock()
	if !slices.Contains(g.keepers, shards) {
		g.keepers = append(g.keepers, shards)
	}
}

// placementChecker is a store that knows how its keys are placed, and
// refuses a Keeper that would place them otherwise: a redisStore.
type placementChecker interface {
	// checkPlacement checks that a Keeper of shards scope shards (or any,
	// for -1) may use the store: to write (writing the prefix's record
	// where there is none), or to read. kept reports that the answer holds
	// for the store's life: the record is written and says shards. An
	// error that wraps ErrInvalidConfig refuses the Keeper.
	checkPlacement(ctx context.Context, shards int, write bool) (kept bool, err error)
}

// checkPlacement implements placementChecker: it reads the prefix's record
// once (once more, to write it, for the first write under a prefix that has
// none), and compares.
func (s *redisStore) checkPlacement(ctx context.Context, shards int, write bool) (bool, error) {
	g := &s.prefixGate
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.read || write && g.rec.raw == "" {
		if err := ctx.Err(); err != nil {
			return false, err
		}
		rec, err := s.readPrefix(ctx, shards, write)
		if err != nil {
			return false, err
		}
		g.read, g.rec = true, rec
	}
	if g.rec.raw == "" {
		return false, nil
	}
	if err := s.placementError(g.rec, shards); err != nil {
		return false, err
	}
	return shards >= 0, nil
}

// readPrefix runs prefix.lua: the record, written for a Keeper of shards
// scope shards if write and there is none. On one server it is given the
// index key of the layouts before v3 (oldIndexKey), which it refuses to
// write beside.
func (s *redisStore) readPrefix(ctx context.Context, shards int, write bool) (prefixRecord, error) {
	if err := s.layoutReady(ctx); err != nil {
		return prefixRecord{}, err
	}
	keys := []string{prefixRecordKey(s.prefix)}
	if !s.compact.cluster {
		keys = append(keys, oldIndexKey(s.prefix))
	}
	args := prefixScript.evalArgs(2, keys...)
	writeFor := ""
	if write && shards >= 0 {
		writeFor = strconv.Itoa(shards)
	}
	args = append(args, writeFor, prefixLayout)
	raw, err := s.eval(ctx, prefixScript, args).Text()
	switch {
	case errors.Is(err, redis.Nil):
		return prefixRecord{}, nil
	case err != nil:
		return prefixRecord{}, s.layoutError(err)
	}
	rec, ok := parsePrefixRecord(raw, prefixLayout)
	if !ok {
		return prefixRecord{}, fmt.Errorf("%w: the record %s of prefix %q holds %q, which says no placement",
			ErrCorrupt, prefixRecordKey(s.prefix), s.prefix, raw)
	}
	return rec, nil
}

// placementError refuses a Keeper of shards scope shards on a prefix whose
// record is rec: one of another layout, or written by Keepers of another
// placement.
func (s *redisStore) placementError(rec prefixRecord, shards int) error {
	key := prefixRecordKey(s.prefix)
	if rec.layout != prefixLayout {
		return fmt.Errorf("%w: prefix %q is written in layout %q (its record %s holds %q), which this version of idem does not read: use another prefix",
			ErrInvalidConfig, s.prefix, rec.layout, key, rec.raw)
	}
	if shards < 0 || shards == rec.shards {
		return nil
	}
	return fmt.Errorf("%w: prefix %q is written by Keepers made %s (its record %s holds %q), and this Keeper is made %s: "+
		"the placement is part of every key, so each would claim a key once; give a Keeper of another placement a prefix of its own (see WithScopeShards)",
		ErrInvalidConfig, s.prefix, placementName(rec.shards), key, rec.raw, placementName(shards))
}

// placementName says how a Keeper of shards scope shards is made: the
// option, and when it is a default, where.
func placementName(shards int) string {
	switch shards {
	case 0:
		return "WithScopeShards(0) (no shards: the default but on a Cluster)"
	case ClusterScopeShards:
		return fmt.Sprintf("WithScopeShards(%d) (the default on a Cluster)", shards)
	}
	return fmt.Sprintf("WithScopeShards(%d)", shards)
}

// learnPrefix is LoadScripts' part: the prefix's record is read, and
// written for the store's Keepers when they all share one placement (a
// store made by NewRedis), so that their first calls do not ask for it.
func (s *redisStore) learnPrefix(ctx context.Context) error {
	g := &s.prefixGate
	g.mu.Lock()
	shards, write := -1, len(g.keepers) == 1
	if write {
		shards = g.keepers[0]
	}
	g.mu.Unlock()
	_, err := s.checkPlacement(ctx, shards, write)
	return err
}

// placementReady checks, before the Keeper's call reads (write false) or
// writes under its store's keys, that its placement is the one its store's
// keys are written in (see placementChecker). Once the store's answer holds
// for good it is kept: a call then costs an atomic load.
func (k *Keeper) placementReady(ctx context.Context, write bool) error {
	if k.placed.Load() {
		return nil
	}
	pc, ok := k.store.(placementChecker)
	if !ok {
		k.placed.Store(true)
		return nil
	}
	kept, err := pc.checkPlacement(ctx, k.scopeShards, write)
	if kept {
		k.placed.Store(true)
	}
	return err
}
