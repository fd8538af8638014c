package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// evictionStore returns a redisStore on client.
func evictionStore(t *testing.T, client redis.Scripter) *redisStore {
	t.Helper()
	s, err := openRedisStore(client)
	require.NoError(t, err)
	return s
}

// requireEviction asserts that err is one *EvictionError for addr, matching
// ErrEvictionPolicy with policy and maxMemory, and returns it.
func requireEviction(t *testing.T, err error, addr, policy string, maxMemory int64) *EvictionError {
	t.Helper()
	require.ErrorIs(t, err, ErrEvictionPolicy)
	assert.NotErrorIs(t, err, ErrEvictionUnchecked)
	assert.NotErrorIs(t, err, ErrUnavailable)
	var ee *EvictionError
	require.ErrorAs(t, err, &ee)
	assert.Equal(t, addr, ee.Addr)
	assert.Equal(t, policy, ee.Policy)
	assert.Equal(t, maxMemory, ee.MaxMemory)
	assert.NoError(t, ee.Err)
	assert.Contains(t, err.Error(), policy)
	return ee
}

// requireUnchecked asserts that err is an *EvictionError matching
// ErrEvictionUnchecked only, and returns it.
func requireUnchecked(t *testing.T, err error) *EvictionError {
	t.Helper()
	require.ErrorIs(t, err, ErrEvictionUnchecked)
	assert.NotErrorIs(t, err, ErrEvictionPolicy)
	assert.NotErrorIs(t, err, ErrUnavailable)
	var ee *EvictionError
	require.ErrorAs(t, err, &ee)
	require.Error(t, ee.Err)
	return ee
}

// TestCheckEviction reads the policy of one real redis-server, set with
// CONFIG SET between the cases.
func TestCheckEviction(t *testing.T) {
	srv := redistest.Start(t, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
	client := redistest.NewClient(t, srv.Addr)
	store := evictionStore(t, client)
	ctx := context.Background()
	set := func(t *testing.T, param, value string) {
		t.Helper()
		require.NoError(t, client.ConfigSet(ctx, param, value).Err())
	}

	t.Run("noeviction", func(t *testing.T) {
		require.NoError(t, store.CheckEviction(ctx))
	})
	for _, policy := range []string{"allkeys-lru", "volatile-lru", "allkeys-lfu", "volatile-ttl", "allkeys-random"} {
		t.Run(policy, func(t *testing.T) {
			set(t, "maxmemory-policy", policy)
			t.Cleanup(func() { set(t, "maxmemory-policy", "noeviction") })
			err := store.CheckEviction(ctx)
			requireEviction(t, err, srv.Addr, policy, 2<<20)
			t.Log(err)
		})
	}
	t.Run("evicting policy without maxmemory", func(t *testing.T) {
		// Nothing is evicted until maxmemory is set, which can happen at run
		// time: the policy is reported, with MaxMemory 0.
		set(t, "maxmemory", "0")
		set(t, "maxmemory-policy", "volatile-lru")
		t.Cleanup(func() {
			set(t, "maxmemory", "2mb")
			set(t, "maxmemory-policy", "noeviction")
		})
		err := store.CheckEviction(ctx)
		requireEviction(t, err, srv.Addr, "volatile-lru", 0)
		t.Log(err)
	})
	t.Run("Conn", func(t *testing.T) {
		conn := client.Conn()
		defer conn.Close()
		cs := evictionStore(t, conn)
		require.NoError(t, cs.CheckEviction(ctx))
		set(t, "maxmemory-policy", "allkeys-lru")
		t.Cleanup(func() { set(t, "maxmemory-policy", "noeviction") })
		// A Conn does not say its address.
		requireEviction(t, cs.CheckEviction(ctx), "", "allkeys-lru", 2<<20)
	})
	t.Run("ACL denies CONFIG", func(t *testing.T) {
		require.NoError(t, client.Do(ctx, "acl", "setuser", "noconfig", "on", ">pw", "~*", "+@all", "-config").Err())
		c := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: "noconfig", Password: "pw"})
		t.Cleanup(func() { c.Close() })
		ee := requireUnchecked(t, evictionStore(t, c).CheckEviction(ctx))
		assert.Equal(t, srv.Addr, ee.Addr)
		assert.Empty(t, ee.Policy)
		assert.Equal(t, int64(-1), ee.MaxMemory)
		assert.True(t, redis.HasErrorPrefix(ee.Err, "NOPERM"), "%v", ee.Err)
		t.Log(ee)
	})
	t.Run("client without CONFIG GET", func(t *testing.T) {
		ee := requireUnchecked(t, evictionStore(t, scripterOnly{client}).CheckEviction(ctx))
		t.Log(ee)
	})
	t.Run("unreachable", func(t *testing.T) {
		b := redistest.Real(t)
		b.Stop()
		err := evictionStore(t, b.Client).CheckEviction(ctx)
		require.ErrorIs(t, err, ErrUnavailable)
		assert.NotErrorIs(t, err, ErrEvictionPolicy)
		assert.NotErrorIs(t, err, ErrEvictionUnchecked)
		t.Log(err)
	})
}

