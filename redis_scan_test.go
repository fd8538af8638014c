package idem

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// records holds a few records in every state, for the listing tests.
type records struct {
	pending, completed, released []string // record ids
}

// makeRecords makes n records in each state under k.
func makeRecords(t *testing.T, k *Keeper, n int) records {
	t.Helper()
	ctx := context.Background()
	var rs records
	for i := range n {
		for _, state := range []string{"pending", "completed", "released"} {
			key := fmt.Sprintf("%s-%d", state, i)
			out, err := k.Begin(ctx, "s", key)
			require.NoError(t, err)
			switch state {
			case "pending":
				rs.pending = append(rs.pending, k.RecordID("s", key))
			case "completed":
				require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))
				rs.completed = append(rs.completed, k.RecordID("s", key))
			case "released":
				require.NoError(t, out.Claim.Release(ctx))
				rs.released = append(rs.released, k.RecordID("s", key))
			}
		}
	}
	return rs
}

// scanAll gathers a listing: the ids it yielded, in order, and its errors.
func scanAll(s *redisStore, opts ScanOptions) (ids []string, recs []Record, errs []error) {
	for r, err := range s.Scan(context.Background(), opts) {
		if err != nil {
			errs = append(errs, err)
			continue
		}
		ids = append(ids, r.ID)
		recs = append(recs, r)
	}
	return ids, recs, errs
}

func TestScanListsPendingRecords(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(time.Hour))
		store := k.store.(*redisStore)
		rs := makeRecords(t, k, 7)
		ctx := context.Background()
		// Keys that are not records of this store are never listed.
		other, err := NewRedis(b.Client, WithPrefix("idem:other:"))
		require.NoError(t, err)
		_, err = other.Begin(ctx, "s", "elsewhere")
		require.NoError(t, err)
		for _, key := range []string{"idem:plain", "idem:{short}", "idem:{" + "!!!!!!!!!!!!!!!!!!!!!!" + "}", "unrelated"} {
			require.NoError(t, b.Client.Set(ctx, key, "x", time.Hour).Err())
		}

		for _, batch := range []int{0, 1, 3, MaxScanBatch} {
			ids, recs, errs := scanAll(store, ScanOptions{State: StatePending, Batch: batch})
			require.Empty(t, errs)
			assert.ElementsMatch(t, rs.pending, ids, "batch %d", batch)
			for _, r := range recs {
				assert.Equal(t, StatePending, r.State)
				assert.Equal(t, store.key(r.ID), r.Key)
				assert.Equal(t, 1, r.Attempt)
				assert.Positive(t, r.LeaseLeft)
			}
		}
		ids, _, errs := scanAll(store, ScanOptions{})
		require.Empty(t, errs)
		assert.ElementsMatch(t, slices.Concat(rs.pending, rs.completed, rs.released), ids, "every state by default")
		ids, _, _ = scanAll(store, ScanOptions{State: StateCompleted})
		assert.ElementsMatch(t, rs.completed, ids)
		ids, _, _ = scanAll(store, ScanOptions{State: StateReleased})
		assert.ElementsMatch(t, rs.released, ids)
	})
}

func TestScanStopsWhereAsked(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		store := k.store.(*redisStore)
		rs := makeRecords(t, k, 5)
		ids, _, errs := scanAll(store, ScanOptions{State: StatePending, Limit: 3, Batch: 2})
		require.Empty(t, errs)
		assert.Len(t, ids, 3)
		assert.Subset(t, rs.pending, ids)

		n := 0
		for _, err := range store.Scan(context.Background(), ScanOptions{}) {
			require.NoError(t, err)
			if n++; n == 2 {
				break
			}
		}
		assert.Equal(t, 2, n, "the loop's break ends the listing")
	})
}

// TestScanAsksBoundedBatches: no pipeline holds more than Batch commands.
func TestScanAsksBoundedBatches(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		store := k.store.(*redisStore)
		rs := makeRecords(t, k, 10)
		var sizes pipeSizes
		b.Client.AddHook(&sizes)
		ids, _, errs := scanAll(store, ScanOptions{Batch: 4})
		require.Empty(t, errs)
		assert.Len(t, ids, 30)
		assert.Subset(t, ids, rs.pending)
		require.NotEmpty(t, sizes.all())
		assert.LessOrEqual(t, slices.Max(sizes.all()), 4)
	})
}

// pipeSizes is a go-redis hook that records the size of every pipeline.
type pipeSizes struct {
	mu    sync.Mutex
	sizes []int
}

func (p *pipeSizes) all() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.sizes)
}

func (p *pipeSizes) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (p *pipeSizes) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (p *pipeSizes) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		p.mu.Lock()
		p.sizes = append(p.sizes, len(cmds))
		p.mu.Unlock()
		return next(ctx, cmds)
	}
}

func TestScanReportsCorruptRecordsAndGoesOn(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		store := k.store.(*redisStore)
		rs := makeRecords(t, k, 2)
		ctx := context.Background()
		bad := store.RecordKey("s", "bad")
		require.NoError(t, b.Client.Set(ctx, bad, "not a record", time.Hour).Err())
		ids, _, errs := scanAll(store, ScanOptions{State: StatePending})
		assert.ElementsMatch(t, rs.pending, ids)
		require.Len(t, errs, 1)
		assert.ErrorIs(t, errs[0], ErrCorrupt)

		var got Record
		for r, err := range store.Scan(ctx, ScanOptions{State: StateCompleted}) {
			if err != nil {
				got = r
			}
		}
		assert.Equal(t, bad, got.Key, "the record that cannot be read is named")
		assert.Equal(t, recordID("s", "bad"), got.ID)
	})
}

