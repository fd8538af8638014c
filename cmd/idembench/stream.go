package main

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"strconv"
	"time"
)

// message is one message of -workload batch's queue: its id, and its key, the
// string the queue carries ("k" and the id).
type message struct {
	id  uint64
	key string
}

// messageKey is the key of a message, as idem.Consume asks for it.
func messageKey(m message) string { return m.key }

// stream is one caller's share of the queue in -workload batch, on one side
// of the run. The caller owns the ids index, index+callers, index+2·callers,
// and so on (below -messages, if it is given), and delivers them in batches:
// each batch of the stream holds round(-dup × -batch) ids drawn from the
// -keys last ids of its earlier batches (none in its first), then new ids up
// to -batch. Every side's caller of the same index draws the same batches
// from the same seed, so both sides see the same stream. The messages a side
// did not acknowledge come back at the head of its caller's next batch, on
// top of the stream's, as a queue redelivers what was not acknowledged; once
// the stream has no new id left, batches of those alone follow until none is
// left. Under -rate a batch holds, in place of -batch, the messages that
// arrived (see pacer and pacedBatch), of which -dup redeliver, carried from
// batch to batch.
//
// A stream is used by one goroutine at a time: the caller's, and the
// handlers Consume runs for it one after another.
type stream struct {
	index, callers uint64
	// limit is -messages: ids at or above it are not the run's; 0 for a run
	// timed by -d, whose ids never run out.
	limit uint64
	// sent counts the new ids delivered: the next one is
	// index + sent·callers.
	sent uint64
	// ended is set when the stream delivers no new id any more: its ids ran
	// out, or the time of the run did.
	ended bool
	// rng draws the redelivered ids; seeded by -seed and index.
	rng *rand.Rand
	// recent holds up to -keys ids of the caller's earlier batches, a ring
	// whose next slot is next.
	recent []uint64
	next   int
	// pending are the messages not acknowledged, which come back first in
	// the next batch.
	pending []message
	// failures counts the failed handler calls of each id that failed.
	failures map[uint64]uint32
	fail     failureChoice
	// msgs is the batch under way.
	msgs []message
	// handle is handleMessage, the handler of the side's messages, which
	// marks an id as run in ran.
	handle func(context.Context, message) error
	ran    *bitset
	// handlerFailures counts the handler calls that failed.
	handlerFailures int64
	// pace is the caller's arrival clock under -rate, nil without it;
	// timer and sleeper wait for its next arrival (pacedBatch), and owed
	// is the share of a redelivery that paced batches carry
	// (pacedRedeliveries).
	pace    *pacer
	timer   *time.Timer
	sleeper *preciseSleeper
	owed    float64
}

func newStream(o *options, index int, ran *bitset) *stream {
	s := &stream{
		index: uint64(index), callers: uint64(o.concurrency), limit: uint64(o.messages),
		rng:      rand.New(rand.NewPCG(o.seed, uint64(index))),
		failures: map[uint64]uint32{},
		fail:     newFailureChoice(o.seed, o.fail),
		ran:      ran,
	}
	s.handle = s.handleMessage
	if o.rate > 0 {
		s.pace = newPacer(o.rate, index, o.concurrency)
	}
	return s
}

// newStreams returns the -c streams of one side, marking the ids whose
// handler succeeded in ran.
func newStreams(o *options, ran *bitset) []*stream {
	ss := make([]*stream, o.concurrency)
	for i := range ss {
		ss[i] = newStream(o, i, ran)
	}
	return ss
}

// done reports whether the stream has nothing left to deliver.
func (s *stream) done() bool { return !s.hasNew() && len(s.pending) == 0 }

// hasNew reports whether the stream has a new id left to deliver.
func (s *stream) hasNew() bool {
	return !s.ended && (s.limit == 0 || s.index+s.sent*s.callers < s.limit)
}

