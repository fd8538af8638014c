package main

import (
	"context"
	"errors"
	"time"

	"github.com/idemkit/idem"
)

// defaultBatch is the size of a batch of -workload batch without -batch.
const defaultBatch = 100

// batchState is a worker's state in -workload batch: the keys it handled
// in its earlier batches, which its next batches redeliver, and the batch
// under way.
type batchState struct {
	// recent holds up to -keys ids of the worker's earlier batches, a ring
	// whose next slot is next.
	recent []uint64
	next   int
	msgs   []string
}

// consumeOp runs one batch of -batch messages through idem.Consume: a share
// -dup of them redeliver keys the worker handled in earlier batches, the
// rest are new. Each message counts as one operation; the latency recorded
// is the batch's.
func (w *workload) consumeOp(ctx context.Context, wk *worker) {
	msgs := wk.nextBatch()
	start := time.Now()
	results, err := idem.Consume(ctx, w.k, w.scope, msgs, func(s string) string { return s }, w.handleMessage)
	lat := time.Since(start)
	if err != nil {
		wk.stats.fail(err)
		return
	}
	for i, r := range results {
		wk.countMessage(msgs[i], r)
	}
	wk.stats.batches++
	// runSlice counts one call as one operation on the progress line; a
	// batch is len(msgs) of them.
	wk.stats.done.Add(int64(len(msgs) - 1))
	wk.stats.record(lat)
}

// handleMessage is the handler of a message: it records that its key ran.
func (w *workload) handleMessage(_ context.Context, key string) error {
	id, err := keyID(key)
	if err != nil {
		return idem.Final(err)
	}
	w.ran.mark(id)
	return nil
}

// nextBatch returns the keys of the worker's next batch: round(dup*N) keys
// of its earlier batches (fewer, or none, before it has handled any), the
// rest new.
func (wk *worker) nextBatch() []string {
	b, o := &wk.batch, wk.w.o
	b.msgs = b.msgs[:0]
	redelivered := 0
	if len(b.recent) > 0 {
		redelivered = int(o.dup*float64(o.batch) + 0.5)
	}
	for range redelivered {
		b.msgs = append(b.msgs, wk.key(b.recent[wk.rng.IntN(len(b.recent))]))
	}
	for len(b.msgs) < o.batch {
		id := wk.w.fresh.Add(1) - 1
		b.msgs = append(b.msgs, wk.key(id))
		b.remember(id, o.keys)
	}
	return b.msgs
}

// remember adds id to the recent keys, of which it keeps the last limit.
func (b *batchState) remember(id uint64, limit int) {
	if len(b.recent) < limit {
		b.recent = append(b.recent, id)
		return
	}
	b.recent[b.next] = id
	b.next = (b.next + 1) % limit
}

// countMessage counts what Consume did with the message key.
func (wk *worker) countMessage(key string, r idem.MessageResult) {
	switch {
	case r.Status == idem.MessageHandled && r.Err == nil:
		wk.stats.executed++
	case r.Status == idem.MessageReplayed || r.Status == idem.MessageDuplicate:
		wk.stats.replayed++
	case r.Status == idem.MessageRetry && errors.Is(r.Err, idem.ErrInProgress):
		wk.stats.inProgress++
	default:
		wk.stats.fail(errors.Join(errors.New(key+": "+r.Status.String()), r.Err))
	}
}
