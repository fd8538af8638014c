package idem

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCluster runs the core behaviour, the HTTP middleware, the durability
// option and a manual failover under load on a real Redis Cluster: 3 masters
// with a replica each, started once for all the subtests. The failover runs
// last because it changes the topology.
func TestCluster(t *testing.T) {
	cl := redistest.StartCluster(t, 3, 1)
	cc := cl.Client(t, nil)
	ctx := context.Background()
	err := cc.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error {
		return c.Ping(ctx).Err()
	})
	require.NoError(t, err, "cluster not reachable")

	t.Run("core", func(t *testing.T) { clusterCore(t, cc) })
	t.Run("keys spread over every master", func(t *testing.T) { clusterSpread(t, cc) })
	t.Run("every key of a record in one slot", func(t *testing.T) { clusterOneSlot(t, cc) })
	t.Run("durability", func(t *testing.T) { clusterDurability(t, cc) })
	t.Run("failover under load", func(t *testing.T) { clusterFailover(t, cl, cc) })
}

func clusterKeeper(t *testing.T, c redis.Scripter, ropts []Option, opts ...Option) *Keeper {
	t.Helper()
	s, err := openRedisStore(c, ropts...)
	require.NoError(t, err, "NewRedisStore")
	k, err := keeperOn(s, opts...)
	require.NoError(t, err, "New")
	return k
}