func TestScanPrefixMatch(t *testing.T) {
	b := redistest.Miniredis(t)
	ctx := context.Background()
	var want []string
	for _, prefix := range []string{"idem-demo:0a0b0c0d:", "idem-demo:1a1b1c1d:"} {
		k, err := NewRedis(b.Client, WithPrefix(prefix))
		require.NoError(t, err)
		_, err = k.Begin(ctx, "", "order-1")
		require.NoError(t, err)
		want = append(want, prefix+"{"+recordID("", "order-1")+"}")
	}
	store, err := openRedisStore(b.Client)
	require.NoError(t, err)
	var keys []string
	for r, err := range store.Scan(ctx, ScanOptions{PrefixMatch: "idem-demo:*:"}) {
		require.NoError(t, err)
		keys = append(keys, r.Key)
	}
	assert.ElementsMatch(t, want, keys)
	ids, _, _ := scanAll(store, ScanOptions{})
	assert.Empty(t, ids, "the store's own prefix holds none")

	glob, err := openRedisStore(b.Client, WithPrefix("a*b?:"))
	require.NoError(t, err)
	k, err := keeperOn(glob)
	require.NoError(t, err)
	_, err = k.Begin(ctx, "", "k")
	require.NoError(t, err)
	require.NoError(t, b.Client.Set(ctx, "aXXbY:{"+recordID("", "k")+"}", "i1R1:1:0:0:::", time.Hour).Err())
	ids, _, _ = scanAll(glob, ScanOptions{})
	assert.Equal(t, []string{recordID("", "k")}, ids, "a prefix's glob characters match themselves")
}

func TestScanRefusesBadOptionsAndClients(t *testing.T) {
	b := redistest.Miniredis(t)
	store, err := openRedisStore(b.Client)
	require.NoError(t, err)
	for _, opts := range []ScanOptions{{Batch: -1}, {Batch: MaxScanBatch + 1}, {Limit: -1}, {State: 9}, {PrefixMatch: "a{b}"}} {
		_, _, errs := scanAll(store, opts)
		require.Len(t, errs, 1, "%+v", opts)
		assert.ErrorIs(t, errs[0], ErrInvalidConfig, "%+v", opts)
	}

	ap, err := b.Client.AutoPipeline()
	require.NoError(t, err)
	t.Cleanup(func() { ap.Close() })
	apStore, err := openRedisStore(ap)
	require.NoError(t, err)
	_, _, errs := scanAll(apStore, ScanOptions{})
	require.Len(t, errs, 1)
	assert.ErrorIs(t, errs[0], errors.ErrUnsupported)

	b.Stop()
	_, _, errs = scanAll(store, ScanOptions{})
	require.Len(t, errs, 1, "an unreachable server ends the listing")
	assert.ErrorIs(t, errs[0], ErrUnavailable)
}

// TestScanCluster lists the records of every master of a real Cluster.
func TestScanCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	client := c.Client(t, nil)
	// Keys placed by their own digests, so that one scope's records are
	// on every master.
	k, err := NewRedis(client, WithLease(time.Hour), WithScopeShards(0))
	require.NoError(t, err)
	store := k.store.(*redisStore)
	rs := makeRecords(t, k, 12)

	masters := map[string]bool{}
	ids, recs, errs := scanAll(store, ScanOptions{State: StatePending, Batch: 5})
	require.Empty(t, errs)
	assert.ElementsMatch(t, rs.pending, ids)
	for _, r := range recs {
		addr, err := masterOf(client, r.Key)
		require.NoError(t, err)
		masters[addr] = true
	}
	assert.Len(t, masters, 3, "the records live on every master, and are all listed")
	ids, _, errs = scanAll(store, ScanOptions{})
	require.Empty(t, errs)
	assert.Len(t, ids, 36)
}

// masterOf returns the address of the master that serves key.
func masterOf(c *redis.ClusterClient, key string) (string, error) {
	n, err := c.MasterForKey(context.Background(), key)
	if err != nil {
		return "", err
	}
	return n.Options().Addr, nil
}

// BenchmarkScan lists 10,000 completed records (200-byte results) on a real
// redis-server: records/s is the listing's speed.
func BenchmarkScan(b *testing.B) {
	be := redistest.Real(b)
	ctx := context.Background()
	store, err := openRedisStore(be.Client)
	require.NoError(b, err)
	const n = 10_000
	pipe := be.Client.Pipeline()
	for i := range n {
		rec := fmt.Sprintf("i1C%d:1:0:0:::\x01b%0200d", 1700000000000000+i, i)
		pipe.Set(ctx, store.RecordKey("s", fmt.Sprint(i)), rec, time.Hour)
	}
	_, err = pipe.Exec(ctx)
	require.NoError(b, err)
	for _, batch := range []int{100, MaxScanBatch} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				got := 0
				for _, err := range store.Scan(ctx, ScanOptions{Batch: batch}) {
					if err != nil {
						b.Fatal(err)
					}
					got++
				}
				if got != n {
					b.Fatalf("listed %d of %d", got, n)
				}
			}
			b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "records/s")
		})
	}
}
