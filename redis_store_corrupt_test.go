package idem

import (
	"context"
	"fmt"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCorruptRecords(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		key := func(name string) string { return k.store.(*RedisStore).key(recordID("s", name)) }
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
