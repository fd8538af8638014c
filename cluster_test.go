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
)

// TestCluster runs the core behaviour, the HTTP middleware, the durability
// option and a manual failover under load on a real Redis Cluster: 3 masters
// with a replica each, started once for all the subtests. The failover runs
// last because it changes the topology.
func TestCluster(t *testing.T) {
	cl := redistest.StartCluster(t, 3, 1)
	cc := cl.Client(t, nil)
	ctx := context.Background()
	if err := cc.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error {
		return c.Ping(ctx).Err()
	}); err != nil {
		t.Fatalf("cluster not reachable: %v", err)
	}

	t.Run("core", func(t *testing.T) { clusterCore(t, cc) })
	t.Run("keys spread over every master", func(t *testing.T) { clusterSpread(t, cc) })
	t.Run("every key of a record in one slot", func(t *testing.T) { clusterOneSlot(t, cc) })
	t.Run("durability", func(t *testing.T) { clusterDurability(t, cc) })
	t.Run("failover under load", func(t *testing.T) { clusterFailover(t, cl, cc) })
}

func clusterKeeper(t *testing.T, c redis.Scripter, ropts []Option, opts ...Option) *Keeper {
	t.Helper()
	s, err := NewRedisStore(c, ropts...)
	if err != nil {
		t.Fatalf("NewRedisStore: %v", err)
	}
	k, err := New(s, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
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
				if err != nil || v != "v"+key {
					t.Fatalf("Do %s #%d = %q, %v", key, j, v, err)
				}
			}
			if runs != 1 {
				t.Fatalf("%s ran %d times, want 1", key, runs)
			}
		}
	})

	t.Run("in progress and mismatch", func(t *testing.T) {
		k := clusterKeeper(t, cc, nil, WithLease(time.Minute), WithRetention(time.Minute))
		out, err := k.Begin(ctx, "core", "busy", WithFingerprint([]byte("a")))
		if err != nil || out.Claim == nil {
			t.Fatalf("Begin = %+v, %v", out, err)
		}
		_, err = k.Begin(ctx, "core", "busy", WithFingerprint([]byte("a")))
		var ip *InProgressError
		if !errors.As(err, &ip) || ip.RetryAfter <= 0 {
			t.Fatalf("second Begin: %v, want an *InProgressError", err)
		}
		if _, err := k.Begin(ctx, "core", "busy", WithFingerprint([]byte("b"))); !errors.Is(err, ErrMismatch) {
			t.Fatalf("Begin with another fingerprint: %v, want ErrMismatch", err)
		}
		if err := out.Claim.Complete(ctx, []byte("done"), 0); err != nil {
			t.Fatal(err)
		}
		if _, err := k.Begin(ctx, "core", "busy", WithFingerprint([]byte("b"))); !errors.Is(err, ErrMismatch) {
			t.Fatalf("Begin on the completed record with another fingerprint: %v, want ErrMismatch", err)
		}
		rep, err := k.Begin(ctx, "core", "busy", WithFingerprint([]byte("a")))
		if err != nil || !rep.Replayed || string(rep.Value) != "done" || rep.Token != out.Token {
			t.Fatalf("replay = %+v, %v", rep, err)
		}
	})

	t.Run("release, extend, takeover, tokens", func(t *testing.T) {
		first, err := k.Begin(ctx, "core", "lease")
		if err != nil || first.Claim == nil {
			t.Fatalf("Begin = %+v, %v", first, err)
		}
		if err := first.Claim.Extend(ctx); err != nil {
			t.Fatalf("Extend: %v", err)
		}
		if err := first.Claim.Release(ctx); err != nil {
			t.Fatalf("Release: %v", err)
		}
		second, err := k.Begin(ctx, "core", "lease")
		if err != nil || second.Claim == nil {
			t.Fatalf("Begin after release = %+v, %v", second, err)
		}
		if second.Token <= first.Token || second.Claim.Attempt() != 2 || second.Claim.Recovered() {
			t.Fatalf("after release: token %d (was %d), attempt %d, recovered %v", second.Token, first.Token, second.Claim.Attempt(), second.Claim.Recovered())
		}
		if err := first.Claim.Complete(ctx, []byte("stale"), 0); !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("Complete by the released claim: %v, want ErrLeaseLost", err)
		}
		// Let the second claim's lease run out, then take it over.
		var third Outcome
		for deadline := time.Now().Add(10 * time.Second); ; {
			third, err = k.Begin(ctx, "core", "lease")
			if err == nil || !errors.Is(err, ErrInProgress) || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if err != nil || third.Claim == nil {
			t.Fatalf("Begin after the lease = %+v, %v", third, err)
		}
		if !third.Claim.Recovered() || third.Token <= second.Token || third.Claim.Attempt() != 3 {
			t.Fatalf("takeover: recovered %v, token %d (was %d), attempt %d", third.Claim.Recovered(), third.Token, second.Token, third.Claim.Attempt())
		}
		for _, stale := range []*Claim{first.Claim, second.Claim} {
			if err := stale.Complete(ctx, []byte("stale"), 0); !errors.Is(err, ErrLeaseLost) {
				t.Fatalf("Complete by token %d: %v, want ErrLeaseLost", stale.Token(), err)
			}
			if err := stale.Extend(ctx); !errors.Is(err, ErrLeaseLost) {
				t.Fatalf("Extend by token %d: %v, want ErrLeaseLost", stale.Token(), err)
			}
		}
		if err := third.Claim.Complete(ctx, []byte("third"), 0); err != nil {
			t.Fatal(err)
		}
		rep, err := k.Begin(ctx, "core", "lease")
		if err != nil || !rep.Replayed || string(rep.Value) != "third" || rep.Token != third.Token {
			t.Fatalf("replay = %+v, %v; want the third holder's result", rep, err)
		}
	})
}

