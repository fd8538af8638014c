package idem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func durableKeeper(t *testing.T, c redis.Scripter, ropts ...Option) *Keeper {
	t.Helper()
	s, err := openRedisStore(c, ropts...)
	require.NoError(t, err, "NewRedisStore")
	k, err := keeperOn(s, WithLease(2*time.Second), WithRetention(time.Hour))
	require.NoError(t, err)
	return k
}

// TestWithReplicasOnPlainReplication shows what the option answers: success
// when the replica acknowledges, a *ReplicationError for the claim when too
// few replicas exist, and for the completion when the replica stops
// acknowledging between claim and complete; the completion is kept on the
// master then, and replayed from there.
func TestWithReplicasOnPlainReplication(t *testing.T) {
	master := redistest.Start(t)
	replica := redistest.StartReplica(t, master.Addr)
	mc := master.Client(t)
	ctx := context.Background()

	k := durableKeeper(t, mc, WithReplicas(1, time.Second))
	v, err := Do(ctx, k, "s", "ok", func(context.Context) (int, error) { return 7, nil })
	require.NoError(t, err, "Do")
	require.Equal(t, 7, v, "Do")
	// The replica has the completed record.
	rk := durableKeeper(t, replica.Client(t))
	// A replica is read-only, but a completed record replays without a write.
	onReplica, err := rk.Begin(ctx, "s", "ok")
	require.NoError(t, err, "Begin on the replica; want the replay")
	require.True(t, onReplica.Replayed, "Begin on the replica = %+v; want the replay", onReplica)

	two := durableKeeper(t, mc, WithReplicas(2, 500*time.Millisecond))
	ran := false
	_, err = Do(ctx, two, "s", "two", func(context.Context) (int, error) { ran = true; return 1, nil })
	var re *ReplicationError
	const wantClaim = "Do waiting for 2 replicas of 1: want a claim *ReplicationError 1 of 2"
	require.ErrorAs(t, err, &re, wantClaim)
	require.Equal(t, "claim", re.Op, "%s; got %v", wantClaim, err)
	require.Equal(t, 1, re.Acked, "%s; got %v", wantClaim, err)
	require.Equal(t, 2, re.Wanted, "%s; got %v", wantClaim, err)
	require.False(t, ran, "Do waiting for 2 replicas of 1 ran the operation")

	// The replica stops acknowledging between claim and completion.
	out, err := k.Begin(ctx, "s", "late")
	require.NoError(t, err, "Begin")
	require.NotNil(t, out.Claim, "Begin = %+v", out)
	replica.Pause(t)
	err = out.Claim.Complete(ctx, []byte("result"), 0)
	replica.Resume(t)
	const wantComplete = "Complete while the replica is paused: want a complete *ReplicationError 0 of 1"
	require.ErrorAs(t, err, &re, wantComplete)
	require.Equal(t, "complete", re.Op, "%s; got %v", wantComplete, err)
	require.Equal(t, 0, re.Acked, "%s; got %v", wantComplete, err)
	require.ErrorIs(t, err, ErrUnavailable, wantComplete)
	plain := durableKeeper(t, mc)
	rep, err := plain.Begin(ctx, "s", "late")
	require.NoError(t, err, "Begin on the master after the unreplicated completion; want the replay")
	assert.True(t, rep.Replayed, "Begin on the master after the unreplicated completion = %+v; want the replay", rep)
	assert.Equal(t, "result", string(rep.Value), "Begin on the master after the unreplicated completion: replayed value")
}

// TestWithReplicasReloadsScripts: a master that lost its script cache answers
// NOSCRIPT inside the pipeline; the store loads the script and goes on.
func TestWithReplicasReloadsScripts(t *testing.T) {
	master := redistest.Start(t)
	redistest.StartReplica(t, master.Addr)
	mc := master.Client(t)
	ctx := context.Background()
	k := durableKeeper(t, mc, WithReplicas(1, time.Second))
	for i := 0; i < 3; i++ {
		require.NoError(t, mc.ScriptFlush(ctx).Err())
		key := fmt.Sprint(i)
		_, err := Do(ctx, k, "s", key, func(context.Context) (int, error) { return i, nil })
		require.NoError(t, err, "Do after SCRIPT FLUSH")
	}
}

// TestFailoverLosesAcknowledgedCompletions kills a master (SIGKILL) right
// after acknowledged completions, promotes its replica (REPLICAOF NO ONE), and
// counts the acknowledged completions the new master does not have, without
// and with WithReplicas. The replica replicates through a fault proxy. Two
// scenarios: the replica keeping up under load, and the replication link
// lagging (the proxy holds the master's stream back) when the master dies.
// With the option no acknowledged completion may be lost.
func TestFailoverLosesAcknowledgedCompletions(t *testing.T) {
	redistest.Long(t)
	for _, lagging := range []bool{false, true} {
		for _, durable := range []bool{false, true} {
			name := fmt.Sprintf("lagging=%v/WithReplicas=%v", lagging, durable)
			t.Run(name, func(t *testing.T) {
				acked, lost := failoverLoss(t, lagging, durable)
				t.Logf("%s: %d completions acknowledged, %d lost by the failover", name, acked, lost)
				if durable {
					assert.Zero(t, lost, "acknowledged completions lost with WithReplicas")
				}
				assert.NotZero(t, acked, "no completion was acknowledged")
			})
		}
	}
}

