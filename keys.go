package idem

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// MaxKeyLen is the longest key accepted, in bytes.
const MaxKeyLen = 255

// ValidateKey reports whether key can be used: it must be 1 to MaxKeyLen bytes
// long and hold no control characters (bytes below 0x20, and 0x7f). The error
// wraps ErrInvalidKey.
func ValidateKey(key string) error {
	if key == "" {
		return fmt.Errorf("%w: empty", ErrInvalidKey)
	}
	if len(key) > MaxKeyLen {
		return fmt.Errorf("%w: %d bytes, longer than %d", ErrInvalidKey, len(key), MaxKeyLen)
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x20 || c == 0x7f {
			return fmt.Errorf("%w: control character 0x%02x at byte %d", ErrInvalidKey, c, i)
		}
	}
	return nil
}

// idLen is the length of a record id: 16 bytes of SHA-256, base64url.
const idLen = 22

// RecordID returns the id under which k keeps the record of (scope, key):
// the digest a store keeps it by, as Event.ID and Record.ID name it, so
// that an operator or a log can tie an id to a key they know. The key is
// not checked (see ValidateKey). For a Keeper whose scopes are in shards
// (WithScopeShards, or on a Cluster by default) the id carries the
// scope's placement.
func (k *Keeper) RecordID(scope, key string) string {
	var id [idLen]byte
	k.ids(scope).put(&id, key)
	return string(id[:])
}

// maxScopeShards is the most shards WithScopeShards takes.
const maxScopeShards = 256

// defaultScopeShards is the scope shards of a Keeper made on store without
// WithScopeShards: ClusterScopeShards on a redisStore of a
// *redis.ClusterClient, else none. The client's type decides, not what
// the store learns of its server later (an AutoPipeliner's), so that a
// Keeper's placement is fixed when it is made.
func defaultScopeShards(store recordStore) int {
	if rs, ok := store.(*redisStore); ok {
		if _, cluster := rs.client.(*redis.ClusterClient); cluster {
			return ClusterScopeShards
		}
	}
	return 0
}

// WithScopeShards places the keys of a scope together, so that a Redis
// Cluster keeps the records, compact claims and markers of one scope in n
// hash slots (n from 1 to 256): a key goes to one of the
// scope's n shards, chosen by its digest, and every shard is one slot. A
// Consume batch of one scope then costs a few script calls on the nodes
// of its shards' slots, where keys placed by their own digests (n = 0)
// fall in about as many slots as the batch has messages, each slot's few
// kept in records of their own, a script call each.
//
// A shard's slot takes a 1/n share of its scope's keys, memory and Redis
// work: to spread a hot scope over a Cluster's nodes, give it more shards
// (a batch then costs a script call per shard), or divide it into scopes.
// Many scopes, such as one per partition or tenant, spread by themselves.
// On one server, or a Ring, the placement changes the keys' names only.
//
// The placement is part of each record's id (see Keeper.RecordID) and of
// its key's name: every Keeper that shares a store's prefix must be made
// with the same n, or a key would be claimed once by each. A prefix holds
// it to that: the first Keeper that writes under a prefix records
// its n there (in the key prefix + "layout"), and a Keeper made with
// another n is refused before it writes anything, with an error that wraps
// ErrInvalidConfig and names both: Do, Begin, Inspect and Forget
// return it, Consume answers each message with it
// (Consume runs no handler and acknowledges nothing), and
// Keeper.LoadScripts returns it. To turn
// the option on, or change n, where a prefix is in use, give the new
// placement a prefix of its own, after draining the old one (see
// docs/consumers.md, "Placement on a prefix in use"). A Keeper reads
// any id, placed or not, without an option. Applies to a Keeper.
//
// Default: ClusterScopeShards (16) on a Keeper whose client is a
// *redis.ClusterClient, so that a Cluster's batches cost a few script calls
// without an option; 0 on any other store (one server, a Ring), where
// shards would buy nothing. WithScopeShards(0) asks for no shards on a
// Cluster too: keys placed by their own digests, as a Keeper of a version
// before this default placed them. A Keeper on an AutoPipeliner over a Cluster
// takes 0: give it WithScopeShards(ClusterScopeShards) to share a prefix
// with Keepers made on the ClusterClient.
func WithScopeShards(n int) Option {
	return Option{name: "WithScopeShards", to: toKeeper, set: func(s *settings) { s.scopeShards, s.scopeShardsSet = n, true }}
}

