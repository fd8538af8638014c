package idem

// The batch steps (BeginBatch, ExtendBatch, CompleteBatch, ReleaseBatch and
// the steps of a Claim of a batch) in the failure modes a consumer meets,
// one at a time: every step sent twice, as go-redis does when a reply is
// lost, and every step on a Redis that refuses writes (full under
// noeviction, or a read-only replica).

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// resendClient returns a client of b whose script calls are each sent twice
// (see scriptFaults) while the returned hook is on.
func resendClient(t *testing.T, b *redistest.Backend) (*redis.Client, *scriptFaults) {
	c := redistest.NewClient(t, b.Client.Options().Addr)
	h := newScriptFaults(1, true, 0)
	c.AddHook(h)
	return c, h
}

// TestBatchStepsAnswerTheSameWhenSentTwice: go-redis sends a script again
// when its reply was lost, so every batch step may run twice for one call
// (the rules: "every script must be safe to run twice"). With every script
// sent twice, each step answers as on a clean line, and leaves what it would
// have left: BeginBatch (compact claims or records), ExtendBatch,
// CompleteBatch with an empty result (a marker) and with a value,
// ReleaseBatch, the steps of a single Claim of a batch, and Consume with a
// Final error (a value to keep).
func TestBatchStepsAnswerTheSameWhenSentTwice(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		markerModes(t, func(t *testing.T, opts ...Option) {
			client, twice := resendClient(t, b)
			opts = append(opts, WithPrefix(fmt.Sprintf("twice%d:", len(opts))))
			k, err := NewRedis(client, append(opts, WithLease(time.Minute))...)
			require.NoError(t, err)
			clean := newKeeper(t, b, opts...)
			ctx := context.Background()
			// The scripts are in Redis's cache, as they are once a store has
			// run a while: a batch step's calls go in one pipeline of EVALSHA.
			require.NoError(t, k.store.(*redisStore).LoadScripts(ctx))
			twice.on.Store(true)
			keys := []string{"empty", "value", "release", "one-value", "one-extend", "one-release", "one-checkpoint", "extend"}
			res, err := k.batchBegin(ctx, "s", keys, withCompactClaims())
			require.NoError(t, err)
			cl := map[string]*Claim{}
			for i, r := range res {
				require.NoError(t, r.Err, keys[i])
				require.NotNil(t, r.Outcome.Claim, keys[i])
				assert.Equal(t, 1, r.Outcome.Claim.Attempt(), "%s: claimed twice by one call", keys[i])
				assert.False(t, r.Outcome.Claim.Recovered(), keys[i])
				cl[keys[i]] = r.Outcome.Claim
			}
			all := make([]*Claim, len(keys))
			for i, key := range keys {
				all[i] = cl[key]
			}
			for i, err := range k.extendClaims(ctx, all) {
				assert.NoError(t, err, "ExtendBatch of %s", keys[i])
			}
			errs := k.completeClaims(ctx, []completion{{Claim: cl["empty"]}, {Claim: cl["value"], Value: []byte("v")}})
			assert.NoError(t, errs[0], "CompleteBatch with an empty result")
			assert.NoError(t, errs[1], "CompleteBatch with a value, sent twice: the value is stored (see below), and a step that stored it must not answer otherwise")
			assert.NoError(t, k.releaseClaims(ctx, []*Claim{cl["release"]})[0], "ReleaseBatch")
			assert.NoError(t, cl["one-value"].Complete(ctx, []byte("w"), 0), "Claim.Complete with a value, sent twice")
			assert.NoError(t, cl["one-extend"].Extend(ctx), "Claim.Extend")
			assert.NoError(t, cl["one-release"].Release(ctx), "Claim.Release")
			assert.NoError(t, cl["one-checkpoint"].Checkpoint(ctx, "step", []byte("1")), "Claim.Checkpoint")
			assert.NoError(t, cl["one-checkpoint"].Complete(ctx, nil, 0), "Claim.Complete after a checkpoint")
			assert.NoError(t, k.extendClaims(ctx, []*Claim{cl["extend"]})[0], "ExtendBatch of the last one held")

			var fails atomic.Int32
			out, err := Consume(ctx, k, "s", msgs("final"), msgID, func(context.Context, msg) error {
				fails.Add(1)
				return Final(errors.New("declined"))
			})
			require.NoError(t, err)
			assert.Equal(t, MessageHandled, out[0].Status, "Consume storing a Final error, sent twice: %v", out[0].Err)
			twice.on.Store(false)
			t.Logf("%d script calls sent twice", twice.resent.Load())

			// What was left is what a clean line leaves.
			want := map[string]string{"empty": "", "value": "v", "one-value": "w", "one-checkpoint": ""}
			for key, v := range want {
				o, err := clean.Begin(ctx, "s", key)
				if assert.NoError(t, err, key) && assert.True(t, o.Replayed, "%s: not completed", key) {
					assert.Equal(t, v, string(o.Value), key)
				}
			}
			for _, key := range []string{"release", "one-release"} {
				o, err := clean.Begin(ctx, "s", key)
				if assert.NoError(t, err, key) && assert.NotNil(t, o.Claim, key) {
					assert.Equal(t, 2, o.Claim.Attempt(), "%s: released once, claimed again", key)
				}
			}
			for _, key := range []string{"one-extend", "extend"} {
				_, err := clean.Begin(ctx, "s", key)
				assert.ErrorIs(t, err, ErrInProgress, key)
			}
			o, err := clean.Begin(ctx, "s", "final")
			if assert.NoError(t, err) && assert.True(t, o.Replayed) {
				assert.Equal(t, "declined", o.Err.Error())
			}
			assert.Equal(t, int32(1), fails.Load())
		})
	})
}