// scripterOnly hides every method of a client but those of redis.Scripter.
type scripterOnly struct{ redis.Scripter }

// TestCheckEvictionConfigDisabled: a server whose CONFIG command is renamed
// away, as managed services do, answers an unknown command:
// ErrEvictionUnchecked.
func TestCheckEvictionConfigDisabled(t *testing.T) {
	srv := redistest.Start(t, "--rename-command", "CONFIG", "")
	ee := requireUnchecked(t, evictionStore(t, redistest.NewClient(t, srv.Addr)).CheckEviction(context.Background()))
	assert.Equal(t, srv.Addr, ee.Addr)
	assert.Empty(t, ee.Policy)
	assert.Equal(t, int64(-1), ee.MaxMemory)
	assert.Contains(t, ee.Err.Error(), "unknown command")
	t.Log(ee)
}

// TestCheckEvictionMiniredis: miniredis has no CONFIG command.
func TestCheckEvictionMiniredis(t *testing.T) {
	m := miniredis.RunT(t)
	ee := requireUnchecked(t, evictionStore(t, redistest.NewClient(t, m.Addr())).CheckEviction(context.Background()))
	assert.Equal(t, m.Addr(), ee.Addr)
	assert.Contains(t, ee.Err.Error(), "unknown command")
	t.Log(ee)
}

// TestCheckEvictionCluster: every master of a Cluster is checked, and the
// error names the ones that evict.
func TestCheckEvictionCluster(t *testing.T) {
	cl := redistest.StartCluster(t, 3, 0)
	ctx := context.Background()
	cc := cl.Client(t, nil)
	store := evictionStore(t, cc)
	require.NoError(t, store.CheckEviction(ctx))

	setPolicy := func(m *redistest.Server, policy string) {
		t.Helper()
		c := m.Client(t)
		require.NoError(t, c.ConfigSet(ctx, "maxmemory-policy", policy).Err())
	}
	setPolicy(cl.Masters[1], "allkeys-lru")
	err := store.CheckEviction(ctx)
	requireEviction(t, err, cl.Masters[1].Addr, "allkeys-lru", 0)
	t.Log(err)

	// Two masters: both are reported, ordered by address.
	setPolicy(cl.Masters[2], "volatile-lfu")
	err = store.CheckEviction(ctx)
	require.ErrorIs(t, err, ErrEvictionPolicy)
	var joined interface{ Unwrap() []error }
	require.ErrorAs(t, err, &joined)
	got := map[string]string{}
	for _, e := range joined.Unwrap() {
		var ee *EvictionError
		require.ErrorAs(t, e, &ee)
		got[ee.Addr] = ee.Policy
	}
	assert.Equal(t, map[string]string{cl.Masters[1].Addr: "allkeys-lru", cl.Masters[2].Addr: "volatile-lfu"}, got)
	t.Log(err)

	// A client that reaches one node of a Cluster cannot vouch for the
	// others, even when that node is fine.
	lone := evictionStore(t, redistest.NewClient(t, cl.Masters[0].Addr))
	ee := requireUnchecked(t, lone.CheckEviction(ctx))
	assert.Equal(t, cl.Masters[0].Addr, ee.Addr)
	assert.Equal(t, "noeviction", ee.Policy)
	t.Log(ee)

	// Nor can an AutoPipeliner on the ClusterClient.
	ap, err := cc.AutoPipeline()
	require.NoError(t, err)
	ee = requireUnchecked(t, evictionStore(t, ap).CheckEviction(ctx))
	assert.Empty(t, ee.Addr, "an AutoPipeliner does not say which node answered")
	t.Logf("AutoPipeliner on a ClusterClient: %v", ee)
}

