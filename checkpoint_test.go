package idem

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// phases is an operation of three steps with side effects, each recorded in
// effects, with a checkpoint after each: the pattern of recovery points.
type phases struct {
	effects map[string]int // side effects done, by "key/step"
	// crashAfter, when set, makes the run stop right after that step's
	// checkpoint, as a process that dies there would.
	crashAfter string
}

var errCrashed = errors.New("the process died")

func (p *phases) run(ctx context.Context, key string, c *Claim) error {
	for _, step := range []string{"charge", "ship", "email"} {
		if _, done := c.Checkpointed(step); done {
			continue
		}
		p.effects[key+"/"+step]++
		if err := c.Checkpoint(ctx, step, []byte(step+"-id")); err != nil {
			return err
		}
		if step == p.crashAfter {
			return errCrashed
		}
	}
	return nil
}

// TestCheckpointsSurviveACrashBetweenPhases: an attempt that dies after a
// step's checkpoint leaves its claim to run out; the attempt that recovers
// the key gets the checkpoints in its claim and continues after the last
// step: every side effect happens once.
func TestCheckpointsSurviveACrashBetweenPhases(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(time.Minute))
		ctx := context.Background()
		var cnt redistest.Counter
		b.Client.AddHook(&cnt)
		s := k.store.(*redisStore)
		p := &phases{effects: map[string]int{}}
		for _, crash := range []string{"charge", "ship"} {
			p.crashAfter = crash
			out, err := k.Begin(ctx, "s", "order-"+crash)
			require.NoError(t, err)
			require.ErrorIs(t, p.run(ctx, "order-"+crash, out.Claim), errCrashed)
			// The process is gone: no Release, no Complete; its lease runs out.
			require.NoError(t, expireLua.Run(ctx, b.Client, []string{s.RecordKey("s", "order-"+crash)}).Err())
		}
		p.crashAfter = ""
		for _, crash := range []string{"charge", "ship"} {
			key := "order-" + crash
			var out Outcome
			assert.EqualValues(t, 1, cnt.Count(func() {
				var err error
				out, err = k.Begin(ctx, "s", key)
				require.NoError(t, err)
			}), "the checkpoints come with the claim: no extra round trip")
			c := out.Claim
			assert.True(t, c.Recovered())
			assert.Equal(t, 2, c.Attempt())
			v, ok := c.Checkpointed(crash)
			assert.True(t, ok)
			assert.Equal(t, crash+"-id", string(v))
			require.NoError(t, p.run(ctx, key, c))
			require.NoError(t, c.Complete(ctx, nil, 0))
			for _, step := range []string{"charge", "ship", "email"} {
				assert.Equal(t, 1, p.effects[key+"/"+step], "%s: %s happened once", key, step)
			}
			rec, err := b.Client.Get(ctx, s.RecordKey("s", key)).Result()
			require.NoError(t, err)
			assert.NotContains(t, rec, "charge-id", "completing drops the checkpoints")
		}
	})
}

// TestCheckpointsAreFenced: a holder that lost its key cannot record a
// checkpoint, and the new holder's checkpoints are untouched.
func TestCheckpointsAreFenced(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(time.Minute))
		ctx := context.Background()
		s := k.store.(*redisStore)
		old, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.NoError(t, old.Claim.Checkpoint(ctx, "one", []byte("old")))
		require.NoError(t, expireLua.Run(ctx, b.Client, []string{s.RecordKey("s", "k")}).Err())
		cur, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.NoError(t, cur.Claim.Checkpoint(ctx, "two", []byte("new")))

		assert.ErrorIs(t, old.Claim.Checkpoint(ctx, "three", []byte("stale")), ErrLeaseLost)
		assert.Equal(t, []recoveryPoint{{"one", []byte("old")}}, old.Claim.allCheckpoints(), "a refused checkpoint is not kept")
		assert.Equal(t, []recoveryPoint{{"one", []byte("old")}, {"two", []byte("new")}}, cur.Claim.allCheckpoints())

		require.NoError(t, cur.Claim.Complete(ctx, []byte("done"), 0))
		assert.ErrorIs(t, cur.Claim.Checkpoint(ctx, "late", nil), ErrLeaseLost, "a completed record takes no checkpoint")
		require.NoError(t, b.Client.Del(ctx, s.RecordKey("s", "k")).Err())
		assert.ErrorIs(t, cur.Claim.Checkpoint(ctx, "gone", nil), ErrLeaseLost, "nor a record that is gone")
	})
}

// TestCheckpointsKeptByReleaseAndExtend: renewals keep the checkpoints; a
// release keeps them and the request's fingerprint, so that a retry of the
// same request continues from them and another request is refused.
func TestCheckpointsKeptByReleaseAndExtend(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(time.Minute))
		ctx := context.Background()
		s := k.store.(*redisStore)
		fpA, fpB := WithFingerprint([]byte("a")), WithFingerprint([]byte("b"))
		out, err := k.Begin(ctx, "s", "k", fpA)
		require.NoError(t, err)
		c := out.Claim
		require.NoError(t, c.Checkpoint(ctx, "charge", []byte("ch_1")))
		require.NoError(t, c.Extend(ctx))
		require.NoError(t, c.Checkpoint(ctx, "ship", []byte("sh_1")))
		require.NoError(t, c.Checkpoint(ctx, "charge", []byte("ch_2")), "recorded again: replaced, and last")
		require.NoError(t, c.Release(ctx))
		ttl, err := b.Client.PTTL(ctx, s.RecordKey("s", "k")).Result()
		require.NoError(t, err)
		assert.Greater(t, ttl, time.Hour, "kept like a pending record, not for the short life of a released marker")

		_, err = k.Begin(ctx, "s", "k", fpB)
		assert.ErrorIs(t, err, ErrMismatch, "another request may not take over the steps done")
		again, err := k.Begin(ctx, "s", "k", fpA)
		require.NoError(t, err)
		assert.False(t, again.Claim.Recovered())
		assert.Equal(t, 2, again.Claim.Attempt())
		assert.Equal(t, []recoveryPoint{{"ship", []byte("sh_1")}, {"charge", []byte("ch_2")}}, again.Claim.allCheckpoints())

		// A released record without checkpoints is free for any request, as before.
		plain, err := k.Begin(ctx, "s", "plain", fpA)
		require.NoError(t, err)
		require.NoError(t, plain.Claim.Release(ctx))
		_, err = k.Begin(ctx, "s", "plain", fpB)
		require.NoError(t, err)
	})
}

