package main

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// stallingPeer runs the operation at once, but its first call stalls for
// stall (a shared machine that stopped the caller).
type stallingPeer struct {
	op    *operation
	calls atomic.Int64
	stall time.Duration
}

func (p *stallingPeer) call(_ context.Context, key string) ([]byte, error) {
	if p.calls.Add(1) == 1 {
		time.Sleep(p.stall)
	}
	return p.op.run(key), nil
}

func (p *stallingPeer) close() {}

// TestDriveMeasuresACallerWhoseCallOutlastedTheCell: one caller whose first
// call outlasts the warm-up and the measurement still has calls of its own
// measured, so that a short cell on a busy machine measures something.
func TestDriveMeasuresACallerWhoseCallOutlastedTheCell(t *testing.T) {
	p := &stallingPeer{op: newOperation(), stall: 60 * time.Millisecond}
	l := drive(context.Background(), p, freshKeys{last: new(atomic.Uint64)}, 1, 10*time.Millisecond, 20*time.Millisecond)
	assert.Positive(t, l.ops, "measured after the stall")
	assert.Positive(t, l.elapsed)
	assert.Zero(t, l.errors)
}