// clusterCore walks the contract's table on the cluster: claim, replay,
// in progress, mismatch, release, takeover after the lease, fencing tokens.
func clusterCore(t *testing.T, cc *redis.ClusterClient) {
	ctx := context.Background()
	k := clusterKeeper(t, cc, nil, WithLease(300*time.Millisecond), WithRetention(time.Minute))

	t.Run("claim, complete, replay", func(t *testing.T) {
		for i := 0; i < 30; i++ {
			key := fmt.Sprintf("core-%d", i)
			runs := 0
			fn := func(context.Context) (string, error) { runs++; return "v" + key, nil }
			for j := 0; j < 3; j++ {
				v, err := Do(ctx, k, "core", key, fn)
				require.NoError(t, err, "Do %s #%d", key, j)
				require.Equal(t, "v"+key, v, "Do %s #%d", key, j)
			}
			require.Equal(t, 1, runs, "times %s ran", key)
		}
	})

	t.Run("in progress and mismatch", func(t *testing.T) {
		k := clusterKeeper(t, cc, nil, WithLease(time.Minute), WithRetention(time.Minute))
		out, err := k.Begin(ctx, "core", "busy", WithFingerprint([]byte("a")))
		require.NoError(t, err, "Begin")
		require.NotNil(t, out.Claim, "Begin = %+v", out)
		_, err = k.Begin(ctx, "core", "busy", WithFingerprint([]byte("a")))
		var ip *InProgressError
		require.ErrorAs(t, err, &ip, "second Begin")
		require.Greater(t, ip.RetryAfter, time.Duration(0), "second Begin: RetryAfter of %v", err)
		_, err = k.Begin(ctx, "core", "busy", WithFingerprint([]byte("b")))
		require.ErrorIs(t, err, ErrMismatch, "Begin with another fingerprint")
		require.NoError(t, out.Claim.Complete(ctx, []byte("done"), 0))
		_, err = k.Begin(ctx, "core", "busy", WithFingerprint([]byte("b")))
		require.ErrorIs(t, err, ErrMismatch, "Begin on the completed record with another fingerprint")
		rep, err := k.Begin(ctx, "core", "busy", WithFingerprint([]byte("a")))
		require.NoError(t, err, "replay")
		assert.True(t, rep.Replayed, "replay = %+v", rep)
		assert.Equal(t, "done", string(rep.Value), "replayed value")
		assert.Equal(t, out.Token, rep.Token, "replayed token")
	})

	t.Run("release, extend, takeover, tokens", func(t *testing.T) {
		first, err := k.Begin(ctx, "core", "lease")
		require.NoError(t, err, "Begin")
		require.NotNil(t, first.Claim, "Begin = %+v", first)
		require.NoError(t, first.Claim.Extend(ctx), "Extend")
		require.NoError(t, first.Claim.Release(ctx), "Release")
		second, err := k.Begin(ctx, "core", "lease")
		require.NoError(t, err, "Begin after release")
		require.NotNil(t, second.Claim, "Begin after release = %+v", second)
		assert.Greater(t, second.Token, first.Token, "after release: token")
		assert.Equal(t, 2, second.Claim.Attempt(), "after release: attempt")
		assert.False(t, second.Claim.Recovered(), "after release: recovered")
		require.ErrorIs(t, first.Claim.Complete(ctx, []byte("stale"), 0), ErrLeaseLost, "Complete by the released claim")
		// Let the second claim's lease run out, then take it over.
		var third Outcome
		for deadline := time.Now().Add(10 * time.Second); ; {
			third, err = k.Begin(ctx, "core", "lease")
			if err == nil || !errors.Is(err, ErrInProgress) || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		require.NoError(t, err, "Begin after the lease")
		require.NotNil(t, third.Claim, "Begin after the lease = %+v", third)
		assert.True(t, third.Claim.Recovered(), "takeover: recovered")
		assert.Greater(t, third.Token, second.Token, "takeover: token")
		assert.Equal(t, 3, third.Claim.Attempt(), "takeover: attempt")
		for _, stale := range []*Claim{first.Claim, second.Claim} {
			require.ErrorIs(t, stale.Complete(ctx, []byte("stale"), 0), ErrLeaseLost, "Complete by token %d", stale.Token())
			require.ErrorIs(t, stale.Extend(ctx), ErrLeaseLost, "Extend by token %d", stale.Token())
		}
		require.NoError(t, third.Claim.Complete(ctx, []byte("third"), 0))
		rep, err := k.Begin(ctx, "core", "lease")
		require.NoError(t, err, "replay; want the third holder's result")
		assert.True(t, rep.Replayed, "replay = %+v; want the third holder's result", rep)
		assert.Equal(t, "third", string(rep.Value), "replay: want the third holder's result")
		assert.Equal(t, third.Token, rep.Token, "replay: want the third holder's token")
	})
}

// clusterMasterKeys returns the number of keys with prefix on each master.
// clusterMasterKeys returns the record keys under prefix on each master.
func clusterMasterKeys(t *testing.T, cc *redis.ClusterClient, prefix string) map[string][]string {
	t.Helper()
	ctx := context.Background()
	var mu sync.Mutex
	keys := map[string][]string{}
	err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		var found []string
		iter := c.Scan(ctx, 0, prefix+"{"+strings.Repeat("?", idLen)+"}", 1000).Iterator()
		for iter.Next(ctx) {
			found = append(found, iter.Val())
		}
		mu.Lock()
		keys[c.Options().Addr] = found
		mu.Unlock()
		return iter.Err()
	})
	require.NoError(t, err, "scanning the masters")
	return keys
}

func clusterSpread(t *testing.T, cc *redis.ClusterClient) {
	ctx := context.Background()
	k := clusterKeeper(t, cc, []Option{WithPrefix("spread:")}, WithScopeShards(0)) // keys placed by digest
	for i := 0; i < 60; i++ {
		_, err := Do(ctx, k, "spread", strconv.Itoa(i), func(context.Context) (int, error) { return i, nil })
		require.NoError(t, err)
	}
	perMaster := clusterMasterKeys(t, cc, "spread:")
	total := 0
	for addr, keys := range perMaster {
		t.Logf("master %s holds %d records", addr, len(keys))
		assert.NotEmpty(t, keys, "master %s holds no record: keys are not spread", addr)
		total += len(keys)
	}
	require.Len(t, perMaster, 3, "masters holding records, want 3")
	require.Equal(t, 60, total, "records on the %d masters", len(perMaster))
}