func TestCheckpointLimits(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var cnt redistest.Counter
		b.Client.AddHook(&cnt)
		k := newKeeper(t, b)
		ctx := context.Background()
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		c := out.Claim
		for name, cp := range map[string]recoveryPoint{
			"empty name":      {"", nil},
			"name too long":   {strings.Repeat("n", MaxCheckpointName+1), nil},
			"value too large": {"v", make([]byte, MaxCheckpointValue+1)},
		} {
			assert.Zero(t, cnt.Count(func() {
				assert.ErrorIs(t, c.Checkpoint(ctx, cp.Name, cp.Value), ErrInvalidCheckpoint, name)
			}), "%s: refused before Redis", name)
		}
		require.NoError(t, c.Checkpoint(ctx, strings.Repeat("n", MaxCheckpointName), make([]byte, MaxCheckpointValue)))
		for i := 1; i < MaxCheckpoints; i++ {
			require.NoError(t, c.Checkpoint(ctx, string(rune('a'+i)), []byte{byte(i), ':', 0}))
		}
		assert.ErrorIs(t, c.Checkpoint(ctx, "one too many", nil), ErrInvalidCheckpoint)
		require.NoError(t, c.Checkpoint(ctx, "b", []byte("again")), "an existing name may be recorded again")

		// The store refuses too many by itself.
		s := k.store.(*redisStore)
		assert.ErrorIs(t, s.Checkpoint(ctx, claimFence{ID: c.id, Token: c.Token()}, "one too many", nil, 0), ErrInvalidCheckpoint)
		assert.Len(t, c.allCheckpoints(), MaxCheckpoints)

		canceled, cancel := context.WithCancel(ctx)
		cancel()
		err = c.Checkpoint(canceled, "b", nil)
		assert.ErrorIs(t, err, context.Canceled)
		assert.NotErrorIs(t, err, ErrUnavailable)
	})
}

// TestCheckpointRetriedCallIsIdempotent: a checkpoint whose reply was lost and
// that go-redis sent again leaves the record as one call would.
func TestCheckpointRetriedCallIsIdempotent(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		s, err := openRedisStore(b.Client)
		require.NoError(t, err)
		ctx := context.Background()
		r, err := s.Claim(ctx, "rec", claimRequest{Attempt: "a1", Lease: time.Minute, Keep: time.Hour})
		require.NoError(t, err)
		require.NoError(t, s.Checkpoint(ctx, claimFence{ID: "rec", Token: r.Token}, "step", []byte("v"), 0))
		once, err := b.Client.Get(ctx, s.key("rec")).Result()
		require.NoError(t, err)
		require.NoError(t, s.Checkpoint(ctx, claimFence{ID: "rec", Token: r.Token}, "step", []byte("v"), 0))
		twice, err := b.Client.Get(ctx, s.key("rec")).Result()
		require.NoError(t, err)
		assert.Equal(t, once, twice)
		assert.True(t, strings.HasSuffix(once, ":4:step1:v"), "record %q", once)

		// A retried claim of the same attempt answers the same checkpoints.
		again, err := s.Claim(ctx, "rec", claimRequest{Attempt: "a1", Lease: time.Minute, Keep: time.Hour})
		require.NoError(t, err)
		assert.Equal(t, []recoveryPoint{{"step", []byte("v")}}, again.Checkpoints)
	})
}

// TestCorruptCheckpoints: checkpoints that cannot be read make the record
// corrupt; nothing is overwritten.
func TestCorruptCheckpoints(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		s := k.store.(*redisStore)
		rk := s.RecordKey("s", "k")
		bad := "i1P1700000000000000:1:0:1700000000000000:AAAAAAAAAAA::9:short"
		require.NoError(t, b.Client.Set(ctx, rk, bad, time.Hour).Err())
		_, err := k.Begin(ctx, "s", "k")
		assert.ErrorIs(t, err, ErrCorrupt, "taken over: the checkpoints cannot be read")

		require.NoError(t, b.Client.Set(ctx, rk, "i1P1700000000000000:1:0:4102444800000000:AAAAAAAAAAA::", time.Hour).Err())
		require.NoError(t, b.Client.Append(ctx, rk, "x:").Err())
		assert.ErrorIs(t, s.Checkpoint(ctx, claimFence{ID: recordID("s", "k"), Token: 1700000000000000}, "n", nil, 0), ErrCorrupt)
		v, err := b.Client.Get(ctx, rk).Result()
		require.NoError(t, err)
		assert.True(t, strings.HasSuffix(v, "::x:"), "nothing overwritten: %q", v)
	})
}
