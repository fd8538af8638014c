package main

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/idemkit/idem"
)

// defaultBatch is the size of a batch of -workload batch without -batch.
const defaultBatch = 100

// consumeOp runs the caller's next batch through idem.Consume, and has the
// messages it did not acknowledge because their handler failed (or was in
// progress elsewhere) come again. Under -rate it first waits for a message
// to arrive, and makes no call if the slice ends before one does. Each message counts as one operation; the
// latency recorded is the batch's.
func (w *workload) consumeOp(ctx context.Context, wk *worker) {
	s := wk.stream
	msgs, ok := s.nextCall(ctx, w.o, wk.end)
	if !ok {
		wk.stats.done.Add(-1) // no call: runSlice counts one
		return
	}
	start := time.Now()
	scope := w.scope
	if w.o.scopePerCaller {
		scope += "/" + strconv.FormatUint(s.index, 10)
	}
	results, err := idem.Consume(ctx, w.k, scope, msgs, messageKey, s.handle)
	lat := time.Since(start)
	if err != nil {
		// Nothing was done: a failure of the run, which ends it.
		wk.stats.fail(err)
		return
	}
	for i, r := range results {
		countMessage(wk.stats, s, msgs[i], r)
	}
	wk.stats.batches++
	// runSlice counts one call as one operation on the progress line; a
	// batch is len(msgs) of them.
	wk.stats.done.Add(int64(len(msgs) - 1))
	wk.stats.record(lat)
}

// countMessage counts what Consume did with m, and has it come again if it
// was not acknowledged because its handler failed, or its key was in
// progress. Any other outcome is a failure of the run (the store failed, a
// lease was lost, the message was rejected), counted as an error and not
// delivered again, so that a run against a failing Redis ends.
func countMessage(ls *localStats, s *stream, m message, r idem.MessageResult) {
	switch {
	case r.Status == idem.MessageHandled && r.Err == nil:
		ls.executed++
	case r.Status == idem.MessageReplayed && r.Err == nil, r.Status == idem.MessageDuplicate && r.Ack:
		ls.replayed++
	case r.Status == idem.MessageRetry && r.Err == errTransient:
		// The handler's own error, as Consume answers it once the key is
		// released (joined with the store's error when releasing failed,
		// which is a failure of the run).
		ls.redelivered++
		s.redeliver(m)
	case r.Status == idem.MessageDuplicate:
		// The first message of the key was not acknowledged: neither is
		// this one, which comes again too.
		ls.redelivered++
		s.redeliver(m)
	case r.Status == idem.MessageRetry && errors.Is(r.Err, idem.ErrInProgress):
		ls.inProgress++
		s.redeliver(m)
	default:
		ls.fail(errors.Join(errors.New(m.key+": "+r.Status.String()), r.Err))
	}
}
