package idem

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"
)

// consumption is one call of Consume once its keys are claimed: the claimed
// messages, the renewals of their leases, and the results.
type consumption struct {
	k *Keeper
	// lease is the claims' lease; every is a third of it, how often the
	// renewals run.
	lease, every time.Duration
	// results answers every message; a claimed one's is set at the end.
	results []MessageResult
	// held are the claimed messages, in the order of the batch.
	held []*heldMessage
	// stop ends the starting of handlers (Consume's ctx, or a
	// StreamConsumer's own).
	stop context.Context
	// settleDelay and settleCount are the settle window (WithSettleWindow);
	// returned tells the settler that a handler returned.
	settleDelay time.Duration
	settleCount int
	returned    chan struct{}

	mu sync.Mutex
	// stopped is set when no further handler may start: a handler
	// panicked. panicked is the first panic's value.
	stopped  bool
	panicked any
	// panicAsError is settings.panicAsError: a handler's panic is its
	// message's failure, and neither stops the batch nor is raised again.
	panicAsError bool
	// watch fires when the first lease of a message not yet settled runs
	// out by this process's clock, whatever a renewal in flight is doing;
	// watchOff is set once the handlers have returned.
	watch    *time.Timer
	watchOff bool
	// unsettled counts the handlers that returned since the settler last
	// took the finished messages.
	unsettled int
	// lastFrom is set when the handlers have returned and the last
	// settling begins: from then on the renewals settle nothing, and the
	// last settling tries again, for want of the store, until its patience
	// ends (see patientUntil).
	lastFrom time.Time

	// renewSettling is held by a renewal while it settles, and while
	// lastFrom is set, so that the last settling begins once a renewal's
	// settling under way has ended: it settles alone, and finds no message
	// settling elsewhere.
	renewSettling sync.Mutex
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
// before finished, when its lease is lost (the store says so, or it ran out
// by this process's clock): the handler's context is cancelled then, and a
// waiting message does not start.
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

func newConsumption(k *Keeper, claims []batchResult, lease time.Duration, s *settings) *consumption {
	b := &consumption{
		k: k, lease: lease, every: max(lease/3, time.Millisecond), results: make([]MessageResult, len(claims)),
		settleDelay: defaultSettleDelay, settleCount: defaultSettleCount, returned: make(chan struct{}, 1),
		panicAsError: s.panicAsError,
	}
	if s.settleSet {
		b.settleDelay, b.settleCount = s.settleDelay, s.settleCount
	}
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

// run runs handle for every held message, n at a time, with renewals,
// storing outcomes as handlers return, then settles the rest and sets
// every result. Once stop is done no further handler starts. A handler's
// panic is raised again once the batch is settled.
func (b *consumption) run(ctx, stop context.Context, n int, handle func(ctx context.Context, i int) error) {
	b.stop = stop
	if len(b.held) > 0 {
		rctx := context.WithoutCancel(ctx)
		b.renewLate(rctx)
		b.rearm()
		stopRenew := b.renew(rctx)
		stopSettle := b.settler(rctx)
		b.handleAll(ctx, n, handle)
		stopSettle()
		b.renewSettling.Lock() // a renewal's settling under way ends first
		b.mu.Lock()
		b.watchOff = true
		if b.watch != nil {
			b.watch.Stop()
		}
		b.lastFrom = b.k.now()
		b.mu.Unlock()
		b.renewSettling.Unlock()
		// The renewals go on while the last settling waits for the store.
		sctx, cancel := cleanupContext(ctx)
		b.settleLast(sctx)
		cancel()
		stopRenew()
	}
	b.finishResults()
	if b.panicked != nil {
		panic(b.panicked)
	}
}

// errRanOut is the cause of a lease that ran out by this process's clock
// before a renewal got through.
var errRanOut = fmt.Errorf("%w: the lease ran out without renewal", ErrLeaseLost)

// renewLate renews, before any handler starts, the claims whose answer came
// so late that less than a third of their lease is left, in one
// extendClaims waiting no longer than the lease left; a claim whose lease has
// run out already, by this process's clock, is lost: its handler never
// starts.
func (b *consumption) renewLate(ctx context.Context) {
	now := b.k.now()
	var late []*heldMessage
	for _, h := range b.held {
		switch left := h.claim.localLeaseEnd().Sub(now); {
		case left <= 0:
			b.lose(h, errRanOut)
		case left < b.every:
			late = append(late, h)
		}
	}
	b.extend(ctx, late)
}

// extend renews the leases of hs in one extendClaims, bounded by the first of
// their lease ends, and marks lost those the store says are; it reports
// whether a renewal failed otherwise (the store did not answer in time).
func (b *consumption) extend(ctx context.Context, hs []*heldMessage) (failed bool) {
	if len(hs) == 0 {
		return false
	}
	claims := make([]*Claim, len(hs))
	first := hs[0].claim.localLeaseEnd()
	for j, h := range hs {
		claims[j] = h.claim
		if end := h.claim.localLeaseEnd(); end.Before(first) {
			first = end
		}
	}
	rctx, cancel := context.WithTimeout(ctx, first.Sub(b.k.now()))
	errs := b.k.extendClaims(rctx, claims)
	cancel()
	for j, err := range errs {
		switch {
		case err == nil:
		case errors.Is(err, ErrLeaseLost):
			b.lose(hs[j], fmt.Errorf("%w: the claim was taken over, released or expired", ErrLeaseLost))
		default:
			failed = true
		}
	}
	return failed
}

// rearm sets the watch for the first lease end of the messages whose lease
// matters: those waiting to start and those running. When it fires, the
// ones whose lease ended are lost: a running handler's context is cancelled
// then, a waiting one never starts. A message whose handler returned keeps
// its claim: the store takes its outcome only if no other attempt took the
// key over meanwhile.
func (b *consumption) rearm() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.watchOff {
		return
	}
	var first time.Time
	for _, h := range b.held {
		if h.state == heldWaiting || h.state == heldRunning {
			if end := h.claim.localLeaseEnd(); first.IsZero() || end.Before(first) {
				first = end
			}
		}
	}
	if first.IsZero() {
		return
	}
	d := first.Sub(b.k.now())
	if b.watch == nil {
		b.watch = time.AfterFunc(d, b.expire)
	} else {
		b.watch.Reset(d)
	}
}

// expire runs on the watch: it loses the messages whose lease ended, and
// sets the watch for the next. A message's state is read and changed in one
// critical section: a handler that returns meanwhile is either finished
// before (its outcome is stored, if the store still takes it) or lost after
// its context was cancelled, never lost once finished.
func (b *consumption) expire() {
	now := b.k.now()
	var lost []*heldMessage
	b.mu.Lock()
	for _, h := range b.held {
		if (h.state == heldWaiting || h.state == heldRunning) && !now.Before(h.claim.localLeaseEnd()) {
			b.loseLocked(h, errRanOut)
			lost = append(lost, h)
		}
	}
	b.mu.Unlock()
	for _, h := range lost {
		h.claim.endHold(0, nil, errRanOut)
	}
	b.rearm()
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
	err, p := callHandler(opCtx, h.place, handle, b.panicAsError)
	b.finish(h, err, p)
}

// start moves h to running and returns its handler's context, or reports
// that h may not start: its lease is lost or has run out, a handler
// panicked, or ctx is done.
func (b *consumption) start(ctx context.Context, h *heldMessage) (context.Context, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case h.state != heldWaiting:
		return nil, false
	case !b.k.now().Before(h.claim.localLeaseEnd()):
		h.state, h.lost = heldLost, errRanOut
		return nil, false
	case b.stopped:
		h.state, h.err = heldSkipped, errors.New("idem: not run: a handler of the batch panicked")
		return nil, false
	case b.stop.Err() != nil:
		h.state, h.err = heldSkipped, canceled(b.stop, "consume")
		return nil, false
	}
	opCtx, cancel := context.WithCancelCause(ctx)
	h.state, h.cancel, h.ran = heldRunning, cancel, true
	return &opContext{Context: opCtx, c: h.claim, cancel: cancel}, true
}

