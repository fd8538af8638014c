package idem

// The leases of the messages Consume holds (consume_run.go): "a holder
// knows its own lease". A claim answered after its lease ran out never
// starts its handler, one answered late is renewed before it starts, a
// handler whose lease runs out while a renewal hangs has its context
// cancelled, and the watch that loses such a message never drops the
// outcome of a handler returning at that moment.

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestConsumeExpireAndAHandlerReturning: the watch that loses a message
// whose lease ran out, and its handler returning at that moment. Either the
// handler returned first, and its outcome is kept for the store (finished),
// or the message was lost first, and the handler's context was cancelled
// before it returned; never a handler that returned uncancelled and whose
// outcome is then dropped, neither stored nor released.
//
// The interleaving is forced, not raced for: the claim's in-process hold
// (the coalescing layer's) is locked by the test, so the watch stops where
// it ends the hold, and the handler returns there.
func TestConsumeExpireAndAHandlerReturning(t *testing.T) {
	sh := &flightShard{m: map[string]*flight{}}
	c := &Claim{id: "id", leaseEnd: time.Now().Add(-time.Millisecond), hold: sh}
	sh.m["id"] = &flight{held: true, out: Outcome{Claim: c}}
	k := &Keeper{now: time.Now}
	var returned, cancelledFirst atomic.Bool
	h := &heldMessage{claim: c, state: heldRunning, ran: true, cancel: func(cause error) {
		if cause != nil && !returned.Load() {
			cancelledFirst.Store(true)
		}
	}}
	b := &consumption{k: k, lease: time.Second, every: time.Second / 3, held: []*heldMessage{h}}

	sh.mu.Lock()
	done := make(chan struct{})
	go func() { defer close(done); b.expire() }()
	waitBlocked(t, done, "(*flightShard).finish")
	returned.Store(true) // the handler returns while the watch is ending the hold
	b.finish(h, nil, nil)
	sh.mu.Unlock()
	<-done

	b.mu.Lock()
	defer b.mu.Unlock()
	switch h.state {
	case heldFinished:
	case heldLost:
		assert.True(t, cancelledFirst.Load(), "a handler that returned uncancelled was marked lost: its outcome is neither stored nor released")
	default:
		t.Fatalf("state %d after the watch and the handler's return", h.state)
	}
}

// waitBlocked waits until a goroutine is blocked on a mutex in fn, or done
// is closed.
func waitBlocked(t *testing.T, done <-chan struct{}, fn string) {
	t.Helper()
	buf := make([]byte, 1<<20)
	for {
		select {
		case <-done:
			return
		default:
		}
		n := runtime.Stack(buf, true)
		for _, g := range bytes.Split(buf[:n], []byte("\n\n")) {
			if bytes.Contains(g, []byte(fn)) && bytes.Contains(g, []byte("sync.(*Mutex).Lock")) {
				return
			}
		}
		runtime.Gosched()
	}
}

// lateOnClock is a redisStore whose batch claim answers come back only after
// late has run: late moves the clock (miniredis's and the Keeper's), and may
// let another consumer take the key over.
type lateOnClock struct {
	*redisStore
	late func()
}

func (s *lateOnClock) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	r := s.redisStore.ClaimBatch(ctx, req)
	s.late()
	return r
}

