package idem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// consumption is one call of Consume once its keys are claimed: the claimed
// messages, the renewals of their leases, and the results.
type consumption struct {
	k *Keeper
	// results answers every message; a claimed one's is set at the end.
	results []MessageResult
	// held are the claimed messages, in the order of the batch.
	held []*heldMessage

	mu sync.Mutex
	// stopped is set when no further handler may start: a handler
	// panicked. panicked is the first panic's value.
	stopped  bool
	panicked any
}

// heldMessage is a claimed message. Every field after claim is guarded by
// consumption.mu.
type heldMessage struct {
	place int
	claim *Claim

	state heldState
	// cancel ends the handler's context (running).
	cancel context.CancelCauseFunc
	// err is the handler's error (finished on); lost the cause of a lost
	// lease; stored the store's error when the outcome was settled.
	err, lost, stored error
	ran               bool
}

// heldState is where a held message is. A message moves forward only:
// waiting, then running, finished, settling, settled; or, from waiting,
// skipped (it will not run: released at the end); or lost, from any state
// before settled, when the renewals find its lease lost.
type heldState uint8

const (
	heldWaiting heldState = iota
	heldRunning
	heldFinished
	heldSkipped
	heldSettling
	heldSettled
	heldLost
)

func newConsumption(k *Keeper, claims []BatchResult) *consumption {
	b := &consumption{k: k, results: make([]MessageResult, len(claims))}
	held := make([]heldMessage, 0, len(claims)) // one allocation for all
	for i, r := range claims {
		if r.Err == nil && r.Outcome.Claim != nil {
			held = append(held, heldMessage{place: i, claim: r.Outcome.Claim})
			b.held = append(b.held, &held[len(held)-1])
			continue
		}
		b.results[i] = unclaimedResult(r)
	}
	return b
}

// run runs handle for every held message, n at a time, with renewals, then
// settles them and sets every result. A handler's panic is raised again
// once the batch is settled.
func (b *consumption) run(ctx context.Context, n int, handle func(ctx context.Context, i int) error) {
	if len(b.held) > 0 {
		stop := b.renew(context.WithoutCancel(ctx))
		b.handleAll(ctx, n, handle)
		stop()
		sctx, cancel := cleanupContext(ctx)
		b.settle(sctx, true)
		cancel()
	}
	b.finishResults()
	if b.panicked != nil {
		panic(b.panicked)
	}
}

// handleAll runs the handlers of the held messages, n at once, started in
// order.
func (b *consumption) handleAll(ctx context.Context, n int, handle func(ctx context.Context, i int) error) {
	if n == 1 {
		for _, h := range b.held {
			b.handleOne(ctx, h, handle)
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(n, len(b.held)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := next.Add(1) - 1; j < int64(len(b.held)); j = next.Add(1) - 1 {
				b.handleOne(ctx, b.held[j], handle)
			}
		}()
	}
	wg.Wait()
}

// handleOne runs the handler of h, unless h may not start.
func (b *consumption) handleOne(ctx context.Context, h *heldMessage, handle func(ctx context.Context, i int) error) {
	opCtx, ok := b.start(ctx, h)
	if !ok {
		return
	}
	err, p := callHandler(opCtx, h.place, handle)
	b.finish(h, err, p)
}

// start moves h to running and returns its handler's context, or reports
// that h may not start: its lease is lost, a handler panicked, or ctx is done.
func (b *consumption) start(ctx context.Context, h *heldMessage) (context.Context, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case h.state != heldWaiting:
		return nil, false
	case b.stopped:
		h.state, h.err = heldSkipped, errors.New("idem: not run: a handler of the batch panicked")
		return nil, false
	case ctx.Err() != nil:
		h.state, h.err = heldSkipped, canceled(ctx, "consume")
		return nil, false
	}
	opCtx, cancel := context.WithCancelCause(ContextWithClaim(ctx, h.claim))
	h.state, h.cancel, h.ran = heldRunning, cancel, true
	return opCtx, true
}

// callHandler runs handle for the message at place, and returns its error,
// or the value it panicked with.
func callHandler(ctx context.Context, place int, handle func(ctx context.Context, i int) error) (err error, panicked any) {
	finished := false
	defer func() {
		if !finished {
			panicked = recover()
			if panicked == nil { // runtime.Goexit, or panic(nil) before Go 1.21
				panicked = errors.New("idem: the handler did not return")
			}
			err = fmt.Errorf("idem: the handler panicked: %v", panicked)
		}
	}()
	err = handle(ctx, place)
	finished = true
	return err, nil
}

// finish records how h's handler returned.
func (b *consumption) finish(h *heldMessage, err error, panicked any) {
	b.mu.Lock()
	defer b.mu.Unlock()
	h.cancel(nil)
	h.err = err
	if panicked != nil && b.panicked == nil {
		b.stopped, b.panicked = true, panicked
	}
	if h.state == heldRunning {
		h.state = heldFinished
	}
}

// lose marks h's lease lost, with cause: a handler running is cancelled,
// and the outcome will not be stored.
func (b *consumption) lose(h *heldMessage, cause error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch h.state {
	case heldSettling, heldSettled, heldLost:
		return
	case heldRunning:
		h.cancel(cause)
	}
	h.state, h.lost = heldLost, cause
}

