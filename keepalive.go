package idem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// KeepAlive renews the lease in the background every third of the lease
// until stop is called, and returns a context derived from ctx for the
// operation, which carries c (ClaimFromContext).
//
// Renewals go on until stop, whatever happens to ctx (a caller that gave
// up does not end an operation that goes on, nor its lease): they carry
// ctx's values, not its cancellation. The operation's context carries ctx's
// cancellation, for the operation to honour if it can.
//
// The claim knows its own lease: the lease end, by the Keeper's clock
// (WithClock), measured from before the request that set it was sent, moves
// only when a renewal succeeds. When it passes, the operation's context is
// cancelled, with a cause wrapping ErrLeaseLost, whatever a renewal under way
// is doing: a renewal that hangs (a partitioned Redis, a client whose
// timeouts and retries add up past the lease) does not hold the
// cancellation back. Each renewal's context has the lease left as its
// deadline, so a client that honours deadlines (go-redis with
// ContextTimeoutEnabled) gives up on it then. A renewal that fails without
// the store saying the lease is lost is tried again within a third of what
// is left of the lease, so an outage shorter than half a lease loses no
// lease.
//
// A claim whose lease has already run out when KeepAlive is called is lost
// at once: the operation's context is cancelled before the operation
// starts. A claim that has less than a third of its lease left (its answer
// came late) is renewed before KeepAlive returns, for at most the lease
// left.
//
// The operation's context is also cancelled, with a cause wrapping
// ErrLeaseLost, when the store says the claim is no longer the holder. stop
// ends the renewals and returns once the one under way, if any, has ended,
// or at once when the lease is lost (a renewal that hangs then is left to
// end on its own and changes nothing); it returns the cause if the lease was
// lost, else nil; it may be called again, and returns the same. Call stop
// exactly when the operation has returned; until then the key stays held,
// for as long as the process lives and its renewals get through.
//
// On a nil Claim (ClaimFromContext where no claim was made) KeepAlive
// renews nothing: it returns a context already cancelled with a cause
// wrapping ErrNoClaim, and a stop that returns that cause.
func (c *Claim) KeepAlive(ctx context.Context) (_ context.Context, stop func() error) {
	if c == nil {
		err := errNoClaim("keep alive")
		op, cancel := context.WithCancelCause(ctx)
		cancel(err)
		return op, func() error { return err }
	}
	ka := c.keepAlive(ctx)
	return &ka.op, ka.stop
}

// keepAlive starts the renewals of KeepAlive; Do calls it to use the
// keepAlive without the closure that KeepAlive's stop is.
func (c *Claim) keepAlive(ctx context.Context) *keepAlive {
	ka := &keepAlive{parent: ctx, q: &c.k.renewals}
	ka.entry.ka = ka
	ka.op.c = c
	ka.op.Context, ka.cancel = context.WithCancelCause(ctx)
	ka.op.cancel = ka.cancel
	// A claim whose answer came late (a slow or resent claim) may have
	// less than a third of its lease left, or none, by this process's
	// clock: renew it before the operation starts, so that no other
	// attempt can take the key over while it runs. If the lease has run
	// out, or the renewal says it is lost, or the lease runs out while the
	// renewal is under way, the operation's context is cancelled before it
	// starts.
	if c.localLeaseEnd().Sub(c.k.now()) < c.renewEvery() {
		idle := make(chan struct{})
		ka.q.mu.Lock()
		ka.busy, ka.idle = true, idle
		ka.q.mu.Unlock()
		go ka.renew()
		select {
		case <-idle:
		case <-ka.lostSignal():
		}
		return ka
	}
	ka.q.schedule(ka, c.renewEvery())
	return ka
}

// renewEvery is how often the claim's lease is renewed: a third of it, at
// least a millisecond, and never less often than the queue's period (a
// claim with a lease of its own longer than the Keeper's, made by Consume,
// is renewed as often as the Keeper's claims, so that the queue stays in
// the order of its deadlines; one with a shorter lease is renewed on a
// timer of its own).
func (c *Claim) renewEvery() time.Duration {
	return min(max(c.lease/3, time.Millisecond), c.k.renewals.every)
}

