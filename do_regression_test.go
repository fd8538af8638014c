package idem

// Regression tests for the findings of the adversarial review: each failed
// before its fix. The cluster finding (WithReplicas and ASK) is in
// redis_replicas_cluster_test.go.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A caller that goes away (a client timeout) while its operation goes on does
// not end the lease: a retry while the operation is alive gets ErrInProgress,
// then the result, and the operation runs once. Renewals come every third of
// the lease; the lease is long enough that a busy machine does not delay one
// past it.
//
// Real Redis only: the lease must pass in real time, for the process's
// renewals and Redis's clock alike.
func TestCancelledCallerKeepsTheLease(t *testing.T) {
	func(t *testing.T, b *redistest.Backend) {
		const lease = time.Second
		k := newKeeper(t, b, WithLease(lease), WithRetention(time.Minute))
		var runs atomic.Int32
		ctx, cancel := context.WithCancel(context.Background())
		resume := make(chan struct{})
		first := make(chan error, 1)
		go func() {
			_, err := Do(ctx, k, "t", "pay-1", func(opCtx context.Context) (string, error) {
				runs.Add(1)
				cancel() // the caller goes away
				<-opCtx.Done()
				assert.ErrorIs(t, context.Cause(opCtx), context.Canceled, "the operation still sees the caller's cancellation")
				<-resume // the charge goes on, past the lease
				return "charged", nil
			})
			first <- err
		}()
		eventually(t, "the first run starts", func() bool { return runs.Load() == 1 })
		<-ctx.Done()
		time.Sleep(lease * 3 / 2)
		_, err := Do(context.Background(), k, "t", "pay-1", func(context.Context) (string, error) {
			runs.Add(1)
			return "charged again", nil
		})
		require.ErrorIs(t, err, ErrInProgress, "a retry while the first run is alive")
		close(resume)
		require.NoError(t, <-first, "the first run stores its result although its caller left")
		v, err := Do(context.Background(), k, "t", "pay-1", func(context.Context) (string, error) {
			runs.Add(1)
			return "charged again", nil
		})
		require.NoError(t, err)
		assert.Equal(t, "charged", v)
		assert.EqualValues(t, 1, runs.Load())
	}(t, redistest.Real(t))
}

// With coalescing, a leader that changes the Value it was given does not
// change what its followers get: each caller owns its Value.
func TestCoalescedCallersOwnTheirValue(t *testing.T) {
	ctx := context.Background()
	k, g := gatedKeeper(t, nil)
	close(g.gate)
	out, err := k.Begin(ctx, "s", "done")
	require.NoError(t, err)
	want := bytes.Repeat([]byte("kept"), 4096)
	require.NoError(t, out.Claim.Complete(ctx, want, 0))
	for round := 0; round < 20; round++ {
		g.gate = make(chan struct{})
		g.claims.Store(0)
		leader := make(chan struct{})
		go func() {
			defer close(leader)
			o, err := k.Begin(ctx, "s", "done")
			assert.NoError(t, err)
			for i := range o.Value { // the leader reuses its buffer at once
				o.Value[i] = 'X'
			}
		}()
		eventually(t, "the leader calls the store", func() bool { return g.claims.Load() == 1 })
		const n = 8
		outs := make([]Outcome, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() { defer wg.Done(); outs[i], _ = k.Begin(ctx, "s", "done") }()
		}
		eventually(t, "all join", func() bool { return joined(k, "s", "done") == n })
		close(g.gate)
		wg.Wait()
		<-leader
		for i := range outs {
			require.True(t, bytes.Equal(outs[i].Value, want), "round %d: follower %d was handed the leader's changed bytes", round, i)
		}
	}
}

