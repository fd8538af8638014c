package main

import (
	"context"
	"math"
	"time"
)

// behindShare is the share of the messages that arrived during a side's
// slices below which a paced side is said to have fallen behind the rate:
// it was saturated, and its figures are not those of a paced consumer.
const behindShare = 0.95

// pacer is the arrival clock of one caller's messages under -rate. The
// caller's messages arrive at perSec a second, evenly spaced, from the
// moment the clock last started (restart, at the start of each of the
// side's slices, so that a side accumulates no backlog while the other
// runs): the k-th (k = 1, 2, ...) at start + (k-1+phase)/perSec. Caller i
// of c has the phase (i+1)/c of an interval, so that the arrivals of all the
// callers, each at -rate/c a second, are evenly spaced at -rate a second.
//
// A pacer does not read the clock: it is told the time, so that a test can
// drive it. It is used by one goroutine at a time, the caller's.
type pacer struct {
	perSec float64
	phase  float64
	start  time.Time
	// taken counts the messages taken since start.
	taken int64
	// arrivedSum and takenSum are the messages that arrived during the
	// slices settled so far, and those that were taken.
	arrivedSum, takenSum int64
}

// newPacer returns the pacer of caller index of callers under a rate of
// perSec messages a second across all of them.
func newPacer(perSec float64, index, callers int) *pacer {
	return &pacer{perSec: perSec / float64(callers), phase: float64(index+1) / float64(callers)}
}

// maxArrival bounds how far from the start an arrival is placed, so that a
// tiny rate does not overflow a time.Duration.
const maxArrival = 100 * 365 * 24 * time.Hour

// arrival returns how long after the start the k-th message (k >= 1)
// arrives, to the nearest nanosecond.
func (p *pacer) arrival(k int64) time.Duration {
	ns := math.Round((float64(k-1) + p.phase) / p.perSec * 1e9)
	if ns >= float64(maxArrival) {
		return maxArrival
	}
	return time.Duration(ns)
}

// arrived returns how many messages have arrived since the start, by now:
// the k whose arrival is at or before now. The estimate from the rate is
// corrected against arrival, so that the message arrival says has arrived
// at an instant is counted at that instant, whatever the rounding.
func (p *pacer) arrived(now time.Time) int64 {
	e := now.Sub(p.start)
	if e < 0 {
		return 0
	}
	k := max(int64(math.Floor(e.Seconds()*p.perSec+1-p.phase)), 0)
	for k > 0 && p.arrival(k) > e {
		k--
	}
	for p.arrival(k+1) <= e {
		k++
	}
	return k
}

// restart starts the arrival clock again at now, with nothing taken: the
// messages that arrived before and were not taken are dropped.
func (p *pacer) restart(now time.Time) { p.start, p.taken = now, 0 }

// due returns the messages that arrived by now and were not taken.
func (p *pacer) due(now time.Time) int64 { return max(p.arrived(now)-p.taken, 0) }

// next returns when the first message not yet taken arrives: now or before
// when one is due.
func (p *pacer) next() time.Time { return p.start.Add(p.arrival(p.taken + 1)) }

// take takes up to limit of the messages due by now, and returns how many
// it took.
func (p *pacer) take(now time.Time, limit int) int {
	n := int(min(p.due(now), int64(limit)))
	p.taken += int64(n)
	return n
}

// giveBack returns n messages taken and not delivered, if n is above 0.
func (p *pacer) giveBack(n int) { p.taken -= int64(max(n, 0)) }

// settle adds the slice that ends at now to the sums: the messages that
// arrived since the start, or only those taken when more is false (the
// stream had no new message left to deliver, so that what arrived after it
// ran out was never there), and those taken.
func (p *pacer) settle(now time.Time, more bool) {
	arrived := p.taken
	if more {
		arrived = max(p.arrived(now), p.taken)
	}
	p.arrivedSum += arrived
	p.takenSum += p.taken
}

// behind reports whether the calls took fewer than behindShare of the
// messages that arrived, arrived of them having arrived and taken taken.
func behind(arrived, taken int64) bool {
	return float64(taken) < behindShare*float64(arrived)
}

// preciseWait is the longest wait for an arrival spent in a
// preciseSleeper, and how long before the arrival a longer wait's timer
// ends. A Go timer wakes an idle process up to a millisecond late: a
// consumer waiting for its arrivals that way would take batches that grow
// with the time it spends idle, so that a consumer quicker than another
// would take larger batches at the same rate, where a consumer woken by
// its queue's socket takes what arrived when it asks.
const preciseWait = 2 * time.Millisecond

// pacedBatch returns the caller's next batch under -rate: the messages not
// acknowledged before (which count as arrived), then the stream's messages
// that arrived and were not taken, up to -batch; when none of either is
// there, it waits for the next to arrive. ok is false when the slice ended
// (end was closed) or ctx was done before one did: then there is no batch.
func (s *stream) pacedBatch(ctx context.Context, o *options, end <-chan struct{}) (msgs []message, ok bool) {
	p := s.pace
	for len(s.pending) == 0 && s.hasNew() {
		now := time.Now()
		if p.due(now) > 0 {
			break
		}
		wait := p.next().Sub(now)
		if wait <= preciseWait {
			// Not interrupted: the slice ends at most preciseWait late.
			if s.sleeper == nil {
				s.sleeper = newPreciseSleeper()
			}
			s.sleeper.sleep(wait)
			continue
		}
		// A timer, which may wake up to a millisecond late, until
		// preciseWait before the arrival; then the sleeper.
		if s.timer == nil {
			s.timer = time.NewTimer(wait - preciseWait)
		} else {
			s.timer.Reset(wait - preciseWait)
		}
		select {
		case <-s.timer.C:
		case <-end:
			s.timer.Stop()
			return nil, false
		case <-ctx.Done():
			s.timer.Stop()
			return nil, false
		}
	}
	n := 0
	if s.hasNew() {
		n = p.take(time.Now(), o.batch)
	}
	pending := len(s.pending)
	msgs = s.fill(o, n, s.pacedRedeliveries(o, n))
	// The stream's last ids may be fewer than what arrived: the rest was
	// never there.
	p.giveBack(n - (len(msgs) - pending))
	return msgs, true
}

// pacedRedeliveries returns how many of the n messages of a paced batch
// redeliver ids of earlier batches: -dup of them, carried from batch to
// batch, so that batches of any size redeliver -dup of the messages in all,
// where rounding each batch's share would make small batches redeliver
// none, or half. None while the stream has no earlier batch.
func (s *stream) pacedRedeliveries(o *options, n int) int {
	if len(s.recent) == 0 || o.dup == 0 {
		return 0
	}
	s.owed += o.dup * float64(n)
	r := min(int(s.owed), n)
	s.owed -= float64(r)
	return r
}

// closePacing releases what the paced waits of s's callers hold.
func (s *side) closePacing() {
	for _, st := range s.streams {
		if st.sleeper != nil {
			st.sleeper.close()
			st.sleeper = nil
		}
	}
}
