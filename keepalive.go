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
// Renewals go on until stop, whatever happens to ctx: a caller that gives up
// (a client timeout) does not end an operation that goes on, so its lease
// must not end either, or a retry would take the key over and run the
// operation a second time while the first still runs. They carry ctx's
// values, not its cancellation. The operation's context still carries ctx's
// cancellation, for the operation to honour if it can.
//
// A claim that has less than a third of its lease left when KeepAlive is
// called (its answer came late) is renewed before KeepAlive returns. A
// renewal that fails without the store saying the lease is lost is tried
// again after a third of what is left of the lease.
//
// The operation's context is also cancelled, with a cause wrapping
// ErrLeaseLost, when the store says the claim is no longer the holder, or
// when the lease runs out because no renewal got through. stop ends the
// renewals and returns once they have ended; it returns that cause if the
// lease was lost, else nil; it may be called again, and returns the same.
// Call stop exactly when the operation has returned; until then the key
// stays held, for as long as the process lives.
//
// An operation shorter than a third of the lease (most of them) costs no
// goroutine, no timer of its own and no renewal: the renewals of a Keeper's
// claims are due in the order they were asked for, and wait in one queue
// with one timer (renewalQueue).
func (c *Claim) KeepAlive(ctx context.Context) (_ context.Context, stop func() error) {
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
	next := ka.q.every
	// A claim whose answer came late (a slow or resent claim) may have
	// less than a third of its lease left, or none, by this process's
	// clock: renew it before the operation starts, so that no other
	// attempt can take the key over while it runs. If that says the lease
	// is lost, the operation's context is cancelled before it starts.
	if c.localLeaseEnd().Sub(c.k.now()) < next {
		var lost error
		if lost, next = ka.renewOnce(); lost != nil {
			return ka
		}
	}
	ka.q.schedule(ka, next)
	return ka
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

	// entry, stopped and retry are guarded by q.mu. entry is the place in
	// q while the next renewal waits there; retry is the timer of a
	// renewal due sooner than q's order allows (after a failed one);
	// stopped is set by stop, after which nothing is scheduled.
	entry   renewalEntry
	stopped bool
	retry   *time.Timer
	// running counts the renewals under way, which stop waits for. A
	// renewal is counted under q.mu, by what starts it, so that stop sees
	// it.
	running sync.WaitGroup
	// detached is renewalContext's context, made at the first renewal:
	// renewals run one at a time, each started after the previous one
	// scheduled it (under q.mu), so it needs no lock of its own.
	detached context.Context

	once sync.Once
	mu   sync.Mutex
	// lost is the cause the operation's context was cancelled with; guarded
	// by mu.
	lost error
}

// opContext is the context of an operation that holds a claim: a
// context.WithCancelCause of the caller's context that also answers the
// Claim for ClaimFromContext, so that it costs no context.WithValue of its
// own. context.Cause and derived contexts see through it to the cancelCtx.
type opContext struct {
	context.Context
	c *Claim
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

// renewOnce renews the lease once. If the lease is lost, it cancels the
// operation's context with the cause and returns it; else it returns when
// to renew next.
func (ka *keepAlive) renewOnce() (lost error, next time.Duration) {
	c, ctx := ka.op.c, ka.renewalContext()
	started := c.k.startStep()
	lost, next = c.renewal(ctx)
	if lost != nil {
		c.report(ctx, StepLease, started, lost)
		ka.mu.Lock()
		ka.lost = lost
		ka.mu.Unlock()
		ka.cancel(lost)
	}
	return lost, next
}

// renew runs one renewal that the queue or the retry timer started (and
// counted in running), then schedules the next unless the lease was lost.
func (ka *keepAlive) renew() {
	defer ka.running.Done()
	if lost, next := ka.renewOnce(); lost == nil {
		ka.q.schedule(ka, next)
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
	ka.running.Add(1)
	ka.q.mu.Unlock()
	ka.renew()
}

// lostErr returns the cause of a lost lease, or nil.
func (ka *keepAlive) lostErr() error {
	ka.mu.Lock()
	defer ka.mu.Unlock()
	return ka.lost
}

// stop ends the renewals, waits for one under way, and returns the cause of
// a lost lease, or nil.
func (ka *keepAlive) stop() error {
	ka.once.Do(func() {
		q := ka.q
		q.mu.Lock()
		ka.stopped = true
		q.remove(&ka.entry)
		if ka.retry != nil {
			ka.retry.Stop()
		}
		q.mu.Unlock()
		ka.running.Wait()
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
		e.ka.running.Add(1)
		go e.ka.renew()
	}
	if e := q.root.next; e != &q.root {
		q.arm(e.due.Sub(now))
	}
}

// renewal extends the lease once, and returns an error wrapping
// ErrLeaseLost if the claim is no longer the holder (the store says so, or
// the renewal failed and the lease has run out by this process's clock),
// and when to renew next: a third of the lease after a renewal that went
// through; after one that failed, a third of what is left of the lease, so
// that a slow failure shorter than the lease does not let it run out.
func (c *Claim) renewal(ctx context.Context) (lost error, next time.Duration) {
	every := max(c.k.policy.lease/3, time.Millisecond)
	err := c.Extend(ctx)
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
	lost = fmt.Errorf("%w: the lease ran out without renewal: %w", ErrLeaseLost, err)
	c.endHold(0, nil, lost)
	return lost, 0
}