// A coalescing leader whose lease is lost (its record deleted: a failover, an
// eviction) ends its in-process hold: the next caller claims through the
// store instead of being told the key is in progress.
func TestCoalescedLostLeaseEndsTheHold(t *testing.T) {
	b := redistest.Miniredis(t)
	const lease = 900 * time.Millisecond
	k := newKeeper(t, b, WithCoalescing(true), WithLease(lease), WithRetention(time.Minute))
	ctx := context.Background()
	key := DefaultPrefix + "{" + recordID("s", "k") + "}"
	_, err := Do(ctx, k, "s", "k", func(ctx context.Context) (int, error) {
		assert.NoError(t, b.Client.Del(context.Background(), key).Err()) // the record is lost
		<-ctx.Done()                                                     // the renewal (lease/3) finds it gone
		return 0, context.Cause(ctx)
	})
	require.ErrorIs(t, err, ErrLeaseLost)
	out, err := k.Begin(ctx, "s", "k")
	require.NoError(t, err, "nobody holds the key")
	require.NotNil(t, out.Claim)
}

// Every path by which a claim learns it is lost ends the hold: Extend told
// ErrLeaseLost by the store, and Complete and Release whatever they answer.
func TestCoalescedHoldEndsOnEveryExit(t *testing.T) {
	ctx := context.Background()
	for _, exit := range []string{"extend lost", "complete lost", "release lost", "complete unavailable"} {
		t.Run(exit, func(t *testing.T) {
			b := redistest.Miniredis(t)
			k := newKeeper(t, b, WithCoalescing(true), WithLease(time.Minute))
			out, err := k.Begin(ctx, "s", "k")
			require.NoError(t, err)
			key := DefaultPrefix + "{" + recordID("s", "k") + "}"
			require.NoError(t, b.Client.Del(ctx, key).Err())
			switch exit {
			case "extend lost":
				require.ErrorIs(t, out.Claim.Extend(ctx), ErrLeaseLost)
			case "complete lost":
				require.ErrorIs(t, out.Claim.Complete(ctx, []byte("v"), 0), ErrLeaseLost)
			case "release lost":
				require.ErrorIs(t, out.Claim.Release(ctx), ErrLeaseLost)
			case "complete unavailable":
				b.Stop()
				require.ErrorIs(t, out.Claim.Complete(ctx, []byte("v"), 0), ErrUnavailable)
			}
			assert.Equal(t, -1, joined(k, "s", "k"), "no flight is left for the key")
		})
	}
}

// The caller's own cancellation is not the store's failure: the error says
// context.Canceled (or DeadlineExceeded, with the cause), not ErrUnavailable.
func TestCallerCancellationIsNotUnavailable(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := k.Begin(ctx, "s", "k")
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, ErrUnavailable)
		_, err = Do(ctx, k, "s", "k", func(context.Context) (int, error) { return 1, nil })
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, ErrUnavailable)

		dctx, dcancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
		defer dcancel()
		_, err = k.Begin(dctx, "s", "k")
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NotErrorIs(t, err, ErrUnavailable)

		cause := errors.New("shutting down")
		cctx, ccancel := context.WithCancelCause(context.Background())
		ccancel(cause)
		_, err = k.Begin(cctx, "s", "k")
		require.ErrorIs(t, err, context.Canceled)
		require.ErrorIs(t, err, cause)
	})
}

// A caller whose context ends while it waits (Wait) for an attempt in
// progress gets the cancellation too.
func TestCancelledWhileWaiting(t *testing.T) {
	for _, coalesce := range []bool{false, true} {
		t.Run(fmt.Sprint("coalescing ", coalesce), func(t *testing.T) {
			b := redistest.Miniredis(t)
			k := newKeeper(t, b, WithCoalescing(coalesce))
			ctx := context.Background()
			_, err := k.Begin(ctx, "s", "k")
			require.NoError(t, err)
			wctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
			defer cancel()
			_, err = k.Begin(wctx, "s", "k", WithWait(time.Hour))
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.NotErrorIs(t, err, ErrUnavailable)
		})
	}
}

