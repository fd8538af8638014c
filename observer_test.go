package idem

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// recorder is an Observer that keeps what it is told.
type recorder struct {
	mu  sync.Mutex
	evs []Event
}

func (r *recorder) Observe(_ context.Context, ev Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.evs = append(r.evs, ev)
}

// take returns the events told since the last take.
func (r *recorder) take() []Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	evs := r.evs
	r.evs = nil
	return evs
}

// steps returns the step and result of each event.
func steps(evs []Event) []string {
	var out []string
	for _, ev := range evs {
		out = append(out, ev.Step.String()+":"+ev.Result.String())
	}
	return out
}

// Every outcome of every path reaches the Observer exactly once per call.
func TestObserverSeesEveryOutcomeOnce(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		rec := &recorder{}
		const lease = 200 * time.Millisecond
		k := newKeeper(t, b, WithObserver(rec), WithLease(lease), WithRetention(time.Minute))

		for _, row := range []struct {
			name string
			call func()
			want []string
		}{
			{"claimed, then stored", func() {
				out, err := k.Begin(ctx, "s", "a", WithFingerprint([]byte("1")))
				require.NoError(t, err)
				require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))
			}, []string{"claim:claimed", "complete:done"}},
			{"replayed", func() {
				_, err := k.Begin(ctx, "s", "a", WithFingerprint([]byte("1")))
				require.NoError(t, err)
			}, []string{"claim:replayed"}},
			{"mismatch", func() {
				_, err := k.Begin(ctx, "s", "a", WithFingerprint([]byte("2")))
				require.ErrorIs(t, err, ErrMismatch)
			}, []string{"claim:mismatch"}},
			{"invalid key", func() {
				_, err := k.Begin(ctx, "s", "")
				require.ErrorIs(t, err, ErrInvalidKey)
			}, []string{"claim:invalid"}},
			{"in progress, extended, released", func() {
				out, err := k.Begin(ctx, "s", "b")
				require.NoError(t, err)
				_, err = k.Begin(ctx, "s", "b")
				require.ErrorIs(t, err, ErrInProgress)
				require.NoError(t, out.Claim.Extend(ctx))
				require.NoError(t, out.Claim.Release(ctx))
			}, []string{"claim:claimed", "claim:in_progress", "extend:done", "release:done"}},
			{"checkpoints, inspect, forget refused then forced", func() {
				out, err := k.Begin(ctx, "s", "g")
				require.NoError(t, err)
				require.NoError(t, out.Claim.Checkpoint(ctx, "step", []byte("1")))
				require.ErrorIs(t, out.Claim.Checkpoint(ctx, "", nil), ErrInvalidCheckpoint)
				_, err = k.Inspect(ctx, "s", "g")
				require.NoError(t, err)
				_, err = k.Forget(ctx, "s", "g", false)
				require.ErrorIs(t, err, ErrInProgress)
				_, err = k.Forget(ctx, "s", "g", true)
				require.NoError(t, err)
				_, err = k.Inspect(ctx, "s", "")
				require.ErrorIs(t, err, ErrInvalidKey)
			}, []string{"claim:claimed", "checkpoint:done", "checkpoint:invalid", "inspect:done",
				"forget:in_progress", "forget:done", "inspect:invalid"}},
			{"recovered, and the old holder's completion refused", func() {
				old, err := k.Begin(ctx, "s", "c")
				require.NoError(t, err)
				b.Advance(lease + 50*time.Millisecond)
				_, err = k.Begin(ctx, "s", "c")
				require.NoError(t, err)
				require.ErrorIs(t, old.Claim.Complete(ctx, []byte("stale"), 0), ErrLeaseLost)
			}, []string{"claim:claimed", "claim:recovered", "complete:lease_lost"}},
			{"canceled", func() {
				cctx, cancel := context.WithCancel(ctx)
				cancel()
				_, err := k.Begin(cctx, "s", "d")
				require.ErrorIs(t, err, context.Canceled)
			}, []string{"claim:canceled"}},
			{"corrupt", func() {
				require.NoError(t, b.Client.Set(ctx, DefaultPrefix+"{"+recordID("s", "e")+"}", "garbage", 0).Err())
				_, err := k.Begin(ctx, "s", "e")
				require.ErrorIs(t, err, ErrCorrupt)
			}, []string{"claim:corrupt"}},
		} {
			row.call()
			assert.Equal(t, row.want, steps(rec.take()), row.name)
		}

		// Do reports the steps under it, and tells a replay to a caller that
		// asks.
		var info CallInfo
		_, err := Do(ctx, k, "s", "do", func(context.Context) (int, error) { return 1, nil }, WithCallInfo(&info))
		require.NoError(t, err)
		assert.False(t, info.Replayed)
		assert.Equal(t, 1, info.Attempt)
		_, err = Do(ctx, k, "s", "do", func(context.Context) (int, error) { return 2, nil }, WithCallInfo(&info))
		require.NoError(t, err)
		assert.True(t, info.Replayed)
		evs := rec.take()
		assert.Equal(t, []string{"claim:claimed", "complete:done", "claim:replayed"}, steps(evs))
		for _, ev := range evs {
			assert.Equal(t, "s", ev.Scope)
			assert.Equal(t, recordID("s", "do"), ev.ID)
			assert.NotZero(t, ev.Token)
		}
		assert.GreaterOrEqual(t, evs[1].Held, time.Duration(0))
		assert.Equal(t, 1, evs[2].Attempt, "a replay names the attempt that completed")
		assert.Equal(t, 1, info.Attempt)

		// A claim refused for a live lease says how much of it is left.
		_, err = k.Begin(ctx, "s", "h")
		require.NoError(t, err)
		_, err = k.Begin(ctx, "s", "h")
		require.ErrorIs(t, err, ErrInProgress)
		evs = rec.take()
		require.Len(t, evs, 2)
		assert.Equal(t, ResultInProgress, evs[1].Result)
		assert.Positive(t, evs[1].LeaseLeft)
		assert.LessOrEqual(t, evs[1].LeaseLeft, lease)

		b.Stop()
		_, err = k.Begin(ctx, "s", "f")
		require.ErrorIs(t, err, ErrUnavailable)
		assert.Equal(t, []string{"claim:unavailable"}, steps(rec.take()))
	})
}