// keepAlive is the state of one KeepAlive.
type keepAlive struct {
	// op is the operation's context.
	op opContext
	// parent is the caller's context. The renewals carry its values but not
	// its cancellation (renewalContext): they outlive the caller.
	parent context.Context
	cancel context.CancelCauseFunc
	q      *renewalQueue

	// entry, stopped, retry, busy and idle are guarded by q.mu. entry is
	// the place in q while the next renewal waits there; retry is the
	// timer of a renewal due sooner than q's order allows (after a failed
	// one); stopped is set by stop, after which nothing is scheduled. busy
	// is set while a renewal is under way (one at a time: each is started
	// after the previous one scheduled it), by what starts it; idle, when
	// set, is closed when that renewal ends (stop, or keepAlive for a late
	// claim, waits on it).
	entry   renewalEntry
	stopped bool
	retry   *time.Timer
	busy    bool
	idle    chan struct{}
	// detached is renewalContext's context, made at the first renewal:
	// renewals run one at a time, so it needs no lock of its own.
	detached context.Context

	once sync.Once
	mu   sync.Mutex
	// lost is the cause the operation's context was cancelled with; lostC,
	// when made (lostSignal), is closed when lost is set. Both guarded by
	// mu.
	lost  error
	lostC chan struct{}
}

// opContext is the context of an operation that holds a claim: a
// context.WithCancelCause of the caller's context that also answers the
// Claim for ClaimFromContext, so that it costs no context.WithValue of its
// own. context.Cause and derived contexts see through it to the cancelCtx.
type opContext struct {
	context.Context
	c *Claim
	// cancel cancels Context, with a cause.
	cancel context.CancelCauseFunc
}

// errRanOutAtCheck is the cause of a lease found run out, by this
// process's clock, when the operation asked its context for its error.
var errRanOutAtCheck = errors.New("the lease ran out by this process's clock")

// Err returns the context's error. Once the claim's lease has run out by
// this process's clock, it first cancels the context (the cause wraps
// ErrLeaseLost): an operation resumed past its lease (the process was
// paused) finds its context done at its first check, before the lease
// watch, whose timer fires late then, has cancelled it. Contexts derived
// from it see the cancellation from then on.
func (o *opContext) Err() error {
	if err := o.Context.Err(); err != nil || o.cancel == nil {
		return err
	}
	if !o.c.k.now().Before(o.c.localLeaseEnd()) {
		o.cancel(fmt.Errorf("%w: %w", ErrLeaseLost, errRanOutAtCheck))
		return o.Context.Err()
	}
	return nil
}

// Value returns the Claim for ClaimFromContext's key, else what the
// caller's context holds.
func (o *opContext) Value(key any) any {
	if _, ok := key.(claimKey); ok {
		return o.c
	}
	return o.Context.Value(key)
}

// String names the context, as the context package's own do.
func (o *opContext) String() string { return fmt.Sprintf("%v.WithValue(idem.Claim)", o.Context) }

// renewalContext is the context of the renewals: the caller's values,
// without its cancellation.
func (ka *keepAlive) renewalContext() context.Context {
	if ka.detached == nil {
		ka.detached = detach(ka.parent)
	}
	return ka.detached
}

// errRanOutBeforeRenewal is the cause of a lease that had run out, by this
// process's clock, when its renewal was due (the process was paused, or the
// claim was answered after its lease).
var errRanOutBeforeRenewal = errors.New("the lease ran out by this process's clock before it could be renewed")

// errRanOutDuringRenewal is the cause of a lease that ran out, by this
// process's clock, while its renewal was under way.
var errRanOutDuringRenewal = errors.New("the lease ran out by this process's clock while its renewal was under way")

// renewOnce renews the lease once, for at most the lease left. If the lease
// is lost (the store says so, it had run out, or it ran out meanwhile), it
// cancels the operation's context with the cause and returns it; else it
// returns when to renew next.
func (ka *keepAlive) renewOnce() (lost error, next time.Duration) {
	if lost := ka.lostErr(); lost != nil {
		return lost, 0
	}
	c := ka.op.c
	started := c.k.startStep()
	left := c.localLeaseEnd().Sub(c.k.now())
	if left <= 0 {
		return ka.lose(fmt.Errorf("%w: %w", ErrLeaseLost, errRanOutBeforeRenewal), started), 0
	}
	ctx, cancel := context.WithTimeout(ka.renewalContext(), left)
	w := &leaseWatch{ka: ka, started: started}
	w.stop = context.AfterFunc(ctx, w.check)
	lost, next = c.renewal(ctx)
	w.end()
	cancel()
	if lost != nil {
		return ka.lose(lost, started), 0
	}
	if lost := ka.lostErr(); lost != nil {
		return lost, 0 // the lease ran out before this renewal came back
	}
	return nil, next
}