// TestConsumeLateAnswersOnAMovedClock: the promises of "A holder knows its
// own lease" for a batch claim answered late, with markers on and off, on a
// clock moved by hand (Redis's and the Keeper's, so that the test decides
// when the answer comes): an answer after the lease ran out never starts the
// handler, whether another consumer took the key over meanwhile or not
// (MessageRetry); an answer with less than a third of the lease left is
// renewed before the handler starts; one whose renewal finds the key taken
// over never starts.
func TestConsumeLateAnswersOnAMovedClock(t *testing.T) {
	const lease = time.Second
	markerModes(t, func(t *testing.T, opts ...Option) {
		cases := []struct {
			name     string
			late     time.Duration
			takeOver bool
			// runs says whether the handler may run; renewedFirst, whether
			// it must find its lease renewed before it starts.
			runs, renewedFirst bool
		}{
			{name: "after the lease, taken over", late: lease + time.Millisecond, takeOver: true},
			{name: "after the lease, not taken over", late: lease + time.Millisecond},
			{name: "a quarter left", late: lease * 3 / 4, runs: true, renewedFirst: true},
			{name: "a quarter left, taken over", late: lease * 3 / 4, takeOver: true},
			{name: "half left", late: lease / 2, runs: true},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				b := redistest.Miniredis(t)
				redisNow, err := b.Client.Time(context.Background()).Result()
				require.NoError(t, err)
				clock := &testClock{now: redisNow} // the Keeper's clock, where Redis's is
				advance := func(d time.Duration) { clock.Advance(d); b.Advance(d) }
				rs, err := openRedisStore(b.Client, opts...)
				require.NoError(t, err)
				other := newKeeper(t, b, append(opts, WithLease(time.Minute))...)
				var taken *Claim
				ls := &lateOnClock{redisStore: rs, late: func() {
					advance(tc.late)
					if tc.takeOver {
						expireLease(t, rs, "s", "m1")
						out, err := other.Begin(context.Background(), "s", "m1")
						require.NoError(t, err)
						require.NotNil(t, out.Claim, "the other consumer takes the key over")
						taken = out.Claim
					}
				}}
				log := &lateRenewals{lateOnClock: ls, renewed: map[int64]int{}}
				k, err := keeperOn(log, append(opts, WithLease(lease), WithRetention(time.Minute), WithClock(clock.Now))...)
				require.NoError(t, err)
				var ran atomic.Bool
				var renewedBefore int
				res, err := Consume(context.Background(), k, "s", msgs("m1"), msgID, func(ctx context.Context, m msg) error {
					ran.Store(true)
					c, _ := ClaimFromContext(ctx)
					renewedBefore = log.renewals(c.Token())
					if left := c.localLeaseEnd().Sub(clock.Now()); left < lease/3 {
						return fmt.Errorf("started with %s of its lease left", left)
					}
					return nil
				})
				require.NoError(t, err)
				assert.Equal(t, tc.runs, ran.Load(), "the handler ran: %v (answer %s late; taken over %v)", ran.Load(), tc.late, tc.takeOver)
				if tc.runs {
					assert.Equal(t, MessageHandled, res[0].Status, "%v", res[0].Err)
				} else {
					assert.Equal(t, MessageRetry, res[0].Status)
					assert.ErrorIs(t, res[0].Err, ErrLeaseLost)
				}
				if tc.renewedFirst {
					assert.Positive(t, renewedBefore, "the claim was not renewed before its handler started")
				}
				if taken != nil {
					assert.NoError(t, taken.Complete(context.Background(), []byte("other"), 0), "the other consumer's claim is its own")
				}
			})
		}
	})
}

// lateRenewals is a lateOnClock that counts the renewals the store took, by
// token.
type lateRenewals struct {
	*lateOnClock
	mu      sync.Mutex
	renewed map[int64]int
}

func (s *lateRenewals) ExtendBatch(ctx context.Context, claims []claimFence, lease, keep time.Duration) []error {
	errs := s.lateOnClock.ExtendBatch(ctx, claims, lease, keep)
	s.mu.Lock()
	defer s.mu.Unlock()
	for j, err := range errs {
		if err == nil {
			s.renewed[claims[j].Token]++
		}
	}
	return errs
}

func (s *lateRenewals) renewals(token int64) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.renewed[token]
}

// TestConsumeDoesNotRunALateClaimTakenOver: a batch claim answered after its
// lease ran out, whose key another consumer took over meanwhile, is answered
// MessageRetry and its handler never starts.
func TestConsumeDoesNotRunALateClaimTakenOver(t *testing.T) {
	b := redistest.Real(t)
	k, other := lateKeeper(t, b, "m1")
	var ran atomic.Bool
	res, err := Consume(context.Background(), k, "s", msgs("m1"), msgID, func(ctx context.Context, m msg) error {
		ran.Store(true)
		return nil
	})
	require.NoError(t, err)
	require.NotNil(t, *other, "another consumer holds the key")
	assert.False(t, ran.Load(), "Consume ran a handler while another consumer held its key (token %d)", (*other).Token())
	assert.Equal(t, MessageRetry, res[0].Status)
}

// TestConsumeCancelsWhenTheLeaseRunsOutDuringAHungRenewal: the same as
// TestKeepAliveCancelsWhenTheLeaseRunsOutDuringAHungRenewal, for Consume, whose handlers' contexts are cancelled "if the renewals find its
// lease lost": a hung ExtendBatch finds nothing, and the redelivery runs the
// message beside the live handler.
func TestConsumeCancelsWhenTheLeaseRunsOutDuringAHungRenewal(t *testing.T) {
	b := redistest.Real(t)
	h := newHangingStore(t, b)
	const lease = 600 * time.Millisecond
	k, err := keeperOn(h, WithLease(lease), WithRetention(time.Minute))
	require.NoError(t, err)
	h.setHang(true)

	started := make(chan context.Context, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		_, _ = Consume(context.Background(), k, "s", msgs("m1"), msgID, func(ctx context.Context, m msg) error {
			started <- ctx
			select {
			case <-ctx.Done():
			case <-time.After(30 * time.Second):
			}
			return nil
		})
	}()
	opCtx := <-started
	<-h.entered

	second := takeOver(t, b, "s", "m1")
	t.Logf("redelivery took the message over with token %d while the first handler runs", second.Token())
	select {
	case <-opCtx.Done():
		assert.ErrorIs(t, context.Cause(opCtx), ErrLeaseLost)
	case <-time.After(3 * time.Second):
		assert.Fail(t, "the first handler's context is still live after its lease ran out and a redelivery took the message over")
	}
	h.unblock()
	<-finished
}
