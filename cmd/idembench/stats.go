package main

import (
	"fmt"
	"math/bits"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/internal/histogram"
)

// stats is what one side (idem or baseline) of a run measured.
type stats struct {
	elapsed    time.Duration
	hist       histogram.Histogram
	executed   atomic.Int64
	replayed   atomic.Int64
	inProgress atomic.Int64
	// redelivered counts, in -workload batch, the messages not
	// acknowledged because a handler failed, which came again.
	redelivered atomic.Int64
	errors      atomic.Int64
	// batches counts the batches of -workload batch.
	batches    atomic.Int64
	errSamples map[string]int
}

func newStats() *stats { return &stats{errSamples: map[string]int{}} }

// ops counts the operations that completed, in -workload batch the
// messages delivered (errors are not counted).
func (s *stats) ops() int64 {
	return s.executed.Load() + s.replayed.Load() + s.inProgress.Load() + s.redelivered.Load()
}

func (s *stats) merge(ls *localStats) {
	s.hist.Add(&ls.hist)
	s.executed.Add(ls.executed)
	s.replayed.Add(ls.replayed)
	s.inProgress.Add(ls.inProgress)
	s.redelivered.Add(ls.redelivered)
	s.errors.Add(ls.errors)
	s.batches.Add(ls.batches)
	for m, n := range ls.errSamples {
		if len(s.errSamples) < 5 {
			s.errSamples[m] += n
		}
	}
}

func (s *stats) samples() []string {
	var out []string
	for m, n := range s.errSamples {
		out = append(out, fmt.Sprintf("%s (%d times)", m, n))
	}
	return out
}

// localStats is one goroutine's share of a slice, merged at its end.
type localStats struct {
	hist        histogram.Histogram
	done        atomic.Int64 // operations finished, for the progress line
	executed    int64
	replayed    int64
	inProgress  int64
	redelivered int64
	errors      int64
	batches     int64
	errSamples  map[string]int
}

func (ls *localStats) record(d time.Duration) { ls.hist.Record(d) }

func (ls *localStats) fail(err error) {
	ls.errors++
	if ls.errSamples == nil {
		ls.errSamples = map[string]int{}
	}
	if len(ls.errSamples) < 5 {
		ls.errSamples[err.Error()]++
	}
}

func rate(n int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

// bitset records which keys ran, and counts the runs of a key that had run
// before. It grows in chunks, without a lock on the path that marks.
type bitset struct {
	chunks     [1 << 16]atomic.Pointer[[chunkWords]atomic.Uint64]
	duplicates atomic.Int64
}

const chunkWords = 1 << 10 // 65536 keys a chunk; 2^32 keys in all

func newBitset() *bitset { return &bitset{} }

// mark records that key id ran; it returns false, and counts a duplicate, if
// it had run before.
func (b *bitset) mark(id uint64) bool {
	c := id >> 16
	if c >= uint64(len(b.chunks)) {
		panic("idembench: more than 2^32 keys")
	}
	chunk := b.chunks[c].Load()
	if chunk == nil {
		b.chunks[c].CompareAndSwap(nil, new([chunkWords]atomic.Uint64))
		chunk = b.chunks[c].Load()
	}
	bit := uint64(1) << (id & 63)
	if chunk[(id>>6)&(chunkWords-1)].Or(bit)&bit != 0 {
		b.duplicates.Add(1)
		return false
	}
	return true
}

// count returns how many keys ran, once or more. It reads every chunk: call
// it once the marking is over.
func (b *bitset) count() int64 {
	var n int
	for i := range b.chunks {
		if chunk := b.chunks[i].Load(); chunk != nil {
			for j := range chunk {
				n += bits.OnesCount64(chunk[j].Load())
			}
		}
	}
	return int64(n)
}