// clusterOneSlot proves that every Redis key a record ever has (pending,
// completed, released) carries the record's hash tag and sits in the slot of
// that tag, on the master that serves the slot.
func clusterOneSlot(t *testing.T, cc *redis.ClusterClient) {
	ctx := context.Background()
	k := clusterKeeper(t, cc, []Option{WithPrefix("slot:")}, WithScopeShards(0)) // a record id a tag
	for i := 0; i < 30; i++ {
		key := fmt.Sprintf("slot-%d", i)
		out, err := k.Begin(ctx, "slots", key)
		require.NoError(t, err, "Begin %s", key)
		require.NotNil(t, out.Claim, "Begin %s = %+v", key, out)
		switch i % 3 {
		case 0: // pending
		case 1:
			err = out.Claim.Complete(ctx, []byte("x"), 0)
		case 2:
			err = out.Claim.Release(ctx)
		}
		require.NoError(t, err)
	}
	perMaster := clusterMasterKeys(t, cc, "slot:")
	ids := map[string]int{}
	for addr, keys := range perMaster {
		node := redis.NewClient(&redis.Options{Addr: addr})
		defer node.Close()
		for _, key := range keys {
			open, end := strings.IndexByte(key, '{'), strings.IndexByte(key, '}')
			require.True(t, open >= 0 && end >= open+2, "key %q has no hash tag", key)
			tag := key[open+1 : end]
			ids[tag]++
			slot, err := node.ClusterKeySlot(ctx, key).Result()
			require.NoError(t, err)
			tagSlot, err := node.ClusterKeySlot(ctx, tag).Result()
			require.NoError(t, err)
			require.Equal(t, tagSlot, slot, "key %q is in slot %d, its tag %q in slot %d", key, slot, tag, tagSlot)
			master, err := cc.MasterForKey(ctx, key)
			require.NoError(t, err)
			require.Equal(t, master.Options().Addr, addr, "key %q found on %s, its slot is served by %s", key, addr, master.Options().Addr)
		}
	}
	require.Len(t, ids, 30, "records found, want 30")
	for i := 0; i < 30; i++ {
		id := recordID("slots", fmt.Sprintf("slot-%d", i))
		require.Equal(t, 1, ids[id], "keys of record %s", id)
	}
}

// clusterDurability runs WithReplicas on the cluster: each master has one
// replica, so waiting for one succeeds and waiting for two cannot.
func clusterDurability(t *testing.T, cc *redis.ClusterClient) {
	ctx := context.Background()
	k := clusterKeeper(t, cc, []Option{WithPrefix("dur:"), WithReplicas(1, time.Second)})
	for i := 0; i < 30; i++ {
		key := strconv.Itoa(i)
		_, err := Do(ctx, k, "dur", key, func(context.Context) (int, error) { return i, nil })
		require.NoError(t, err, "Do %s with one replica acknowledging", key)
		v, err := Do(ctx, k, "dur", key, func(context.Context) (int, error) { return -1, nil })
		require.NoError(t, err, "replay %s", key)
		require.Equal(t, i, v, "replay %s", key)
	}
	k2 := clusterKeeper(t, cc, []Option{WithPrefix("dur2:"), WithReplicas(2, 500*time.Millisecond)})
	ran := false
	_, err := Do(ctx, k2, "dur", "two", func(context.Context) (int, error) { ran = true; return 1, nil })
	var re *ReplicationError
	const want = "Do waiting for 2 of 1 replicas: want a claim *ReplicationError 1 of 2"
	require.ErrorAs(t, err, &re, want)
	assert.Equal(t, "claim", re.Op, "%s; got %v", want, err)
	assert.Equal(t, 1, re.Acked, "%s; got %v", want, err)
	assert.Equal(t, 2, re.Wanted, "%s; got %v", want, err)
	assert.ErrorIs(t, err, ErrNotReplicated, want)
	assert.ErrorIs(t, err, ErrUnavailable, want)
	assert.False(t, ran, "the operation ran although its claim was not replicated")
}

