package idem

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// badInputBackends returns a client of a fresh miniredis, and of a fresh
// redis-server when one is installed.
func badInputBackends(t *testing.T) map[string]*redis.Client {
	m := miniredis.RunT(t)
	mc := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { mc.Close() })
	backends := map[string]*redis.Client{"miniredis": mc}
	if _, err := exec.LookPath("redis-server"); err == nil || redistest.Required() {
		backends["redis"] = redistest.Start(t).Client(t)
	}
	return backends
}

// TestBadKeys: keys refused before Redis is touched, with the answer each
// gets.
func TestBadKeys(t *testing.T) {
	table := []struct {
		key    string
		answer string // what the error says, after "idem: invalid key: "
	}{
		{"", "empty"},
		{strings.Repeat("k", MaxKeyLen+1), "256 bytes, longer than 255"},
		{strings.Repeat("ü", 128), "256 bytes, longer than 255"},
		{"nul\x00", "control character 0x00 at byte 3"},
		{"line\nbreak", "control character 0x0a at byte 4"},
		{"\ttab", "control character 0x09 at byte 0"},
		{"del\x7f", "control character 0x7f at byte 3"},
		{"\x1b[31mred", "control character 0x1b at byte 0"},
		{"cr\r\nLF-injection: x", "control character 0x0d at byte 2"},
	}
	for name, c := range badInputBackends(t) {
		t.Run(name, func(t *testing.T) {
			k, err := NewRedis(c)
			require.NoError(t, err)
			ctx := context.Background()
			for _, row := range table {
				_, err := k.Begin(ctx, "scope", row.key)
				assert.ErrorIs(t, err, ErrInvalidKey, "Begin(%q)", row.key)
				assert.EqualError(t, err, "idem: invalid key: "+row.answer, "Begin(%q)", row.key)
				ran := false
				_, err = Do(ctx, k, "scope", row.key, func(context.Context) (int, error) { ran = true; return 1, nil })
				assert.ErrorIs(t, err, ErrInvalidKey, "Do(%q)", row.key)
				assert.False(t, ran, "Do(%q) ran the operation", row.key)
			}
			assert.Zero(t, c.DBSize(ctx).Val(), "keys Redis holds after refused keys")
		})
	}
}

// TestBadOptions: settings and clients that cannot work, refused by the
// constructors with ErrInvalidConfig and the answer each gets.
func TestBadOptions(t *testing.T) {
	m := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer c.Close()
	slow := redis.NewClient(&redis.Options{Addr: m.Addr(), ReadTimeout: 2 * time.Second})
	defer slow.Close()
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": m.Addr()}})
	defer ring.Close()
	store, err := NewRedisStore(c)
	require.NoError(t, err)
	table := []struct {
		name   string
		try    func() error
		answer string
	}{
		{"nil store", func() error { _, err := New(nil); return err }, "nil store"},
		{"zero lease", func() error { _, err := New(store, WithLease(0)); return err }, "lease 0s is shorter than 1ms"},
		{"negative lease", func() error { _, err := New(store, WithLease(-time.Second)); return err }, "lease -1s is shorter than 1ms"},
		{"lease under 1ms", func() error { _, err := New(store, WithLease(time.Microsecond)); return err }, "lease 1µs is shorter than 1ms"},
		{"retention shorter than lease", func() error { _, err := New(store, WithRetention(time.Second)); return err }, "retention 1s is shorter than the lease 30s"},
		{"negative error retention", func() error { _, err := New(store, WithErrorRetention(-time.Second)); return err }, "error retention -1s is shorter than 1ms"},
		{"nil codec", func() error { _, err := New(store, WithCodec(nil)); return err }, "nil codec"},
		{"nil client", func() error { _, err := NewRedisStore(nil); return err }, "nil redis client"},
		{"nil client (NewRedis)", func() error { _, err := NewRedis(nil); return err }, "nil redis client"},
		{"prefix with {", func() error { _, err := NewRedisStore(c, WithPrefix("app{")); return err }, "prefix \"app{\" holds '{' or '}', which would break the hash tag"},
		{"prefix with }", func() error { _, err := NewRedisStore(c, WithPrefix("}")); return err }, "prefix \"}\" holds '{' or '}', which would break the hash tag"},
		{"no replicas", func() error { _, err := NewRedisStore(c, WithReplicas(0, time.Second)); return err }, "WithReplicas: 0 replicas, want at least 1"},
		{"zero WAIT timeout", func() error { _, err := NewRedisStore(c, WithReplicas(1, 0)); return err }, "WithReplicas: timeout 0s is shorter than 1ms"},
		{"WAIT timeout past the read timeout", func() error { _, err := NewRedisStore(slow, WithReplicas(1, 2*time.Second)); return err },
			"WithReplicas: timeout 2s is not shorter than the client's ReadTimeout 2s"},
		{"WithReplicas on a Ring", func() error { _, err := NewRedisStore(ring, WithReplicas(1, time.Second)); return err },
			"WithReplicas needs a *redis.Client, *redis.Conn or *redis.ClusterClient, so that WAIT runs on the connection that wrote; got *redis.Ring"},

		{"attempt id not base64url", func() error {
			_, err := store.Claim(context.Background(), "id", ClaimRequest{Attempt: "a b", Lease: time.Second, Keep: time.Second})
			return err
		}, "fingerprint and attempt must be base64url"},
		{"empty attempt id", func() error {
			_, err := store.Claim(context.Background(), "id", ClaimRequest{Lease: time.Second, Keep: time.Second})
			return err
		}, "fingerprint and attempt must be base64url"},
	}
	for _, row := range table {
		err := row.try()
		if !assert.ErrorIs(t, err, ErrInvalidConfig, row.name) {
			continue
		}
		if row.answer != "" {
			assert.EqualError(t, err, "idem: invalid configuration: "+row.answer, row.name)
		}
	}
	assert.Zero(t, c.DBSize(context.Background()).Val(), "keys Redis holds after refused settings")
}