// clusterMasterKeys returns the number of keys with prefix on each master.
func clusterMasterKeys(t *testing.T, cc *redis.ClusterClient, prefix string) map[string][]string {
	t.Helper()
	ctx := context.Background()
	var mu sync.Mutex
	keys := map[string][]string{}
	err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		var found []string
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			found = append(found, iter.Val())
		}
		mu.Lock()
		keys[c.Options().Addr] = found
		mu.Unlock()
		return iter.Err()
	})
	if err != nil {
		t.Fatalf("scanning the masters: %v", err)
	}
	return keys
}

func clusterSpread(t *testing.T, cc *redis.ClusterClient) {
	ctx := context.Background()
	k := clusterKeeper(t, cc, []Option{WithPrefix("spread:")})
	for i := 0; i < 60; i++ {
		if _, err := Do(ctx, k, "spread", strconv.Itoa(i), func(context.Context) (int, error) { return i, nil }); err != nil {
			t.Fatal(err)
		}
	}
	perMaster := clusterMasterKeys(t, cc, "spread:")
	total := 0
	for addr, keys := range perMaster {
		t.Logf("master %s holds %d records", addr, len(keys))
		if len(keys) == 0 {
			t.Errorf("master %s holds no record: keys are not spread", addr)
		}
		total += len(keys)
	}
	if len(perMaster) != 3 || total != 60 {
		t.Fatalf("%d masters hold %d records, want 3 masters and 60 records", len(perMaster), total)
	}
}