// settle stores the outcome of every message whose handler returned, and,
// when last, releases the messages that did not run: one CompleteBatch for
// the successes and Final errors, one ReleaseBatch for the other errors.
// Before the last settling, a message whose outcome the store could not take
// (unavailable) is tried again at the next one.
func (b *consumption) settle(ctx context.Context, last bool) {
	done, give := b.toSettle(last)
	var doneErrs, giveErrs []error
	if len(done) > 0 {
		items := make([]settlement, len(done))
		for j, h := range done {
			items[j] = b.outcome(h)
		}
		doneErrs = b.k.completeBatch(ctx, items)
	}
	if len(give) > 0 {
		claims := make([]*Claim, len(give))
		for j, h := range give {
			claims[j] = h.claim
		}
		giveErrs = b.k.ReleaseBatch(ctx, claims)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for j, h := range done {
		b.settled(h, doneErrs[j], last, heldFinished)
	}
	for j, h := range give {
		b.settled(h, giveErrs[j], last, h.stateBefore())
	}
}

// toSettle picks the messages to settle now, and marks them settling: those
// whose outcome is stored, and those to release.
func (b *consumption) toSettle(last bool) (done, give []*heldMessage) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, h := range b.held {
		switch {
		case h.state == heldFinished && storesOutcome(h.err):
			done = append(done, h)
		case h.state == heldFinished, h.state == heldSkipped && last:
			give = append(give, h)
		default:
			continue
		}
		h.state = heldSettling
	}
	return done, give
}

// storesOutcome reports whether a handler's error is an outcome to store:
// none, or a Final one.
func storesOutcome(err error) bool {
	if err == nil {
		return true
	}
	var final *FinalError
	return errors.As(err, &final)
}

// stateBefore is the state a settling message goes back to when its
// settling must be tried again.
func (h *heldMessage) stateBefore() heldState {
	if h.ran {
		return heldFinished
	}
	return heldSkipped
}

// outcome is what to store for h: nothing but the fact for a nil error, the
// Final error for the error retention.
func (b *consumption) outcome(h *heldMessage) settlement {
	if h.err == nil {
		return settlement{claim: h.claim, kind: kindBytes}
	}
	var final *FinalError
	if errors.As(h.err, &final) {
		kind, body := sealFinal(final)
		return settlement{claim: h.claim, kind: kind, body: body, retention: b.k.policy.errorRetention}
	}
	return settlement{claim: h.claim, kind: kindBytes}
}

// settled records the store's answer err for h; before the last settling, a
// failure other than a lost lease sends h back to before for another try.
func (b *consumption) settled(h *heldMessage, err error, last bool, before heldState) {
	if err != nil && !last && !errors.Is(err, ErrLeaseLost) {
		h.state = before
		return
	}
	h.state, h.stored = heldSettled, err
}

// finishResults sets the result of every held message, and of every
// duplicate from its first message's.
func (b *consumption) finishResults() {
	for _, h := range b.held {
		b.results[h.place] = h.result()
	}
	for i := range b.results {
		if r := &b.results[i]; r.Status == MessageDuplicate {
			r.Ack = b.results[r.First].Ack
		}
	}
}

// result is the MessageResult of a settled or lost message.
func (h *heldMessage) result() MessageResult {
	r := MessageResult{Status: MessageRetry, Ran: h.ran, First: h.place}
	switch {
	case h.state == heldLost:
		r.Err = errors.Join(h.lost, h.err)
	case h.stored == nil && storesOutcome(h.err) && h.ran:
		r.Status, r.Ack, r.Err = MessageHandled, true, h.err
	case h.stored == nil:
		r.Err = h.err
	case errors.Is(h.stored, ErrLeaseLost):
		r.Err = errors.Join(h.stored, h.err)
	default:
		r.Err = errors.Join(h.err, h.stored)
	}
	return r
}

// renew renews the leases of the held messages every third of the lease,
// settling those whose handlers returned, until the returned stop is called;
// stop waits for a renewal under way.
func (b *consumption) renew(ctx context.Context) (stop func()) {
	every := max(b.k.policy.lease/3, time.Millisecond)
	var mu sync.Mutex
	var running sync.WaitGroup
	stopped := false
	var t *time.Timer
	tick := func() {
		mu.Lock()
		if stopped {
			mu.Unlock()
			return
		}
		running.Add(1)
		mu.Unlock()
		defer running.Done()
		b.renewOnce(ctx)
		mu.Lock()
		defer mu.Unlock()
		if !stopped {
			t.Reset(every)
		}
	}
	mu.Lock()
	t = time.AfterFunc(every, tick)
	mu.Unlock()
	return func() {
		mu.Lock()
		stopped = true
		t.Stop()
		mu.Unlock()
		running.Wait()
	}
}

// renewOnce settles the messages whose handlers returned, then renews the
// leases of the others in one ExtendBatch, and marks lost those whose lease
// the store says is lost or that ran out without a renewal getting through.
func (b *consumption) renewOnce(ctx context.Context) {
	b.settle(ctx, false)
	hs := b.toRenew()
	if len(hs) == 0 {
		return
	}
	claims := make([]*Claim, len(hs))
	for j, h := range hs {
		claims[j] = h.claim
	}
	for j, err := range b.k.ExtendBatch(ctx, claims) {
		switch h := hs[j]; {
		case err == nil:
		case errors.Is(err, ErrLeaseLost):
			b.lose(h, fmt.Errorf("%w: the claim was taken over, released or expired", ErrLeaseLost))
		case !b.k.now().Before(h.claim.localLeaseEnd()):
			lost := fmt.Errorf("%w: the lease ran out without renewal: %w", ErrLeaseLost, err)
			h.claim.endHold(0, nil, lost)
			b.lose(h, lost)
		}
	}
}

// toRenew returns the held messages whose leases must go on: not yet
// settled, nor lost.
func (b *consumption) toRenew() []*heldMessage {
	b.mu.Lock()
	defer b.mu.Unlock()
	var hs []*heldMessage
	for _, h := range b.held {
		switch h.state {
		case heldWaiting, heldRunning, heldFinished, heldSkipped:
			hs = append(hs, h)
		}
	}
	return hs
}