// TestBatchStepsOnAFullOrReadOnlyRedisAreUnavailable: every batch step (and
// the steps of a Claim of a batch), on compact claims and on records, on a
// Redis that refuses writes (OOM under noeviction, or a read-only replica),
// answers ErrUnavailable, never ErrCorrupt nor ErrLeaseLost, and changes
// nothing: once Redis takes writes again, the claims are still held, and
// settle as on a healthy Redis.
func TestBatchStepsOnAFullOrReadOnlyRedisAreUnavailable(t *testing.T) {
	for _, mode := range []string{"OOM", "READONLY"} {
		t.Run(mode, func(t *testing.T) {
			markerModes(t, func(t *testing.T, opts ...Option) {
				srv := redistest.Start(t, "--maxmemory-policy", "noeviction")
				admin := srv.Client(t)
				ctx := context.Background()
				master, err := openRedisStore(admin, opts...)
				require.NoError(t, err)
				var replica *redisStore
				if mode == "READONLY" {
					r := redistest.StartReplica(t, srv.Addr)
					replica, err = openRedisStore(r.Client(t), opts...)
					require.NoError(t, err)
				}
				sw := &switchStore{master: master, replica: master}
				if replica != nil {
					sw.replica = replica
				}
				k, err := keeperOn(sw, append(opts, WithLease(time.Minute))...)
				require.NoError(t, err)
				keys := []string{"c1", "c2", "c3", "c4", "c5", "r1", "r2", "r3"}
				claims := map[string]*Claim{}
				for _, compact := range []bool{true, false} {
					ks := keys[:5]
					var o []Option
					if compact {
						o = append(o, withCompactClaims())
					} else {
						ks = keys[5:]
					}
					res, err := k.batchBegin(ctx, "s", ks, o...)
					require.NoError(t, err)
					for i, r := range res {
						require.NoError(t, r.Err)
						claims[ks[i]] = r.Outcome.Claim
					}
				}
				if mode == "OOM" {
					filler := strings.Repeat("x", 4096)
					for i := 0; i < 300; i++ {
						require.NoError(t, admin.Set(ctx, fmt.Sprintf("filler-%d", i), filler, 0).Err())
					}
					require.NoError(t, admin.ConfigSet(ctx, "maxmemory", "1mb").Err())
				} else {
					// The replica has every claim before it is asked.
					n, err := admin.Do(ctx, "wait", 1, 2000).Int()
					require.NoError(t, err)
					require.Equal(t, 1, n, "the replica acknowledged the claims")
					sw.toReplica.Store(true)
				}
				unavailable := func(what string, err error) {
					t.Helper()
					assert.ErrorIs(t, err, ErrUnavailable, "%s on a Redis that refuses writes", what)
					assert.NotErrorIs(t, err, ErrCorrupt, what)
					assert.NotErrorIs(t, err, ErrLeaseLost, what)
				}
				res, err := k.batchBegin(ctx, "s", []string{"new1", "new2"}, withCompactClaims())
				require.NoError(t, err)
				for _, r := range res {
					unavailable("BeginBatch", r.Err)
				}
				all := []*Claim{claims["c1"], claims["c2"], claims["r1"], claims["r2"]}
				for _, err := range k.extendClaims(ctx, all) {
					unavailable("ExtendBatch", err)
				}
				for _, err := range k.completeClaims(ctx, []completion{{Claim: claims["c1"]}, {Claim: claims["c2"], Value: []byte("v")}, {Claim: claims["r1"]}}) {
					unavailable("CompleteBatch", err)
				}
				for _, err := range k.releaseClaims(ctx, []*Claim{claims["c3"], claims["r2"]}) {
					unavailable("ReleaseBatch", err)
				}
				unavailable("Claim.Checkpoint of a compact claim", claims["c4"].Checkpoint(ctx, "step", []byte("1")))
				unavailable("Claim.Complete of a compact claim", claims["c5"].Complete(ctx, []byte("w"), 0))
				unavailable("Claim.Checkpoint of a record", claims["r3"].Checkpoint(ctx, "step", []byte("1")))

				if mode == "OOM" {
					require.NoError(t, admin.ConfigSet(ctx, "maxmemory", "0").Err())
				} else {
					sw.toReplica.Store(false)
				}
				for _, key := range keys {
					assert.NoError(t, k.extendClaims(ctx, []*Claim{claims[key]})[0], "%s is still held once Redis takes writes again", key)
				}
				errs := k.completeClaims(ctx, []completion{{Claim: claims["c1"]}, {Claim: claims["c2"], Value: []byte("v")}, {Claim: claims["r1"]}})
				assert.Equal(t, []error{nil, nil, nil}, errs)
				assert.Equal(t, []error{nil, nil}, k.releaseClaims(ctx, []*Claim{claims["c3"], claims["r2"]}))
				assert.NoError(t, claims["c4"].Checkpoint(ctx, "step", []byte("1")))
				assert.NoError(t, claims["c5"].Complete(ctx, []byte("w"), 0))
			})
		})
	}
}