// callHandler runs handle for the message at place, and returns its error,
// or the value it panicked with. With asError, a recovered panic is only
// an error, holding the panic's value and stack.
func callHandler(ctx context.Context, place int, handle func(ctx context.Context, i int) error, asError bool) (err error, panicked any) {
	finished := false
	defer func() {
		if !finished {
			panicked = recover()
			if panicked != nil && asError {
				err, panicked = fmt.Errorf("idem: the handler panicked: %v\n%s", panicked, debug.Stack()), nil
				return
			}
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
		b.unsettled++
		if b.unsettled == 1 || b.unsettled >= b.settleCount {
			select {
			case b.returned <- struct{}{}:
			default:
			}
		}
	}
}

// settler stores the outcomes of the handlers that returned, within the
// settle window: settleDelay after the first of them returned, or as soon
// as settleCount have, one store call at a time, until the returned stop is
// called; stop waits for a store call under way.
func (b *consumption) settler(ctx context.Context) (stop func()) {
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		var t *time.Timer
		for {
			select {
			case <-done:
				return
			case <-b.returned:
			}
			if !b.windowFull() && b.settleDelay > 0 {
				if t == nil {
					t = time.NewTimer(b.settleDelay)
					defer t.Stop()
				} else {
					t.Reset(b.settleDelay)
				}
			wait:
				for {
					select {
					case <-done:
						return
					case <-t.C:
						break wait
					case <-b.returned:
						if b.windowFull() {
							t.Stop()
							break wait
						}
					}
				}
			}
			b.mu.Lock()
			b.unsettled = 0
			b.mu.Unlock()
			// A settling the store could not take is tried again, with
			// backoff, while the leases of the messages are alive.
			for backoff := settleRetryFirst; ; backoff = min(2*backoff, b.retryCap()) {
				sctx, cancel := context.WithTimeout(ctx, b.every)
				again := b.settle(sctx, false)
				cancel()
				wait := b.patience(backoff)
				if !again || wait <= 0 {
					break
				}
				if t == nil {
					t = time.NewTimer(wait)
					defer t.Stop()
				} else {
					t.Reset(wait)
				}
				select {
				case <-done:
					return
				case <-t.C:
				}
			}
		}
	}()
	return func() {
		close(done)
		<-exited
	}
}