// KeepAlive reports a lease it finds lost, once.
func TestObserverSeesALostLease(t *testing.T) {
	b := redistest.Miniredis(t)
	rec := &recorder{}
	// The Keeper's clock stands still: the lease is lost because the
	// renewal finds the record gone, never because a busy machine delayed
	// the renewal past the lease by this process's clock.
	k := newKeeper(t, b, WithObserver(rec), WithLease(300*time.Millisecond), WithRetention(time.Minute), WithClock(newTestClock().Now))
	ctx := context.Background()
	out, err := k.Begin(ctx, "s", "k")
	require.NoError(t, err)
	require.NoError(t, b.Client.Del(ctx, DefaultPrefix+"{"+recordID("s", "k")+"}").Err())
	opCtx, stop := out.Claim.KeepAlive(ctx)
	<-opCtx.Done()
	require.ErrorIs(t, stop(), ErrLeaseLost)
	// The loss cancels the operation and wakes stop before the Observer is
	// told of it (StepLease): wait for that event, within a bound.
	var got []string
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		got = append(got, steps(rec.take())...)
		if len(got) >= 3 || time.Now().After(deadline) {
			break
		}
	}
	assert.Equal(t, []string{"claim:claimed", "extend:lease_lost", "lease:lease_lost"}, got)
}

// Without an Observer nothing is measured: the clock is read only for the
// claim's own lease end.
func TestNoObserverReadsNoClock(t *testing.T) {
	b := redistest.Miniredis(t)
	var reads int
	k := newKeeper(t, b, WithClock(func() time.Time { reads++; return time.Now() }))
	ctx := context.Background()
	out, err := k.Begin(ctx, "s", "k")
	require.NoError(t, err)
	require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0))
	_, err = k.Begin(ctx, "s", "k")
	require.NoError(t, err)
	assert.Equal(t, 2, reads, "one read per store claim")
}

// ResultOf classes an error as the Observer is told it.
func TestResultOf(t *testing.T) {
	assert.Equal(t, ResultDone, ResultOf(nil))
	assert.Equal(t, ResultMismatch, ResultOf(ErrMismatch))
	assert.Equal(t, ResultInProgress, ResultOf(&InProgressError{RetryAfter: time.Second}))
	assert.Equal(t, ResultLeaseLost, ResultOf(ErrLeaseLost))
	assert.Equal(t, ResultCanceled, ResultOf(context.Canceled))
	assert.Equal(t, ResultInvalid, ResultOf(ErrInvalidKey))
	assert.Equal(t, ResultUnavailable, ResultOf(ErrUnavailable))
	assert.Equal(t, ResultExpired, ResultOf(ErrResultExpired))
	assert.Equal(t, ResultDuplicate, ResultOf(fmt.Errorf("%w: place 2 repeats the key of place 0", ErrDuplicate)))
	assert.Equal(t, "duplicate", ResultDuplicate.String())
}

