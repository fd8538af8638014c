package idem

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPlacementOfAnotherKeeperIsRefused: a Keeper made WithScopeShards(4) on
// the prefix of one made without (a rolling deployment that turns the
// option on) is made, but refused by every call before it writes anything:
// Consume answers each message with an error that wraps ErrInvalidConfig
// and runs no handler, so no message the first Keeper handled runs again;
// Do, Begin, Inspect and Forget return that error. It names both
// placements.
func TestPlacementOfAnotherKeeperIsRefused(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		a := newKeeper(t, b)
		placed, err := NewRedis(b.Client, WithScopeShards(4))
		require.NoError(t, err, "a Keeper of another placement on the same prefix is made")
		msgs := []string{"m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8"}
		id := func(m string) string { return m }
		runs := map[string]int{}
		handle := func(ctx context.Context, m string) error { runs[m]++; return nil }

		res, err := Consume(ctx, a, "orders", msgs, id, handle)
		require.NoError(t, err)
		for _, r := range res {
			require.Equal(t, MessageHandled, r.Status)
		}
		before := redisContents(t, b.Client)
		// The same messages, redelivered to a consumer of the new placement.
		res, err = Consume(ctx, placed, "orders", msgs, id, handle)
		require.NoError(t, err)
		require.Len(t, res, len(msgs))
		for i, r := range res {
			assert.NotEqual(t, MessageHandled, r.Status, "%s handled again by the Keeper WithScopeShards(4)", msgs[i])
			assert.ErrorIs(t, r.Err, ErrInvalidConfig, msgs[i])
			assert.False(t, r.Ack, msgs[i])
		}
		for _, m := range msgs {
			assert.Equal(t, 1, runs[m], "%s ran once", m)
		}
		require.Error(t, res[0].Err)
		for _, want := range []string{`"idem:"`, "WithScopeShards(0) (no shards", "WithScopeShards(4)"} {
			assert.Contains(t, res[0].Err.Error(), want)
		}

		_, err = Do(ctx, placed, "orders", "m1", func(context.Context) (string, error) {
			t.Error("Do ran an operation for a Keeper of another placement")
			return "", nil
		})
		assert.ErrorIs(t, err, ErrInvalidConfig, "Do")
		_, err = placed.Begin(ctx, "orders", "new")
		assert.ErrorIs(t, err, ErrInvalidConfig, "Begin")
		batch, err := placed.batchBegin(ctx, "orders", []string{"m1", "new"})
		require.NoError(t, err, "BeginBatch answers per key")
		for i, r := range batch {
			assert.ErrorIs(t, r.Err, ErrInvalidConfig, "BeginBatch %d", i)
			assert.Nil(t, r.Outcome.Claim, "BeginBatch %d", i)
		}
		_, err = placed.Inspect(ctx, "orders", "m1")
		assert.ErrorIs(t, err, ErrInvalidConfig, "Inspect")
		_, err = placed.Forget(ctx, "orders", "m1", true)
		assert.ErrorIs(t, err, ErrInvalidConfig, "Forget")
		_, err = placed.abandonKey(ctx, "orders", "m1", 1)
		assert.ErrorIs(t, err, ErrInvalidConfig, "Abandon")
		assert.Equal(t, before, redisContents(t, b.Client), "the refused Keeper wrote nothing")

		// The first Keeper's own calls go on, and one of its placement on
		// another store of the prefix is as welcome.
		same := newKeeper(t, b)
		res, err = Consume(ctx, same, "orders", msgs, id, handle)
		require.NoError(t, err)
		for i, r := range res {
			assert.Equal(t, MessageReplayed, r.Status, msgs[i])
		}
	})
}

// TestPlacementRecordedByTheFirstWriter: the first Keeper that writes under
// a prefix records its placement in the prefix's record, prefix +
// "layout", "v3 shards=N"; a Keeper of another placement is refused after
// it, whichever came first, and a prefix of its own takes it.
func TestPlacementRecordedByTheFirstWriter(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		ours, _ := layouts()
		ok := func(context.Context) (int, error) { return 1, nil }
		placed := newKeeper(t, b, WithScopeShards(4))
		reader := newKeeper(t, b)
		_, err := reader.Inspect(ctx, "s", "k")
		require.NoError(t, err, "a reader of a prefix with no record")
		n, err := b.Client.Exists(ctx, "idem:layout").Result()
		require.NoError(t, err)
		assert.Zero(t, n, "a reader writes no record")

		_, err = Do(ctx, placed, "s", "k", ok)
		require.NoError(t, err)
		rec, err := b.Client.Get(ctx, "idem:layout").Result()
		require.NoError(t, err)
		assert.Equal(t, ours+" shards=4", rec)

		_, err = Do(ctx, reader, "s", "k", ok)
		assert.ErrorIs(t, err, ErrInvalidConfig, "a Keeper without WithScopeShards after one with")
		assert.ErrorContains(t, err, "WithScopeShards(4)")
		_, err = Do(ctx, newKeeper(t, b, WithScopeShards(2)), "s", "k", ok)
		assert.ErrorIs(t, err, ErrInvalidConfig, "another n")
		_, err = Do(ctx, newKeeper(t, b, WithScopeShards(4), WithLease(time.Minute)), "s", "k", ok)
		assert.NoError(t, err, "the same placement, other settings")

		other := newKeeper(t, b, WithPrefix("other:"))
		_, err = Do(ctx, other, "s", "k", ok)
		require.NoError(t, err, "another prefix, another placement")
		rec, err = b.Client.Get(ctx, "other:layout").Result()
		require.NoError(t, err)
		assert.Equal(t, ours+" shards=0", rec)
	})
}

