package idem

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/idemkit/idem/internal/slot"
	"github.com/redis/go-redis/v9"
)

// Compact claims and markers: how a redisStore keeps the claims of a batch
// without a Redis key each, and what a message handled that way leaves.
// The index of their entries and its call records are laid out as
// format.go says ("The v3 layout"); redis_v3.go runs its scripts.

// compactLayout is where a redisStore keeps its index of compact claims
// and markers: one index key and its call records on one server (on each
// shard of a Ring), one of each a slot on a Cluster (see
// redisStore.v3Names).
type compactLayout struct {
	// cluster is set for a *redis.ClusterClient: each slot has its own index
	// key and call records, so that a record and its entry share a slot.
	cluster bool
}

// oldIndexKey is the index key that the layouts before v3 kept on one
// server (prefix + "i:0"): a store refuses to write under a prefix that
// holds one, rather than miss the markers it holds (see prefix.lua).
func oldIndexKey(prefix string) string { return prefix + "i:0" }

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
func (s *redisStore) layoutReady(ctx context.Context) error {
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
				s.compact = &compactLayout{cluster: true}
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
func (s *redisStore) layoutError(err error) error {
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

// compactGroups groups the records picks names, whose fences have a Ref, by
// the call record that holds them, in the order of their first record. A
// call's token is unique only on the server that made it: on one server
// the token names the call; on a Cluster, where every slot has its own call
// records, the token and the slot; on other clients (a Ring, whose shards
// have clocks of their own, or an AutoPipeliner), whose every claim call
// holds one record, the token and the record.
func (s *redisStore) compactGroups(picks []int, fence func(j int) claimFence) (groups [][]int) {
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

// compactAnswers answers each claim of a compact settle or move step into
// errs: as transitionAnswers, errMoved for a claim moved to a record of its
// own (3), errCompletedAsMarker for one completed already (4).
func compactAnswers(errs []error) func(i int, res []any, err error) {
	return func(i int, res []any, err error) {
		switch {
		case err == nil && len(res) == 1 && res[0] == int64(compactSettleMoved):
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
func splitByRef(n int, fence func(j int) claimFence) (compact, records []int) {
	for j := 0; j < n; j++ {
		if fence(j).Ref > 0 {
			compact = append(compact, j)
		} else {
			records = append(records, j)
		}
	}
	return compact, records
}

// compactIndexArgs is claimIndexArgs for record id.
func (s *redisStore) compactIndexArgs(id string) (d8, index, calls string) {
	return s.claimIndexArgs(id, s.key(id))
}

// keysOf returns the Redis keys of the records ids[i] for i in todo (see
// redisStore.key), made in one allocation; the others are "".
func (s *redisStore) keysOf(ids []string, todo []int) []string {
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