// TestCheckEvictionRing: every shard of a Ring is checked.
func TestCheckEvictionRing(t *testing.T) {
	a := redistest.Start(t)
	b := redistest.Start(t, "--maxmemory-policy", "allkeys-lfu", "--maxmemory", "64mb")
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": a.Addr, "b": b.Addr}})
	t.Cleanup(func() { ring.Close() })
	ctx := context.Background()
	require.Eventually(t, func() bool { return ring.Ping(ctx).Err() == nil }, 10*time.Second, 20*time.Millisecond)
	err := evictionStore(t, ring).CheckEviction(ctx)
	requireEviction(t, err, b.Addr, "allkeys-lfu", 64<<20)
	t.Log(err)
}

// evictionRun is what evictionWorkload saw.
type evictionRun struct {
	keys       int // distinct keys tried
	stored     int // keys whose first call ran and stored the result
	refused    int // first calls refused before running (ErrUnavailable)
	unstored   int // first calls that ran but could not store the result
	retries    int // calls of the retry rounds
	replayed   int // retries answered with the stored result
	inProgress int // retries answered ErrInProgress
	retryOOM   int // retries refused with ErrUnavailable
	duplicates int // runs beyond the first, summed over keys
	evicted    int64
}

// evictionWorkload runs Do with a 300-byte result on distinct keys, one after
// the other, against a redis-server with maxmemory 2mb and policy, until
// Redis has refused writes refusalsWanted times or maxKeys keys were tried;
// then it calls Do again on every key, rounds times, and counts how often
// each key's function ran. Under noeviction a refused write must surface as
// ErrUnavailable (or ErrInProgress, for a key whose result could not be
// stored), and nothing may run twice.
//
// The lease is an hour, so that no lease can run out during the test and a
// second run could only come from a record Redis dropped; a claim that says
// it recovered an expired lease fails the test.
func evictionWorkload(t *testing.T, policy string, maxKeys, refusalsWanted, rounds int) evictionRun {
	srv := redistest.Start(t, "--maxmemory", "2mb", "--maxmemory-policy", policy)
	client := redistest.NewClient(t, srv.Addr)
	k, err := NewRedis(client, WithLease(time.Hour))
	require.NoError(t, err)
	ctx := context.Background()

	runs := make([]atomic.Int32, maxKeys)
	result := func(i int) []byte { return bytes.Repeat([]byte{byte('a' + i%26)}, 300) }
	fn := func(i int) func(context.Context) ([]byte, error) {
		return func(ctx context.Context) ([]byte, error) {
			c, ok := ClaimFromContext(ctx)
			if assert.True(t, ok) {
				assert.False(t, c.Recovered(), "key %d: a lease ran out during the test", i)
			}
			runs[i].Add(1)
			return result(i), nil
		}
	}
	// typed checks an error of Do: ErrUnavailable caused by Redis refusing
	// the write (OOM), or ErrInProgress.
	typed := func(i int, err error) {
		t.Helper()
		switch {
		case errors.Is(err, ErrInProgress):
		case errors.Is(err, ErrUnavailable):
			assert.Contains(t, err.Error(), "OOM", "key %d", i)
		default:
			assert.Failf(t, "untyped error", "key %d: %v", i, err)
		}
	}
	key := func(i int) string { return fmt.Sprintf("evict-%06d", i) }
	deadline := time.Now().Add(2 * time.Minute) // a bound, not a margin: nothing is asserted on it
	usedMemory := func() int64 {
		t.Helper()
		info, err := client.InfoMap(ctx, "memory").Result()
		require.NoError(t, err)
		var n int64
		_, err = fmt.Sscan(info["Memory"]["used_memory"], &n)
		require.NoError(t, err)
		return n
	}
	used0 := usedMemory()

	var r evictionRun
	for i := 0; i < maxKeys && r.refused+r.unstored < refusalsWanted && time.Now().Before(deadline); i++ {
		r.keys++
		v, err := Do(ctx, k, "tenant", key(i), fn(i))
		ran := runs[i].Load() == 1
		switch {
		case err == nil:
			require.True(t, ran, "key %d: a fresh key was answered without running", i)
			assert.Equal(t, result(i), v)
			r.stored++
		case ran:
			r.unstored++
			typed(i, err)
		default:
			r.refused++
			typed(i, err)
		}
	}
	for round := 0; round < rounds && time.Now().Before(deadline); round++ {
		for i := 0; i < r.keys; i++ {
			before := runs[i].Load()
			v, err := Do(ctx, k, "tenant", key(i), fn(i))
			r.retries++
			switch {
			case err == nil:
				assert.Equal(t, result(i), v, "key %d", i)
				if runs[i].Load() == before {
					r.replayed++
				}
			case errors.Is(err, ErrInProgress):
				r.inProgress++
			default:
				r.retryOOM++
				typed(i, err)
			}
		}
	}
	for i := 0; i < r.keys; i++ {
		if n := runs[i].Load(); n > 1 {
			r.duplicates += int(n) - 1
		}
	}
	info, err := client.InfoMap(ctx, "stats").Result()
	require.NoError(t, err)
	_, err = fmt.Sscan(info["Stats"]["evicted_keys"], &r.evicted)
	require.NoError(t, err)
	dbsize, err := client.DBSize(ctx).Result()
	require.NoError(t, err)
	used := usedMemory()
	// What MEMORY USAGE counts for one completed record, and what a record
	// costs in used_memory: MEMORY USAGE leaves out the TTL's entry and the
	// hash tables.
	var usage int64
	for i := 0; i < r.keys && usage == 0; i++ {
		if runs[i].Load() > 0 {
			usage, _ = client.MemoryUsage(ctx, DefaultPrefix+"{"+recordID("tenant", key(i))+"}").Result()
		}
	}
	perRecord := int64(-1)
	if dbsize > 0 {
		perRecord = (used - used0) / dbsize
	}
	t.Logf("%s: %d keys tried: %d stored, %d refused before running, %d ran but not stored; "+
		"%d retries: %d replayed, %d in progress, %d refused; %d keys in Redis, %d evicted; "+
		"used_memory %d before, %d after: %d bytes per record (MEMORY USAGE: %d); duplicate runs: %d",
		policy, r.keys, r.stored, r.refused, r.unstored, r.retries, r.replayed, r.inProgress, r.retryOOM,
		dbsize, r.evicted, used0, used, perRecord, usage, r.duplicates)
	return r
}

