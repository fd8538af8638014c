package main

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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

// allocatingPeer answers from memory, making extra heap objects a call.
type allocatingPeer struct {
	op    *operation
	extra int
}

var allocSink [][]byte

func (p *allocatingPeer) call(_ context.Context, key string) ([]byte, error) {
	for range p.extra {
		allocSink = append(allocSink[:0], make([]byte, 64))
	}
	return p.op.run(key), nil
}

func (p *allocatingPeer) close() {}

// TestDriveCountsAllocations: a cell counts the process's allocations while
// it measures, so a peer that makes ten more objects a call shows ten more
// a call.
func TestDriveCountsAllocations(t *testing.T) {
	perOp := func(extra int) float64 {
		l := drive(context.Background(), &allocatingPeer{op: newOperation(), extra: extra},
			freshKeys{last: new(atomic.Uint64)}, 1, 10*time.Millisecond, 50*time.Millisecond)
		require.Positive(t, l.ops)
		return float64(l.allocs) / float64(l.ops)
	}
	base, more := perOp(0), perOp(10)
	assert.InDelta(t, 10, more-base, 1.5, "allocs a call: %.2f without, %.2f with ten more", base, more)
}