func failoverLoss(t *testing.T, lagging, durable bool) (acked, lost int) {
	master := redistest.Start(t)
	link, err := faultproxy.New(master.Addr, 1)
	require.NoError(t, err)
	t.Cleanup(func() { link.Close() })
	replica := redistest.StartReplica(t, link.Addr())
	mc := redis.NewClient(&redis.Options{Addr: master.Addr, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { mc.Close() })
	var ropts []Option
	if durable {
		ropts = append(ropts, WithReplicas(1, time.Second))
	}
	k := durableKeeper(t, mc, ropts...)
	ctx := context.Background()

	var (
		mu      sync.Mutex
		keys    []string
		killed  atomic.Bool
		untyped []error
	)
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(keys) }
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 20000 && !killed.Load(); i++ {
				key := fmt.Sprintf("w%d-%d", w, i)
				_, err := Do(ctx, k, "loss", key, func(context.Context) (string, error) { return key, nil })
				mu.Lock()
				if err == nil {
					keys = append(keys, key)
				} else if !errors.Is(err, ErrUnavailable) {
					untyped = append(untyped, err)
				}
				mu.Unlock()
				if err != nil && killed.Load() {
					return
				}
			}
		}()
	}
	waitFor := func(cond func() bool, max time.Duration) {
		for deadline := time.Now().Add(max); !cond() && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
	}
	waitFor(func() bool { return count() >= 300 }, 30*time.Second)
	if lagging {
		link.Set(faultproxy.Faults{Delay: time.Minute})
		base := count()
		// Until completions are acknowledged while the replica lags, or
		// long enough to show that none are.
		waitFor(func() bool { return count() >= base+50 }, 300*time.Millisecond)
	} else {
		// Right after an acknowledged completion.
		base := count()
		waitFor(func() bool { return count() > base }, 10*time.Second)
	}
	mu.Lock()
	killed.Store(true)
	master.Stop()
	ackedKeys := append([]string(nil), keys...)
	mu.Unlock()
	wg.Wait()
	// What the link still holds is lost with the master.
	link.Close()
	replica.Promote(t)

	rk := durableKeeper(t, replica.Client(t))
	for _, key := range ackedKeys {
		out, err := rk.Begin(ctx, "loss", key)
		switch {
		case err == nil && out.Replayed:
		case err == nil && out.Claim != nil:
			lost++ // the record is gone: a retry runs the operation again
		case errors.Is(err, ErrInProgress):
			lost++ // the claim survived, its result did not: a retry runs the operation again once the lease ends
		default:
			require.Failf(t, "neither a replay, a claim nor ErrInProgress", "Begin %s on the promoted replica: %+v, %v", key, out, err)
		}
	}
	for _, err := range untyped {
		assert.NoError(t, err, "untyped failure")
	}
	return len(ackedKeys), lost
}

// TestRedirectAddr: the address of a MOVED or ASK reply is put in the
// host:port form of go-redis's node clients; Redis writes IPv6 addresses
// without brackets.
func TestRedirectAddr(t *testing.T) {
	for _, tc := range []struct {
		reply   string
		addr    string
		ask, ok bool
	}{
		{reply: "MOVED 3999 127.0.0.1:6381", addr: "127.0.0.1:6381", ok: true},
		{reply: "ASK 3999 127.0.0.1:6381", addr: "127.0.0.1:6381", ask: true, ok: true},
		{reply: "ASK 3999 ::1:6381", addr: "[::1]:6381", ask: true, ok: true},
		{reply: "MOVED 3999 redis-2.example:6379", addr: "redis-2.example:6379", ok: true},
		{reply: "TRYAGAIN Multiple keys request during rehashing of slot"},
		{reply: "ERR something else"},
	} {
		addr, ask, ok := redirectAddr(errors.New(tc.reply))
		assert.Equal(t, tc.ok, ok, tc.reply)
		assert.Equal(t, tc.ask, ask, tc.reply)
		assert.Equal(t, tc.addr, addr, tc.reply)
	}
}

// TestCompactClaimResentWaitsForReplicas: a claim answered by a resent script
// (its first reply lost) waits for the replicas as a new one does. With WithReplicas(1, ...) on a
// master that has no replica, no claim may be acknowledged (every one is a
// *ReplicationError, as TestBatchWithReplicas asserts on a clean line). When
// the claim's reply is lost and go-redis sends the script again (with its
// WAIT), a claim kept in a record is still refused (the second run answers
// code 1, "written"), but a compact claim is acknowledged: the second run
// answers code 10 ("claimed by an earlier run of this call"), which the
// claim step's wrote() does not count as a write, so WAIT's 0 is ignored.
func TestCompactClaimResentWaitsForReplicas(t *testing.T) {
	srv := redistest.Start(t) // a master with no replica: WAIT 1 answers 0
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { c.Close() })
	h := newScriptFaults(1, true, 0) // every script sent twice, the first reply dropped
	c.AddHook(h)
	k, err := NewRedis(c, WithReplicas(1, 50*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, k.store.(*redisStore).LoadScripts(ctx))
	h.on.Store(true)

	for _, compact := range []bool{false, true} {
		t.Run(fmt.Sprintf("compact=%v", compact), func(t *testing.T) {
			keys := []string{fmt.Sprint("a", compact), fmt.Sprint("b", compact), fmt.Sprint("c", compact)}
			var opts []Option
			if compact {
				opts = append(opts, withCompactClaims())
			}
			res, err := k.batchBegin(ctx, "s", keys, opts...)
			require.NoError(t, err)
			for i, r := range res {
				var re *ReplicationError
				assert.True(t, errors.As(r.Err, &re), "%s: a claim no replica acknowledged was answered %v (claim %v)", keys[i], r.Err, r.Outcome.Claim != nil)
			}
		})
	}

	// Consume: the handler runs on a claim no replica has.
	h.on.Store(true)
	ran := 0
	_, err = Consume(ctx, k, "s", []string{"m1", "m2"}, func(m string) string { return m }, func(context.Context, string) error {
		ran++
		return nil
	})
	require.NoError(t, err)
	assert.Zero(t, ran, "handlers ran on claims that no replica acknowledged")
}