// nextBatch returns the messages of the caller's next batch: the ones not
// acknowledged before, then the stream's next batch, if it has one (see
// stream).
func (s *stream) nextBatch(o *options) []message {
	return s.fill(o, o.batch, redelivered(o))
}

// nextCall returns the caller's next batch: nextBatch's, or under -rate
// pacedBatch's, which waits for a message to arrive unless the slice ends
// (end is closed) or ctx is done first; then ok is false and there is no
// batch.
func (s *stream) nextCall(ctx context.Context, o *options, end <-chan struct{}) (msgs []message, ok bool) {
	if s.pace == nil {
		return s.nextBatch(o), true
	}
	return s.pacedBatch(ctx, o, end)
}

// fill returns the messages not acknowledged before, then, if the stream
// has a new id left, n messages of the stream: r of them (none in its
// first batch) ids of its earlier batches, the rest new ids, as many as it
// has left.
func (s *stream) fill(o *options, n, r int) []message {
	s.msgs = append(s.msgs[:0], s.pending...)
	s.pending = s.pending[:0]
	if !s.hasNew() {
		return s.msgs
	}
	if len(s.recent) > 0 {
		for range r {
			s.msgs = append(s.msgs, s.message(s.recent[s.rng.IntN(len(s.recent))]))
		}
		n -= r
	}
	for ; n > 0 && s.hasNew(); n-- {
		id := s.index + s.sent*s.callers
		s.sent++
		s.msgs = append(s.msgs, s.message(id))
		s.remember(id, o.keys)
	}
	return s.msgs
}

// redelivered is how many ids of each batch but the first a caller's stream
// redelivers: round(-dup × -batch).
func redelivered(o *options) int { return int(o.dup*float64(o.batch) + 0.5) }

// message returns the message of id.
func (s *stream) message(id uint64) message {
	return message{id: id, key: "k" + strconv.FormatUint(id, 10)}
}

// remember adds id to the recent ids, of which it keeps the last limit.
func (s *stream) remember(id uint64, limit int) {
	if len(s.recent) < limit {
		s.recent = append(s.recent, id)
		return
	}
	s.recent[s.next] = id
	s.next = (s.next + 1) % limit
}

// redeliver has m come back in the caller's next batch.
func (s *stream) redeliver(m message) { s.pending = append(s.pending, m) }

// errTransient is the error of a handler call that -fail makes fail: not
// Final, so that idem releases the key and the message comes again.
var errTransient = errors.New("idembench: transient handler failure (-fail)")

// handleMessage is the handler both sides run for a message: it fails
// transiently if -fail picks this call (the id's first, second, ... call on
// this side), else marks the id as run.
func (s *stream) handleMessage(_ context.Context, m message) error {
	attempt := s.failures[m.id] + 1
	if s.fail.fails(m.id, attempt) {
		s.failures[m.id] = attempt
		s.handlerFailures++
		return errTransient
	}
	s.ran.mark(m.id)
	return nil
}

// failureChoice picks the handler calls that fail under -fail: a call fails
// when a hash of (-seed, id, attempt) falls below a threshold, so the same
// calls fail on both sides of a run, and in every run of the same seed,
// whatever the timing.
type failureChoice struct {
	seed, threshold uint64
}

// newFailureChoice returns the choice of a share of calls, from 0 (none) to
// below 1.
func newFailureChoice(seed uint64, share float64) failureChoice {
	f := failureChoice{seed: seed}
	if share > 0 {
		f.threshold = uint64(math.Ldexp(share, 64))
	}
	return f
}

// fails reports whether the attempt-th handler call for id fails (attempts
// count from 1).
func (f failureChoice) fails(id uint64, attempt uint32) bool {
	if f.threshold == 0 {
		return false
	}
	return mix64(f.seed^mix64(id^uint64(attempt)<<48)) < f.threshold
}

// mix64 is SplitMix64's finalizer: a bijection of uint64 whose output bits
// each depend on every input bit.
func mix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}