// clusterOneSlot proves that every Redis key a record ever has (pending,
// completed, released) carries the record's hash tag and sits in the slot of
// that tag, on the master that serves the slot.
func clusterOneSlot(t *testing.T, cc *redis.ClusterClient) {
	ctx := context.Background()
	k := clusterKeeper(t, cc, []Option{WithPrefix("slot:")})
	for i := 0; i < 30; i++ {
		key := fmt.Sprintf("slot-%d", i)
		out, err := k.Begin(ctx, "slots", key)
		if err != nil || out.Claim == nil {
			t.Fatalf("Begin = %+v, %v", out, err)
		}
		switch i % 3 {
		case 0: // pending
		case 1:
			err = out.Claim.Complete(ctx, []byte("x"), 0)
		case 2:
			err = out.Claim.Release(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	perMaster := clusterMasterKeys(t, cc, "slot:")
	ids := map[string]int{}
	for addr, keys := range perMaster {
		node := redis.NewClient(&redis.Options{Addr: addr})
		defer node.Close()
		for _, key := range keys {
			open, end := strings.IndexByte(key, '{'), strings.IndexByte(key, '}')
			if open < 0 || end < open+2 {
				t.Fatalf("key %q has no hash tag", key)
			}
			tag := key[open+1 : end]
			ids[tag]++
			slot, err := node.ClusterKeySlot(ctx, key).Result()
			if err != nil {
				t.Fatal(err)
			}
			tagSlot, err := node.ClusterKeySlot(ctx, tag).Result()
			if err != nil {
				t.Fatal(err)
			}
			if slot != tagSlot {
				t.Fatalf("key %q is in slot %d, its tag %q in slot %d", key, slot, tag, tagSlot)
			}
			master, err := cc.MasterForKey(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			if master.Options().Addr != addr {
				t.Fatalf("key %q found on %s, its slot is served by %s", key, addr, master.Options().Addr)
			}
		}
	}
	if len(ids) != 30 {
		t.Fatalf("found %d records, want 30", len(ids))
	}
	for i := 0; i < 30; i++ {
		id := recordID("slots", fmt.Sprintf("slot-%d", i))
		if ids[id] != 1 {
			t.Fatalf("record %s has %d keys, want 1", id, ids[id])
		}
	}
}

// clusterDurability runs WithReplicas on the cluster: each master has one
// replica, so waiting for one succeeds and waiting for two cannot.
func clusterDurability(t *testing.T, cc *redis.ClusterClient) {
	ctx := context.Background()
	k := clusterKeeper(t, cc, []Option{WithPrefix("dur:"), WithReplicas(1, time.Second)})
	for i := 0; i < 30; i++ {
		key := strconv.Itoa(i)
		if _, err := Do(ctx, k, "dur", key, func(context.Context) (int, error) { return i, nil }); err != nil {
			t.Fatalf("Do %s with one replica acknowledging: %v", key, err)
		}
		if v, err := Do(ctx, k, "dur", key, func(context.Context) (int, error) { return -1, nil }); err != nil || v != i {
			t.Fatalf("replay %s = %d, %v", key, v, err)
		}
	}
	k2 := clusterKeeper(t, cc, []Option{WithPrefix("dur2:"), WithReplicas(2, 500*time.Millisecond)})
	ran := false
	_, err := Do(ctx, k2, "dur", "two", func(context.Context) (int, error) { ran = true; return 1, nil })
	var re *ReplicationError
	if !errors.As(err, &re) || re.Op != "claim" || re.Acked != 1 || re.Wanted != 2 ||
		!errors.Is(err, ErrNotReplicated) || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Do waiting for 2 of 1 replicas: %v, want a claim *ReplicationError 1 of 2", err)
	}
	if ran {
		t.Fatal("the operation ran although its claim was not replicated")
	}
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
			for i := 0; i < 3000; i++ {
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
					if v, err := Do(ctx, k, "fo", old, fn(old)); err == nil && v != old {
						t.Errorf("replay of %s = %q", old, v)
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
	if err := stale.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
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
		if _, err := Do(ctx, k, "fo", key, fn(key)); err != nil {
			t.Errorf("Do %s after the failover: %v", key, err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, key := range acked {
		if runs[key] != 1 {
			duplicates++
			t.Errorf("%s ran %d times", key, runs[key])
		}
	}
	for _, err := range untyped {
		t.Errorf("untyped failure: %v", err)
	}
	t.Logf("failover: acknowledged %d before, %d during, %d after; failures %v; duplicate executions among acknowledged: %d",
		ackedIn[0], ackedIn[1], ackedIn[2], failures, duplicates)
	if ackedIn[0] == 0 || ackedIn[2] == 0 {
		t.Fatalf("no load around the failover: %v", ackedIn)
	}

	// WithReplicas sends the script and WAIT to the master of the key's slot
	// as the client last knew it: on the old master, now a replica, the
	// script is refused with MOVED before it runs, and the store tries again
	// on the new master.
	kd := clusterKeeper(t, stale, []Option{WithPrefix("fo-dur:"), WithReplicas(1, 2*time.Second)})
	for i := 0; i < 30; i++ {
		key := strconv.Itoa(i)
		if _, err := Do(ctx, kd, "fo", key, func(context.Context) (int, error) { return i, nil }); err != nil {
			t.Fatalf("WithReplicas after the failover, key %s: %v", key, err)
		}
	}
}