// TestEvictionNoevictionRunsNothingTwice fills a Redis with maxmemory 2mb and
// maxmemory-policy noeviction until it refuses writes, then retries every key
// three times: every refusal is an ErrUnavailable (OOM) or an ErrInProgress,
// every stored result is replayed, and no function ever runs twice.
func TestEvictionNoevictionRunsNothingTwice(t *testing.T) {
	redistest.Long(t)
	r := evictionWorkload(t, "noeviction", 50000, 200, 3)
	require.GreaterOrEqual(t, r.refused+r.unstored, 200, "Redis never filled up")
	assert.Zero(t, r.evicted)
	assert.Zero(t, r.duplicates, "an operation ran twice")
	assert.Greater(t, r.stored, 1000, "fewer records than expected fit in 2mb")
	// Every stored result is replayed in every round, full or not.
	assert.GreaterOrEqual(t, r.replayed, 3*r.stored)
}

// TestEvictionEvictingPolicyRunsAgain is the contrast: the same workload
// under an evicting policy writes more records than 2mb can hold, so Redis
// must drop some (by pigeonhole, not by timing), and their retries run the
// function again. volatile-lru evicts them as well as allkeys-lru: every idem
// record has a TTL. This is why CheckEviction wants noeviction.
func TestEvictionEvictingPolicyRunsAgain(t *testing.T) {
	redistest.Long(t)
	for _, policy := range []string{"allkeys-lru", "volatile-lru"} {
		t.Run(policy, func(t *testing.T) {
			const keys = 6000 // about 2 MB of records on top of Redis's own 1 MB: three times what fits
			r := evictionWorkload(t, policy, keys, keys, 1)
			require.Equal(t, keys, r.keys)
			assert.Positive(t, r.evicted)
			assert.Positive(t, r.duplicates, "evicted records were not run again")
		})
	}
}