// lose records cause as the loss of the lease, tells the Observer and the
// coalescing layer, and cancels the operation's context; the first cause
// wins. It returns the cause recorded.
func (ka *keepAlive) lose(cause error, started time.Time) error {
	ka.mu.Lock()
	if ka.lost != nil {
		cause = ka.lost
		ka.mu.Unlock()
		return cause
	}
	ka.lost = cause
	// The operation's context ends before anyone waiting on lostSignal is
	// woken: a caller that checks context.Cause when KeepAlive returns sees
	// the loss.
	ka.cancel(cause)
	if ka.lostC != nil {
		close(ka.lostC)
	}
	ka.mu.Unlock()
	c := ka.op.c
	c.report(ka.renewalContext(), StepLease, started, cause)
	c.endHold(0, nil, cause)
	return cause
}

// leaseWatch cancels the operation of a renewal under way when the lease
// runs out by the Keeper's clock, whatever the renewal is doing. It is armed
// on the deadline of the renewal's context, which is the lease left by the
// Keeper's clock when the renewal began; with a clock of its own
// (WithClock) that has not moved as far, it looks again when the rest is
// due by that clock.
type leaseWatch struct {
	ka      *keepAlive
	started time.Time
	stop    func() bool // stops the context.AfterFunc

	mu sync.Mutex
	// done is set when the renewal came back or the lease was declared
	// lost; again is the timer of a second look. Guarded by mu.
	done  bool
	again *time.Timer
}

// check runs when the renewal's deadline has passed.
func (w *leaseWatch) check() {
	c := w.ka.op.c
	w.mu.Lock()
	if w.done {
		w.mu.Unlock()
		return
	}
	if left := c.localLeaseEnd().Sub(c.k.now()); left > 0 {
		// The lease was renewed meanwhile, or the Keeper's clock is behind
		// real time: look again when the rest is due.
		if w.again == nil {
			w.again = time.AfterFunc(left, w.check)
		} else {
			w.again.Reset(left)
		}
		w.mu.Unlock()
		return
	}
	w.done = true
	w.mu.Unlock()
	w.ka.lose(fmt.Errorf("%w: %w", ErrLeaseLost, errRanOutDuringRenewal), w.started)
}

// end disarms the watch once the renewal came back.
func (w *leaseWatch) end() {
	w.stop()
	w.mu.Lock()
	w.done = true
	if w.again != nil {
		w.again.Stop()
	}
	w.mu.Unlock()
}

// renew runs one renewal that the queue, the retry timer or keepAlive
// started (and marked busy), then schedules the next unless the lease was
// lost.
func (ka *keepAlive) renew() {
	lost, next := ka.renewOnce()
	q := ka.q
	q.mu.Lock()
	ka.busy = false
	if ka.idle != nil {
		close(ka.idle)
		ka.idle = nil
	}
	q.mu.Unlock()
	if lost == nil {
		q.schedule(ka, next)
	}
}

// retryNow runs on the retry timer.
func (ka *keepAlive) retryNow() {
	ka.q.mu.Lock()
	if ka.stopped {
		ka.q.mu.Unlock()
		return
	}
	ka.retry = nil
	ka.busy = true
	ka.q.mu.Unlock()
	ka.renew()
}

// lostErr returns the cause of a lost lease, or nil.
func (ka *keepAlive) lostErr() error {
	ka.mu.Lock()
	defer ka.mu.Unlock()
	return ka.lost
}

// closedChan is a channel that is closed.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// lostSignal returns a channel that is closed once the lease is lost.
func (ka *keepAlive) lostSignal() <-chan struct{} {
	ka.mu.Lock()
	defer ka.mu.Unlock()
	if ka.lost != nil {
		return closedChan
	}
	if ka.lostC == nil {
		ka.lostC = make(chan struct{})
	}
	return ka.lostC
}

// stop ends the renewals, waits for one under way unless the lease is lost,
// and returns the cause of a lost lease, or nil.
func (ka *keepAlive) stop() error {
	ka.once.Do(func() {
		q := ka.q
		q.mu.Lock()
		ka.stopped = true
		q.remove(&ka.entry)
		if ka.retry != nil {
			ka.retry.Stop()
		}
		idle := ka.idle
		if ka.busy && idle == nil {
			idle = make(chan struct{})
			ka.idle = idle
		}
		q.mu.Unlock()
		if idle != nil {
			select {
			case <-idle:
			case <-ka.lostSignal():
				// The lease is lost: the renewal under way can change
				// nothing any more, and may hang for as long as the
				// store's client lets it.
			}
		}
		ka.cancel(nil)
	})
	return ka.lostErr()
}