// recordID is the fixed-length digest of (scope, key) under which a record is
// stored. Raw client keys never reach the store. The scope's length is hashed
// first so that ("ab", "c") and ("a", "bc") differ.
func recordID(scope, key string) string {
	var id [idLen]byte
	putRecordID(&id, scope, key)
	return string(id[:])
}

// putRecordID writes the record id of (scope, key) into id.
func putRecordID(id *[idLen]byte, scope, key string) {
	var d [16]byte
	digestOf(&d, scope, key)
	base64.RawURLEncoding.Encode(id[:], d[:])
}

// digestOf writes the first 16 bytes of the digest of (scope, key) into d.
func digestOf(d *[16]byte, scope, key string) {
	// Hash from a buffer on the stack when (scope, key) fits in it.
	var stack [512]byte
	b := binary.BigEndian.AppendUint64(stack[:0], uint64(len(scope)))
	b = append(append(b, scope...), key...)
	sum := sha256.Sum256(b)
	copy(d[:], sum[:16])
}

// placement makes the record ids of one scope: recordID's, or when shards
// is above 0 (WithScopeShards) placed ones. A placed id is the 16 bytes of
// the first 12 of the key's digest (as recordID's), the first 3 of the
// scope's and the key's shard (its digest's bytes 12 to 15, big-endian,
// modulo shards), in base64url with the 4 bits that pad its last
// character 0001: the last 6 characters are the same for every key of a
// scope's shard, and a redisStore makes them the hash tag of the id's key
// (see placedID).
type placement struct {
	scope  string
	shards uint32
	tag    [3]byte
}

// ids returns the placement of the record ids of scope.
func (k *Keeper) ids(scope string) placement {
	p := placement{scope: scope, shards: uint32(k.scopeShards)}
	if p.shards > 0 {
		var stack [256]byte
		sum := sha256.Sum256(append(append(stack[:0], "idem scope "...), scope...))
		copy(p.tag[:], sum[:])
	}
	return p
}

// put writes the id of key into id.
func (p placement) put(id *[idLen]byte, key string) {
	if p.shards == 0 {
		putRecordID(id, p.scope, key)
		return
	}
	var d [16]byte
	digestOf(&d, p.scope, key)
	shard := byte(binary.BigEndian.Uint32(d[12:16]) % p.shards)
	copy(d[12:15], p.tag[:])
	d[15] = shard
	base64.RawURLEncoding.Encode(id[:], d[:])
	id[idLen-1] = b64url[strings.IndexByte(b64url, id[idLen-1])|placedMark]
}

// b64url is the alphabet of base64url; placedMark the padding bits of a
// placed id's last character.
const (
	b64url     = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
	placedMark = 1
)

// placedID reports whether id is placed (see placement): 22 characters
// whose last one's padding bits are 0001. An id Keeper.RecordID makes
// without placement has them 0000.
func placedID(id string) bool {
	if len(id) != idLen {
		return false
	}
	switch id[idLen-1] {
	case b64url[placedMark], b64url[16+placedMark], b64url[32+placedMark], b64url[48+placedMark]:
		return true
	}
	return false
}

// placedTagLen is how many characters end a placed id and name its shard.
const placedTagLen = 6

// fingerprintLen is how many bytes of a fingerprint's SHA-256 are stored.
const fingerprintLen = 12

// fingerprintDigest reduces a caller's fingerprint of any length to the short
// form kept in the record; an empty fingerprint stays empty.
func fingerprintDigest(fp []byte) string {
	if len(fp) == 0 {
		return ""
	}
	sum := sha256.Sum256(fp)
	return base64.RawURLEncoding.EncodeToString(sum[:fingerprintLen])
}