// clusterFailover runs Do on fresh keys from several workers while one
// replica takes over its master with CLUSTER FAILOVER, and checks that no
// operation acknowledged before, during or after the failover runs again, and
// that every failure is typed.
func clusterFailover(t *testing.T, cl *redistest.Cluster, cc *redis.ClusterClient) {
	ctx := context.Background()
	k := clusterKeeper(t, cc, []Option{WithPrefix("fo:")}, WithLease(time.Second), WithRetention(time.Minute))

	var (
		mu       sync.Mutex
		runs     = map[string]int{}
		acked    []string
		phase    atomic.Int32 // 0 before, 1 during, 2 after the failover
		ackedIn  [3]int
		failures = map[string]int{}
	)
	fn := func(key string) func(context.Context) (string, error) {
		return func(context.Context) (string, error) {
			mu.Lock()
			runs[key]++
			mu.Unlock()
			return key, nil
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var untyped []error
	for w := 0; w < 6; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Until stopped, after the failover: a failover slow on a
			// busy machine must not use a fixed budget of keys up. The
			// cap only bounds the test.
			for i := 0; i < 60000; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("w%d-%d", w, i)
				p := phase.Load()
				_, err := Do(ctx, k, "fo", key, fn(key))
				mu.Lock()
				switch {
				case err == nil:
					acked = append(acked, key)
					ackedIn[p]++
				case errors.Is(err, ErrUnavailable):
					failures["unavailable"]++
				case errors.Is(err, ErrInProgress):
					failures["in progress"]++
				case errors.Is(err, ErrLeaseLost):
					failures["lease lost"]++
				default:
					untyped = append(untyped, err)
				}
				// Retry an acknowledged key now and then: it must replay.
				var old string
				if len(acked) > 0 && i%4 == 0 {
					old = acked[(i*7919)%len(acked)]
				}
				mu.Unlock()
				if old != "" {
					if v, err := Do(ctx, k, "fo", old, fn(old)); err == nil {
						assert.Equal(t, old, v, "replay of %s", old)
					}
				}
			}
		}()
	}
	waitAcked := func(n int) {
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			mu.Lock()
			got := len(acked)
			mu.Unlock()
			if got >= n {
				return
			}
		}
	}
	// A client that learns the slot map now and not again until the
	// failover has moved slots under it, for WithReplicas below.
	stale := cl.Client(t, nil)
	require.NoError(t, stale.Ping(ctx).Err())
	waitAcked(200)
	phase.Store(1)
	cl.Failover(t, cl.Replicas[0][0])
	phase.Store(2)
	mu.Lock()
	after := len(acked) + 200
	mu.Unlock()
	waitAcked(after)
	close(stop)
	wg.Wait()

	// Every acknowledged key replays; its operation ran exactly once.
	duplicates := 0
	for _, key := range acked {
		_, err := Do(ctx, k, "fo", key, fn(key))
		assert.NoError(t, err, "Do %s after the failover", key)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, key := range acked {
		if !assert.Equal(t, 1, runs[key], "times %s ran", key) {
			duplicates++
		}
	}
	for _, err := range untyped {
		assert.NoError(t, err, "untyped failure")
	}
	t.Logf("failover: acknowledged %d before, %d during, %d after; failures %v; duplicate executions among acknowledged: %d",
		ackedIn[0], ackedIn[1], ackedIn[2], failures, duplicates)
	require.True(t, ackedIn[0] != 0 && ackedIn[2] != 0, "no load around the failover: %v", ackedIn)

	// WithReplicas sends the script and WAIT to the master of the key's slot
	// as the client last knew it: on the old master, now a replica, the
	// script is refused with MOVED before it runs, and the store tries again
	// on the new master.
	kd := clusterKeeper(t, stale, []Option{WithPrefix("fo-dur:"), WithReplicas(1, 2*time.Second)})
	for i := 0; i < 30; i++ {
		key := strconv.Itoa(i)
		_, err := Do(ctx, kd, "fo", key, func(context.Context) (int, error) { return i, nil })
		require.NoError(t, err, "WithReplicas after the failover, key %s", key)
	}
}