// Durations above MaxDuration are refused with ErrInvalidConfig; every
// duration up to it works, on miniredis and on Redis.
func TestDurationLimits(t *testing.T) {
	for name, opt := range map[string]Option{
		"lease":           WithLease(math.MaxInt64),
		"retention":       WithRetention(math.MaxInt64),
		"error retention": WithErrorRetention(math.MaxInt64),
		"lease past max":  WithLease(MaxDuration + time.Millisecond),
	} {
		_, err := keeperOn(&redisStore{}, WithRetention(MaxDuration), opt)
		assert.ErrorIs(t, err, ErrInvalidConfig, name)
	}
	assert.Equal(t, int64(math.MaxInt64/int64(time.Millisecond)), millis(math.MaxInt64))
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(MaxDuration), WithRetention(MaxDuration), WithErrorRetention(MaxDuration))
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		_, err = k.Begin(ctx, "s", "k")
		var busy *InProgressError
		require.ErrorAs(t, err, &busy)
		assert.Greater(t, busy.RetryAfter, MaxDuration-time.Hour)
		require.NoError(t, out.Claim.Extend(ctx))
		assert.ErrorIs(t, out.Claim.Complete(ctx, []byte("v"), math.MaxInt64), ErrInvalidConfig)
		require.NoError(t, out.Claim.Complete(ctx, []byte("v"), MaxDuration))
		again, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		assert.Equal(t, "v", string(again.Value))
		v, err := Do(ctx, k, "s", "k2", func(context.Context) (int, error) { return 7, nil })
		require.NoError(t, err)
		assert.Equal(t, 7, v)
	})
}

// A takeover of an abandoned claim reports Recovered and the attempt count
// for every accepted setting, retention equal to the lease included.
func TestRecoveredWhenRetentionEqualsLease(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		const lease = 200 * time.Millisecond
		k := newKeeper(t, b, WithLease(lease), WithRetention(lease))
		ctx := context.Background()
		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		first := out.Claim.Token()
		b.Advance(lease + 50*time.Millisecond) // the holder crashed
		out, err = k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		require.NotNil(t, out.Claim)
		assert.True(t, out.Claim.Recovered())
		assert.Equal(t, 2, out.Claim.Attempt())
		assert.Greater(t, out.Claim.Token(), first)
	})
}

// A key completed by Claim.Complete can be read by Do, and one completed by
// Do can be read by Begin.
func TestCompleteAndDoShareKeys(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b)
		never := func(context.Context) ([]byte, error) { assert.Fail(t, "ran again"); return nil, nil }

		out, err := k.Begin(ctx, "s", "raw")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte("shipped"), 0))
		raw, err := Do(ctx, k, "s", "raw", never)
		require.NoError(t, err)
		assert.Equal(t, "shipped", string(raw), "[]byte gets the bytes as stored")
		out, err = k.Begin(ctx, "s", "junk")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte{0xc1}, 0)) // never used in msgpack
		_, err = Do(ctx, k, "s", "junk", func(context.Context) (int, error) { return 0, nil })
		assert.ErrorIs(t, err, ErrCorrupt, "bytes the Codec cannot decode into an int")

		encoded, err := msgpackCodec{}.Marshal(42)
		require.NoError(t, err)
		out, err = k.Begin(ctx, "s", "encoded")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, encoded, 0))
		n, err := Do(ctx, k, "s", "encoded", func(context.Context) (int, error) { return 0, nil })
		require.NoError(t, err)
		assert.Equal(t, 42, n, "bytes in the Codec's encoding decode")

		_, err = Do(ctx, k, "s", "by-do", func(context.Context) (int, error) { return 7, nil })
		require.NoError(t, err)
		out, err = k.Begin(ctx, "s", "by-do")
		require.NoError(t, err)
		require.True(t, out.Replayed)
		var got int
		require.NoError(t, msgpackCodec{}.Unmarshal(out.Value, &got))
		assert.Equal(t, 7, got)
		assert.NoError(t, out.Err)

		_, err = Do(ctx, k, "s", "declined", func(context.Context) (int, error) { return 0, Final(errors.New("card declined")) })
		require.Error(t, err)
		out, err = k.Begin(ctx, "s", "declined")
		require.NoError(t, err)
		var final *FinalError
		require.ErrorAs(t, out.Err, &final)
		assert.True(t, final.Replayed)
		assert.Equal(t, "card declined", final.Error())
	})
}