// A batch tells the Observer of every key, those the store was not asked
// for included: an invalid key, a repeat of an earlier place, a repeat with
// another fingerprint; each under the id of its key.
func TestBatchTellsEveryKey(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		rec := &recorder{}
		k := newKeeper(t, b, WithObserver(rec))
		keys := []string{"m-1", "", "m-1", "m-2"}
		res, err := Consume(ctx, k, "orders", keys, func(s string) string { return s },
			func(context.Context, string) error { return nil })
		require.NoError(t, err)
		require.Equal(t, []MessageStatus{MessageHandled, MessageRejected, MessageDuplicate, MessageHandled},
			[]MessageStatus{res[0].Status, res[1].Status, res[2].Status, res[3].Status})
		claims := map[string]Result{}
		for _, ev := range rec.take() {
			if ev.Step == StepClaim {
				claims[ev.ID+" "+ev.Result.String()] = ev.Result
			}
		}
		assert.Contains(t, claims, k.RecordID("orders", "m-1")+" claimed")
		assert.Contains(t, claims, k.RecordID("orders", "")+" invalid")
		assert.Contains(t, claims, k.RecordID("orders", "m-1")+" duplicate")
		assert.Contains(t, claims, k.RecordID("orders", "m-2")+" claimed")
		assert.Len(t, claims, 4)

		fps := WithFingerprints([][]byte{[]byte("a"), []byte("b")})
		_, err = k.batchBegin(ctx, "orders", []string{"m-3", "m-3"}, fps)
		require.NoError(t, err)
		var got []string
		for _, ev := range rec.take() {
			got = append(got, ev.Step.String()+":"+ev.Result.String())
		}
		assert.ElementsMatch(t, []string{"claim:claimed", "claim:mismatch"}, got)
	})
}

// TestObserverSeesOperators: Inspect, Forget and Abandon are each reported
// once, with the record they found and what they came to: a Forget refused
// by a live lease is in progress, one refused by checkpoints is refused.
func TestObserverSeesOperators(t *testing.T) {
	b := redistest.Miniredis(t)
	ctx := context.Background()
	rec := &recorder{}
	k := newKeeper(t, b, WithObserver(rec), WithLease(time.Minute))
	last := func(step Step) Event {
		t.Helper()
		evs := rec.take()
		require.NotEmpty(t, evs)
		ev := evs[len(evs)-1]
		require.Equal(t, step, ev.Step)
		return ev
	}

	out, err := k.Begin(ctx, "s", "op")
	require.NoError(t, err)
	c := out.Claim
	require.NoError(t, c.Checkpoint(ctx, "charged", []byte("ch_1")))
	rec.take()

	r, err := k.Inspect(ctx, "s", "op")
	require.NoError(t, err)
	ev := last(StepInspect)
	assert.Equal(t, ResultDone, ev.Result)
	assert.Equal(t, r.ID, ev.ID)
	assert.Equal(t, c.Token(), ev.Token)

	_, err = k.Forget(ctx, "s", "op", false)
	require.Error(t, err)
	ev = last(StepForget)
	assert.Equal(t, ResultInProgress, ev.Result, "a live lease")
	assert.Positive(t, ev.LeaseLeft)

	_, err = k.abandonKey(ctx, "s", "op", c.Token())
	require.NoError(t, err)
	ev = last(StepAbandon)
	assert.Equal(t, ResultDone, ev.Result)
	assert.Equal(t, c.Token(), ev.Token)
	assert.Equal(t, "abandon", ev.Step.String())

	_, err = k.Forget(ctx, "s", "op", false)
	var refused *ForgetRefusedError
	require.ErrorAs(t, err, &refused)
	assert.Zero(t, refused.LeaseLeft, "the lease was abandoned")
	ev = last(StepForget)
	assert.Equal(t, ResultRefused, ev.Result, "checkpoints refuse a forget")

	_, err = k.Forget(ctx, "s", "op", true)
	require.NoError(t, err)
	ev = last(StepForget)
	assert.Equal(t, ResultDone, ev.Result)

	_, err = k.abandonKey(ctx, "s", "op", 0)
	require.ErrorIs(t, err, ErrInvalidConfig)
	assert.Equal(t, ResultInvalid, last(StepAbandon).Result)
}