// TestBatchClaimOnReadOnlyReplicaIsUnavailable: a Redis that is READONLY
// answers ErrUnavailable, never anything else, for a batch as for one key
// (TestReadOnlyReplicaIsUnavailable): BeginBatch answers each key
// ErrUnavailable, Consume MessageRetry.
func TestBatchClaimOnReadOnlyReplicaIsUnavailable(t *testing.T) {
	markerModes(t, batchClaimOnReadOnlyReplica)
}

func batchClaimOnReadOnlyReplica(t *testing.T, opts ...Option) {
	master := redistest.Real(t)
	replica := redistest.Real(t)
	ctx := context.Background()
	addr := strings.Split(master.Client.Options().Addr, ":")
	require.NoError(t, replica.Client.SlaveOf(ctx, addr[0], addr[1]).Err())
	k := newKeeper(t, replica, opts...)

	_, err := k.Begin(ctx, "s", "single")
	require.ErrorIs(t, err, ErrUnavailable, "a single claim on the replica: unavailable")

	res, err := k.batchBegin(ctx, "s", []string{"b1", "b2"})
	require.NoError(t, err)
	for i, r := range res {
		assert.ErrorIs(t, r.Err, ErrUnavailable, "key %d: a batch claim on the replica must be unavailable, got %v", i, r.Err)
		assert.NotErrorIs(t, r.Err, ErrCorrupt, "key %d: nothing is corrupt", i)
	}

	ran := 0
	out, err := Consume(ctx, k, "s", msgs("m1"), msgID, func(context.Context, msg) error { ran++; return nil })
	require.ErrorIs(t, err, ErrUnavailable, "no claim of the batch was taken: the loop backs off")
	assert.Equal(t, 0, ran)
	assert.Equal(t, MessageRetry, out[0].Status, "a read-only replica is a retry, not a poison message: %v", out[0].Err)
}

// TestBatchClaimUnderOOMIsUnavailable: under maxmemory-policy noeviction a
// full Redis refuses writes: a claim then fails with ErrUnavailable (wrapping
// OOM) and completed keys are still replayed, in a batch as for one key.
func TestBatchClaimUnderOOMIsUnavailable(t *testing.T) {
	markerModes(t, batchClaimUnderOOM)
}

func batchClaimUnderOOM(t *testing.T, opts ...Option) {
	srv := redistest.Start(t, "--maxmemory", "16mb", "--maxmemory-policy", "noeviction")
	client := redistest.NewClient(t, srv.Addr)
	k, err := NewRedis(client, append(opts, WithLease(time.Hour))...)
	require.NoError(t, err)
	ctx := context.Background()

	// A completed key, before Redis is full.
	out, err := k.Begin(ctx, "s", "done")
	require.NoError(t, err)
	require.NoError(t, out.Claim.Complete(ctx, []byte("result"), 0))

	// Fill Redis, then lower maxmemory below what it uses: every write is
	// refused from then on (OOM), reads are not.
	filler := strings.Repeat("x", 4096)
	for i := 0; i < 300; i++ {
		require.NoError(t, client.Set(ctx, fmt.Sprintf("filler-%d", i), filler, 0).Err())
	}
	require.NoError(t, client.ConfigSet(ctx, "maxmemory", "1mb").Err())
	require.ErrorContains(t, client.Set(ctx, "probe", "x", 0).Err(), "OOM")

	_, err = k.Begin(ctx, "s", "new-single")
	require.ErrorIs(t, err, ErrUnavailable, "a single claim: unavailable (OOM)")
	single, err := k.Begin(ctx, "s", "done")
	require.NoError(t, err, "a single claim of a completed key is still replayed")
	require.True(t, single.Replayed)

	res, err := k.batchBegin(ctx, "s", []string{"new-batch", "done"})
	require.NoError(t, err)
	assert.ErrorIs(t, res[0].Err, ErrUnavailable, "new key in a batch under OOM: want unavailable, got %v", res[0].Err)
	assert.NotErrorIs(t, res[0].Err, ErrCorrupt)
	if assert.NoError(t, res[1].Err, "completed key in a batch under OOM: still replayed") {
		assert.True(t, res[1].Outcome.Replayed)
	}

	ran := 0
	cons, err := Consume(ctx, k, "s", msgs("new-msg", "done"), msgID, func(context.Context, msg) error { ran++; return nil })
	require.NoError(t, err)
	assert.Equal(t, 0, ran)
	assert.Equal(t, MessageRetry, cons[0].Status, "a full Redis is a retry, not a poison message: %v", cons[0].Err)
	assert.Equal(t, MessageReplayed, cons[1].Status, "a completed key is replayed: %v", cons[1].Err)
}
