// Package histogram counts latencies for the load tools (cmd/idembench,
// bench/peers) in fixed buckets, cheaply enough for every operation.
package histogram

import (
	"math"
	"math/bits"
	"time"
)

// Histogram counts durations in buckets about 3% wide: exact below 64ns,
// then 32 buckets per power of two, up to about 18 minutes.
type Histogram struct {
	counts [64 + 35*32]uint64
	n      uint64
}

func bucket(ns uint64) int {
	if ns < 64 {
		return int(ns)
	}
	shift := bits.Len64(ns) - 6 // >= 1
	i := 64 + (shift-1)*32 + int(ns>>shift) - 32
	return min(i, len(Histogram{}.counts)-1)
}

// bucketMid returns the middle of bucket i, in nanoseconds.
func bucketMid(i int) float64 {
	if i < 64 {
		return float64(i)
	}
	shift := (i-64)/32 + 1
	lo := uint64(32+(i-64)%32) << shift
	return float64(lo) + float64(uint64(1)<<shift)/2
}

// Record counts one duration; a negative one counts as zero.
func (h *Histogram) Record(d time.Duration) {
	h.counts[bucket(uint64(max(d, 0)))]++
	h.n++
}

// Add counts every duration of o.
func (h *Histogram) Add(o *Histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
}

// Quantile returns the q-quantile in microseconds, or 0 without samples.
func (h *Histogram) Quantile(q float64) float64 {
	if h.n == 0 {
		return 0
	}
	rank := max(uint64(math.Ceil(q*float64(h.n))), 1)
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank && c > 0 {
			return bucketMid(i) / 1000
		}
	}
	return bucketMid(len(h.counts)-1) / 1000
}