// TestBadStoredValues puts values that are not idem records (or are damaged
// ones) where a record lives, and shows the answer of every step: a typed
// error, never a panic, and the value is left exactly as it was.
func TestBadStoredValues(t *testing.T) {
	str := func(v string) func(context.Context, *redis.Client, string) error {
		return func(ctx context.Context, c *redis.Client, key string) error {
			return c.Set(ctx, key, v, time.Hour).Err()
		}
	}
	table := []struct {
		name  string
		put   func(ctx context.Context, c *redis.Client, key string) error
		begin string // the error Begin answers, after "idem: corrupt record: "
		// steps is the error of Complete, Release and Extend with token 1:
		// "corrupt" when the header cannot be read, "lease lost" when it can.
		steps string
	}{
		{"plain string", str("hello"), "unknown format", "corrupt"},
		{"empty string", str(""), "unknown format", "corrupt"},
		{"hash", func(ctx context.Context, c *redis.Client, key string) error { return c.HSet(ctx, key, "f", "v").Err() }, "wrong type", "corrupt"},
		{"list", func(ctx context.Context, c *redis.Client, key string) error { return c.RPush(ctx, key, "a", "b").Err() }, "wrong type", "corrupt"},
		{"set", func(ctx context.Context, c *redis.Client, key string) error { return c.SAdd(ctx, key, "a").Err() }, "wrong type", "corrupt"},
		{"sorted set", func(ctx context.Context, c *redis.Client, key string) error {
			return c.ZAdd(ctx, key, redis.Z{Score: 1, Member: "a"}).Err()
		}, "wrong type", "corrupt"},
		{"garbage header", str("i1X5:1:0:0:::x"), "unknown format", "corrupt"},
		{"header of a future format", str("i2C5:1:0:0:::\x01bx"), "unknown format", "corrupt"},
		{"header cut short", str("i1P5:1"), "unknown format", "corrupt"},
		{"token not a number", str("i1Cabc:1:0:0:::\x01bx"), "unknown format", "corrupt"},
		{"binary garbage", str("\x00\xff\xfe\x80i1C"), "unknown format", "corrupt"},
		{"truncated envelope", str("i1C5:1:0:0:::\x01"), "envelope of 1 bytes", "lease lost"},
		{"empty envelope", str("i1C5:1:0:0:::"), "envelope of 0 bytes", "lease lost"},
		{"unknown envelope version", str("i1C5:1:0:0:::\x02bhello"), "envelope format 2 unknown", "lease lost"},
		{"unknown envelope kind", str("i1C5:1:0:0:::\x01zhello"), "envelope kind 'z' unknown", "lease lost"},
	}
	for name, c := range badInputBackends(t) {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			s, err := NewRedisStore(c)
			require.NoError(t, err)
			k, err := New(s)
			require.NoError(t, err)
			for _, row := range table {
				key := "bad/" + row.name
				rkey := s.key(recordID("bad", key))
				require.NoError(t, row.put(ctx, c, rkey), row.name)
				dump := badInputSnapshot(ctx, c, rkey)
				_, err := k.Begin(ctx, "bad", key)
				assert.ErrorIs(t, err, ErrCorrupt, "%s: Begin", row.name)
				assert.EqualError(t, err, "idem: corrupt record: "+row.begin, "%s: Begin", row.name)
				ran := false
				_, err = Do(ctx, k, "bad", key, func(context.Context) (int, error) { ran = true; return 1, nil })
				assert.ErrorIs(t, err, ErrCorrupt, "%s: Do; want ErrCorrupt without running", row.name)
				assert.False(t, ran, "%s: Do ran the operation; want ErrCorrupt without running", row.name)
				id := recordID("bad", key)
				for step, err := range map[string]error{
					"Complete": errOf(s.Complete(ctx, id, 1, []byte("x"), time.Hour)),
					"Release":  s.Release(ctx, id, 1, time.Hour),
					"Extend":   s.Extend(ctx, id, 1, time.Second, time.Hour),
				} {
					want := ErrCorrupt
					if row.steps == "lease lost" {
						want = ErrLeaseLost
					}
					assert.ErrorIs(t, err, want, "%s: %s", row.name, step)
				}
				assert.Equal(t, dump, badInputSnapshot(ctx, c, rkey), "%s: the value was overwritten", row.name)
			}
		})
	}
}

// badInputSnapshot renders the value at key, of any type, and whether it
// still expires.
func badInputSnapshot(ctx context.Context, c *redis.Client, key string) string {
	typ := c.Type(ctx, key).Val()
	var v any
	switch typ {
	case "string":
		v = c.Get(ctx, key).Val()
	case "hash":
		v = c.HGetAll(ctx, key).Val()
	case "list":
		v = c.LRange(ctx, key, 0, -1).Val()
	case "set":
		v = c.SMembers(ctx, key).Val()
	case "zset":
		v = c.ZRangeWithScores(ctx, key, 0, -1).Val()
	}
	return fmt.Sprintf("%s %q expires=%v", typ, v, c.PTTL(ctx, key).Val() > 0)
}