// TestPlacementRaceAgrees: Keepers of two placements that make their first
// writes under a new prefix at once agree on one: every call of one
// placement succeeds and every call of the other is refused.
func TestPlacementRaceAgrees(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		ours, _ := layouts()
		const each = 4
		var keepers []*Keeper
		for i := range 2 * each {
			keepers = append(keepers, newKeeper(t, b, WithScopeShards(i%2)))
		}
		errs := make([]error, len(keepers))
		var wg sync.WaitGroup
		for i, k := range keepers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, errs[i] = Do(ctx, k, "s", fmt.Sprint("k", i), func(context.Context) (int, error) { return i, nil })
			}()
		}
		wg.Wait()
		rec, err := b.Client.Get(ctx, "idem:layout").Result()
		require.NoError(t, err)
		won := map[string]int{ours + " shards=0": 0, ours + " shards=1": 1}
		require.Contains(t, won, rec)
		for i, err := range errs {
			if i%2 == won[rec] {
				assert.NoError(t, err, "Keeper %d, of the recorded placement", i)
			} else {
				assert.ErrorIs(t, err, ErrInvalidConfig, "Keeper %d, of the other", i)
			}
		}
	})
}

// TestPlacementCheckedOncePerStore: the prefix's record costs a store one
// round trip, on its first call (or in LoadScripts), and none after; a
// store made by NewRedis writes it in LoadScripts, which refuses a Keeper
// of another placement.
func TestPlacementCheckedOncePerStore(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		ours, _ := layouts()
		ok := func(context.Context) (int, error) { return 1, nil }
		require.NoError(t, newKeeper(t, b).store.(*redisStore).LoadScripts(ctx), "the scripts loaded, and the record written")
		rec, err := b.Client.Get(ctx, "idem:layout").Result()
		require.NoError(t, err)
		assert.Equal(t, ours+" shards=0", rec, "LoadScripts writes the record of its store's Keeper")

		var cnt redistest.Counter
		b.Client.AddHook(&cnt)
		k := newKeeper(t, b)
		assert.EqualValues(t, 3, cnt.Count(func() {
			_, err := Do(ctx, k, "s", "a", ok)
			require.NoError(t, err)
		}), "a store's first call: the record, the claim, the completion")
		assert.EqualValues(t, 2, cnt.Count(func() {
			_, err := Do(ctx, k, "s", "b", ok)
			require.NoError(t, err)
		}), "the next: the claim, the completion")
		k2, err := keeperOn(k.store)
		require.NoError(t, err)
		assert.EqualValues(t, 1, cnt.Count(func() {
			_, err := Do(ctx, k2, "s", "a", ok)
			require.NoError(t, err)
		}), "another Keeper of the store: the replay")

		err = newKeeper(t, b, WithScopeShards(3)).store.(*redisStore).LoadScripts(ctx)
		assert.ErrorIs(t, err, ErrInvalidConfig, "LoadScripts of a Keeper of another placement")
	})
}

// TestPrefixRecordOfAnotherLayout: a prefix whose record says another
// layout (written by another version of idem) refuses every Keeper with
// ErrInvalidConfig; one that says nothing readable is ErrCorrupt.
func TestPrefixRecordOfAnotherLayout(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		ours, other := layouts()
		ok := func(context.Context) (int, error) { return 1, nil }
		for raw, want := range map[string]error{
			other + " shards=0":     ErrInvalidConfig,
			other:                   ErrInvalidConfig,
			ours:                    ErrCorrupt,
			ours + " shards=x":      ErrCorrupt,
			ours + " shards=01":     ErrCorrupt,
			ours + " shards=257":    ErrCorrupt,
			" ":                     ErrCorrupt,
			ours + " shards=0 x=1":  nil,
			ours + " x=1 shards=0":  nil,
			ours + "  shards=0\n":   nil,
			ours + " shards=1 n=22": ErrInvalidConfig,
		} {
			require.NoError(t, b.Client.Set(ctx, "idem:layout", raw, 0).Err())
			_, err := Do(ctx, newKeeper(t, b), "s", "k", ok)
			if want == nil {
				assert.NoError(t, err, "%q", raw)
			} else {
				assert.ErrorIs(t, err, want, "%q", raw)
			}
		}
	})
}

// redisContents is every key of c and what it holds, for a test that
// asserts nothing was written.
func redisContents(t *testing.T, c *redis.Client) map[string]string {
	t.Helper()
	ctx := context.Background()
	keys, err := c.Keys(ctx, "*").Result()
	require.NoError(t, err)
	sort.Strings(keys)
	out := make(map[string]string, len(keys))
	for _, k := range keys {
		typ, err := c.Type(ctx, k).Result()
		require.NoError(t, err)
		switch typ {
		case "string":
			out[k], err = c.Get(ctx, k).Result()
		case "hash":
			var h map[string]string
			h, err = c.HGetAll(ctx, k).Result()
			out[k] = fmt.Sprint(h)
		default:
			t.Fatalf("key %s of type %s", k, typ)
		}
		require.NoError(t, err)
	}
	return out
}
