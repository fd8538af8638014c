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
// operation.
//
// Renewals go on until stop, whatever happens to ctx: a caller that gives up
// (a client timeout) does not end an operation that goes on, so its lease
// must not end either, or a retry would take the key over and run the
// operation a second time while the first still runs. The operation's
// context still carries ctx's cancellation, for the operation to honour if
// it can.
//
// The operation's context is also cancelled, with a cause wrapping
// ErrLeaseLost, when the store says the claim is no longer the holder, or
// when the lease runs out because no renewal got through. stop ends the
// renewals and returns once they have ended; it returns that cause if the
// lease was lost, else nil. Call stop exactly when the operation has
// returned; until then the key stays held, for as long as the process lives.
func (c *Claim) KeepAlive(ctx context.Context) (_ context.Context, stop func() error) {
	opCtx, cancel := context.WithCancelCause(ctx)
	ka := &keepAlive{
		c:      c,
		ctx:    context.WithoutCancel(ctx),
		cancel: cancel,
		every:  max(c.k.policy.lease/3, time.Millisecond),
	}
	// A claim whose answer came late (a slow or resent claim) may have
	// less than a third of its lease left, or none, by this process's
	// clock: renew it before the operation starts, so that no other
	// attempt can take the key over while it runs. If that says the lease
	// is lost, the operation's context is cancelled before it starts.
	if c.localLeaseEnd().Sub(c.k.now()) < ka.every {
		started := c.k.startStep()
		if lost, _ := c.renewal(ka.ctx); lost != nil {
			c.report(ka.ctx, StepLease, started, lost)
			ka.lost = lost
			cancel(lost)
		}
	}
	// A timer, not a goroutine: an operation shorter than a third of the
	// lease (most of them) costs no goroutine and no renewal.
	ka.mu.Lock()
	ka.t = time.AfterFunc(ka.every, ka.renew)
	if ka.lost != nil {
		ka.t.Stop()
	}
	ka.mu.Unlock()
	return opCtx, ka.stop
}

// keepAlive is the state of one KeepAlive.
type keepAlive struct {
	c *Claim
	// ctx carries the values of the caller's context but not its
	// cancellation: renewals outlive the caller.
	ctx    context.Context
	cancel context.CancelCauseFunc
	every  time.Duration

	once sync.Once
	mu   sync.Mutex
	// t fires the next renewal; stopped is set by stop, after which t is not
	// reset; lost is the cause the operation's context was cancelled with.
	t       *time.Timer
	stopped bool
	lost    error
	// running counts the renewals under way, which stop waits for.
	running sync.WaitGroup
}

// renew runs on the timer: one renewal, then the timer is set again unless
// the lease was lost or stop was called.
func (ka *keepAlive) renew() {
	ka.mu.Lock()
	if ka.stopped {
		ka.mu.Unlock()
		return
	}
	ka.running.Add(1)
	ka.mu.Unlock()
	defer ka.running.Done()

	started := ka.c.k.startStep()
	lost, next := ka.c.renewal(ka.ctx)
	if lost != nil {
		ka.c.report(ka.ctx, StepLease, started, lost)
	}
	ka.mu.Lock()
	defer ka.mu.Unlock()
	switch {
	case lost != nil:
		ka.lost = lost
		ka.cancel(lost)
	case !ka.stopped:
		ka.t.Reset(next)
	}
}

// stop ends the renewals, waits for one under way, and returns the cause of
// a lost lease, or nil.
func (ka *keepAlive) stop() error {
	ka.once.Do(func() {
		ka.mu.Lock()
		ka.stopped = true
		ka.t.Stop()
		ka.mu.Unlock()
		ka.running.Wait()
		ka.cancel(nil)
	})
	ka.mu.Lock()
	defer ka.mu.Unlock()
	return ka.lost
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
