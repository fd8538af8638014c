package idem

import (
	"bytes"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
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
