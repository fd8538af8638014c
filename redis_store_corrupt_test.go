package idem

// Values where a record lives that are not idem records, or are damaged
// ones: every step answers a typed error, never a panic, runs nothing, and
// leaves the value as it was.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCorruptRecords(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		key := func(name string) string { return k.store.(*redisStore).key(recordID("s", name)) }
		fn := func(ctx context.Context) (receipt, error) {
			assert.Fail(t, "must not run on a corrupt record")
			return receipt{}, nil
		}
		tok := "1795987179415205"
		cases := []struct {
			name string
			put  func(k string) error
		}{
			{"plain string", func(k string) error { return b.Client.Set(ctx, k, "hello", 0).Err() }},
			{"hash", func(k string) error { return b.Client.HSet(ctx, k, "s", "C", "t", "zz").Err() }},
			{"list", func(k string) error { return b.Client.RPush(ctx, k, "a").Err() }},
			{"garbage header", func(k string) error { return b.Client.Set(ctx, k, "i1C12:x:0:0:::", 0).Err() }},
			{"unknown envelope", func(k string) error {
				return b.Client.Set(ctx, k, "i1C"+tok+":1:0:0:::\x09v\x01", 0).Err()
			}},
			{"truncated msgpack", func(k string) error {
				return b.Client.Set(ctx, k, "i1C"+tok+":1:0:0:::\x01v\x83\xa2ID", 0).Err()
			}},
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				rk := key(c.name)
				require.NoError(t, c.put(rk))
				before := snapshot(t, b.Client, rk)
				_, err := Do(ctx, k, "s", c.name, fn)
				require.ErrorIs(t, err, ErrCorrupt)
				assert.Equal(t, before, snapshot(t, b.Client, rk), "nothing is overwritten")
			})
		}
		// Complete, Release and Extend on a record that turned corrupt.
		out, err := k.Begin(ctx, "s", "turned")
		require.NoError(t, err)
		require.NoError(t, b.Client.Set(ctx, key("turned"), "not ours", 0).Err())
		require.ErrorIs(t, out.Claim.Complete(ctx, []byte("x"), 0), ErrCorrupt)
		require.ErrorIs(t, out.Claim.Release(ctx), ErrCorrupt)
		require.ErrorIs(t, out.Claim.Extend(ctx), ErrCorrupt)
		v, err := b.Client.Get(ctx, key("turned")).Result()
		require.NoError(t, err)
		assert.Equal(t, "not ours", v)
	})
}

// snapshot returns the type and content of the value at key.
func snapshot(t *testing.T, c *redis.Client, key string) string {
	ctx := context.Background()
	typ, err := c.Type(ctx, key).Result()
	require.NoError(t, err)
	var v any
	switch typ {
	case "string":
		v, err = c.Get(ctx, key).Result()
	case "hash":
		v, err = c.HGetAll(ctx, key).Result()
	case "list":
		v, err = c.LRange(ctx, key, 0, -1).Result()
	}
	require.NoError(t, err)
	return fmt.Sprintf("%s %v", typ, v)
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
			s, err := openRedisStore(c)
			require.NoError(t, err)
			k, err := keeperOn(s)
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