// renewalQueue holds the next renewal of each KeepAlive of a Keeper, and
// starts each when it is due, on one timer. A renewal due a third of the
// lease from now is due after every one already queued, as all are a third
// of one lease from when they were queued: the queue is a list in the order
// of their deadlines, queueing is an append, and the timer is set for the
// first deadline only. Queueing costs a clock read and a lock, where a
// timer of its own per claim (time.AfterFunc and its Stop) costs several
// times as much and two allocations. Each renewal runs on a goroutine of
// its own, so that a slow one holds no other up.
type renewalQueue struct {
	// every is when a renewal is due after the last one: a third of the
	// lease, at least a millisecond.
	every time.Duration

	mu sync.Mutex
	// root is the sentinel of the list; root.next is due first.
	root renewalEntry
	// t fires fire; made at the first renewal queued. armed is set while
	// it is set to fire.
	t     *time.Timer
	armed bool
}

// renewalEntry is a keepAlive's place in a renewalQueue; due is when its
// renewal is due, by the monotonic clock.
type renewalEntry struct {
	prev, next *renewalEntry
	due        time.Time
	ka         *keepAlive
}

// init makes q the empty queue of renewals of a lease.
func (q *renewalQueue) init(lease time.Duration) {
	q.every = max(lease/3, time.Millisecond)
	q.root.prev, q.root.next = &q.root, &q.root
}

// schedule has ka's lease renewed after d, unless ka is stopped: by the
// queue when d is the queue's every, else (a retry after a failed renewal,
// sooner) on a timer of ka's own.
func (q *renewalQueue) schedule(ka *keepAlive, d time.Duration) {
	due := time.Now().Add(d)
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case ka.stopped:
	case d < q.every:
		ka.retry = time.AfterFunc(d, ka.retryNow)
	default:
		e := &ka.entry
		if last := q.root.prev; last != &q.root && due.Before(last.due) {
			// Read before the lock, after the last one's: keep the order.
			due = last.due
		}
		e.due = due
		e.prev, e.next = q.root.prev, &q.root
		e.prev.next, q.root.prev = e, e
		if !q.armed {
			q.arm(d)
		}
	}
}

// remove takes e out of the queue, if it is in it; q.mu is held.
func (q *renewalQueue) remove(e *renewalEntry) {
	if e.next == nil {
		return
	}
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
}

// arm sets the timer to fire after d; q.mu is held.
func (q *renewalQueue) arm(d time.Duration) {
	if q.t == nil {
		q.t = time.AfterFunc(d, q.fire)
	} else {
		q.t.Reset(d)
	}
	q.armed = true
}

// fire runs on the timer: it starts the renewals that are due, and sets the
// timer for the next deadline.
func (q *renewalQueue) fire() {
	now := time.Now()
	q.mu.Lock()
	defer q.mu.Unlock()
	q.armed = false
	for e := q.root.next; e != &q.root && !now.Before(e.due); e = q.root.next {
		q.remove(e)
		e.ka.busy = true
		go e.ka.renew()
	}
	if e := q.root.next; e != &q.root {
		q.arm(e.due.Sub(now))
	}
}

// renewal extends the lease once, within ctx (whose deadline is the lease
// left), and returns an error wrapping ErrLeaseLost if the claim is no longer
// the holder (the store says so, or the renewal failed and the lease has run
// out by this process's clock), and when to renew next: a third of the lease
// after a renewal that went through; after one that failed, a third of what
// is left of the lease, so that a slow failure shorter than the lease does not
// let it run out.
func (c *Claim) renewal(ctx context.Context) (lost error, next time.Duration) {
	every := c.renewEvery()
	started := c.k.now()
	err := c.storeExtend(ctx)
	switch {
	case err == nil:
		c.leaseRenewed(started)
	case errors.Is(err, ErrLeaseLost), errors.Is(err, ErrCorrupt), errors.Is(err, ErrUnavailable):
	case ctx.Err() != nil:
		// The renewal's own deadline, the lease left, passed: not the
		// caller's cancellation (renewals carry none).
		err = fmt.Errorf("%w: extend: %w: %w", ErrUnavailable, errRanOutDuringRenewal, err)
	default:
		err = fmt.Errorf("%w: extend: %w", ErrUnavailable, err)
	}
	if c.k.observer != nil {
		c.report(ctx, StepExtend, started, err)
	}
	if err == nil {
		return nil, every
	}
	if errors.Is(err, ErrLeaseLost) {
		return fmt.Errorf("%w: %w", ErrLeaseLost, errors.New("the claim was taken over, released or expired")), 0
	}
	left := c.localLeaseEnd().Sub(c.k.now())
	if left > 0 {
		return nil, max(min(every, left/3), time.Millisecond) // the next renewal may get through in time
	}
	return fmt.Errorf("%w: the lease ran out without renewal: %w", ErrLeaseLost, err), 0
}