// windowFull reports whether settleCount handlers returned since the
// settler last took the finished messages.
func (b *consumption) windowFull() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.unsettled >= b.settleCount
}

// lose marks h's lease lost, with cause: a handler running is cancelled, a
// waiting one does not start; one whose handler returned is left to its
// settling.
func (b *consumption) lose(h *heldMessage, cause error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.loseLocked(h, cause)
}

// loseLocked is lose with b.mu held.
func (b *consumption) loseLocked(h *heldMessage, cause error) {
	switch h.state {
	case heldFinished, heldSettling, heldSettled, heldLost:
		// A message whose handler returned is not lost: its settling
		// tells. The store answers a renewal of a claim it completed
		// "lease lost", and a settling whose reply was lost
		// (ErrUnavailable) may have completed it; sent again, the
		// settling is answered as the first was (stored), or lease lost
		// when another attempt took the key over, nothing written then.
		return
	case heldRunning:
		h.cancel(cause)
	}
	h.state, h.lost = heldLost, cause
}

// errSettleLate is the store's answer to a settling that it did not answer
// before the claim's lease ran out, by this process's clock.
var errSettleLate = fmt.Errorf("%w: the store did not answer before the claim's lease ran out, by this process's clock", ErrUnavailable)

// retryCap is the longest wait between two tries of a settling: a tenth of
// the lease, at most settleRetryCap.
func (b *consumption) retryCap() time.Duration {
	return max(min(b.lease/10, settleRetryCap), settleRetryFirst)
}

// patientUntil is when the patience of h's settling ends: a twentieth of
// the lease, at most settleMarginCap, before its lease ends by this
// process's clock, and, once the handlers
// have returned, no later than a lease after that (a store that takes the
// renewals and never the settling does not hold Consume forever). b.mu is
// held.
func (b *consumption) patientUntil(h *heldMessage) time.Time {
	end := h.claim.localLeaseEnd().Add(-min(b.lease/20, settleMarginCap))
	if !b.lastFrom.IsZero() {
		end = minTime(end, b.lastFrom.Add(b.lease))
	}
	return end
}

// minTime returns the earlier of a and b.
func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// patience returns how long to wait before the next try of the settlings
// that wait for one: backoff, or less when the first patience ends sooner;
// zero or less when it has ended, or when none waits.
func (b *consumption) patience(backoff time.Duration) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	var first time.Time
	for _, h := range b.held {
		if h.state == heldFinished || h.state == heldSkipped && !b.lastFrom.IsZero() {
			if end := b.patientUntil(h); first.IsZero() || end.Before(first) {
				first = end
			}
		}
	}
	if first.IsZero() {
		return 0
	}
	return min(backoff, first.Sub(b.k.now()))
}

// settleLast is the last settling, once the handlers have returned: it
// settles every message not yet settled, and tries again, with backoff
// (see patience), those the store could not take for want of the store
// (unavailable), until each is settled, which it is at its first try once
// its patience has ended, or until ctx is done (Consume's cleanupContext:
// cleanupTimeout once the caller's context is done). The renewals go on
// meanwhile.
func (b *consumption) settleLast(ctx context.Context) {
	for backoff := settleRetryFirst; b.settle(ctx, true); backoff = min(2*backoff, b.retryCap()) {
		if wait := b.patience(backoff); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
			case <-t.C:
			}
			t.Stop()
		}
		if ctx.Err() != nil {
			break
		}
	}
	// What waits still gives up: ctx is done. Its answer is the store's
	// last.
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, h := range b.held {
		if h.state == heldFinished || h.state == heldSkipped {
			h.state = heldSettled
			if h.stored == nil { // not stored: never answered as handled
				h.stored = errSettleLate
				if ctx.Err() != nil {
					h.stored = canceled(ctx, "consume")
				}
			}
		}
	}
}

// settle stores the outcome of every message whose handler returned, and,
// in the last settling, releases the messages that did not run: the
// successes and Final errors completed, the other errors released, in one
// round trip, waiting no longer than the first of their leases ends, or
// than retryCap from now when that is later. Before the
// last settling, a message whose outcome the store could not take is
// tried again at the next one; in the last, one the store could not take
// for want of the store (unavailable) is, while its patience lasts (see
// patientUntil). It reports whether a message waits for another try for
// want of the store.
func (b *consumption) settle(ctx context.Context, last bool) (again bool) {
	done, give := b.toSettle(last)
	if len(done) == 0 && len(give) == 0 {
		return false
	}
	items := make([]settlement, len(done))
	var first time.Time
	for j, h := range done {
		items[j] = b.outcome(h)
		first = firstEnd(first, h.claim)
	}
	claims := make([]*Claim, len(give))
	for j, h := range give {
		claims[j] = h.claim
		first = firstEnd(first, h.claim)
	}
	first = maxTime(first, b.k.now().Add(b.retryCap()))
	sctx, cancel := context.WithDeadlineCause(ctx, first, errSettleLate)
	doneErrs, giveErrs := b.k.settleBatch(sctx, items, claims) // one round trip for both
	late := ctx.Err() == nil && sctx.Err() != nil
	cancel()
	b.mu.Lock()
	defer b.mu.Unlock()
	for j, h := range done {
		again = b.settled(h, settleErr(doneErrs[j], late), last, heldFinished) || again
	}
	for j, h := range give {
		again = b.settled(h, settleErr(giveErrs[j], late), last, h.stateBefore()) || again
	}
	return again
}

// firstEnd returns the earlier of first (none when zero) and c's lease end
// by this process's clock.
func firstEnd(first time.Time, c *Claim) time.Time {
	if end := c.localLeaseEnd(); first.IsZero() || end.Before(first) {
		return end
	}
	return first
}

// maxTime returns the later of a and b.
func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// settleErr is the store's answer err to a settling, told errSettleLate
// instead of a cancellation when the settling's own bound, not its
// caller's context, cut it short (late).
func settleErr(err error, late bool) error {
	if err != nil && late && !errors.Is(err, ErrLeaseLost) && !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrInvalidConfig) {
		return errSettleLate
	}
	return err
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
// failure other than a lost lease sends h back to before for another try,
// and so does, in the last, a failure for want of the store while h's
// patience lasts. It reports whether h waits for another try for want of
// the store. b.mu is held.
func (b *consumption) settled(h *heldMessage, err error, last bool, before heldState) (again bool) {
	unavailable := errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrNotReplicated) && !errors.Is(err, ErrLeaseLost)
	switch {
	case err == nil, errors.Is(err, ErrLeaseLost):
	case !last:
		h.state = before
		return unavailable
	case unavailable && b.k.now().Before(b.patientUntil(h)):
		h.state, h.stored = before, err
		return true
	}
	h.state, h.stored = heldSettled, err
	return false
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
// stop waits for a renewal under way. A renewal that fails is tried again
// within a third of what is left of the lease.
func (b *consumption) renew(ctx context.Context) (stop func()) {
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTimer(b.every)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			t.Reset(b.renewOnce(ctx))
		}
	}()
	return func() {
		close(done)
		<-exited
	}
}

// renewOnce renews, in one extendClaims, the leases of the messages not yet
// settled nor lost, then settles those whose handlers returned; it returns
// when to renew next.
func (b *consumption) renewOnce(ctx context.Context) time.Duration {
	next := b.every
	hs := b.toRenew()
	if b.extend(ctx, hs) {
		// The store did not answer in time: try again within a third of
		// what is left, so that a short outage loses no lease.
		left := b.every * 3
		for _, h := range hs {
			left = min(left, h.claim.localLeaseEnd().Sub(b.k.now()))
		}
		next = max(min(b.every, left/3), time.Millisecond)
	}
	b.rearm()
	b.renewSettling.Lock()
	defer b.renewSettling.Unlock()
	b.mu.Lock()
	last := !b.lastFrom.IsZero()
	b.mu.Unlock()
	if !last { // the last settling settles alone
		sctx, cancel := context.WithTimeout(ctx, next)
		b.settle(sctx, false)
		cancel()
	}
	return next
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
