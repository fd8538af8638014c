package idemjetstream

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// fetch returns the next batch: the messages waiting, up to the batch
// size; or, when none is, the first to come within idleWait with those
// waiting behind it. When ctx ends while it waits, it returns what came,
// without error. After a wait that brought nothing it checks that the
// consumer still exists.
func (r *Runner) fetch(ctx context.Context) ([]jetstream.Msg, error) {
	msgs, err := collect(r.consumer.FetchNoWait(r.s.batch))
	if len(msgs) > 0 || err != nil {
		return msgs, err
	}
	wctx, cancel := context.WithTimeout(ctx, idleWait)
	msgs, err = collect(r.consumer.Fetch(1, jetstream.FetchContext(wctx)))
	cancel()
	if ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) {
		err = nil
	}
	if len(msgs) == 0 && err == nil && ctx.Err() == nil {
		return nil, r.stillThere(ctx)
	}
	if len(msgs) == 0 || err != nil || r.s.batch == 1 || ctx.Err() != nil {
		return msgs, err
	}
	more, err := collect(r.consumer.FetchNoWait(r.s.batch - len(msgs)))
	return append(msgs, more...), err
}

// stillThere returns jetstream.ErrConsumerNotFound when the consumer has
// been deleted, nil otherwise: a pull request to a deleted consumer is
// answered by nothing, not by an error, unless it was waiting when the
// consumer went. The consumer's info it reads is reported as its backlog.
func (r *Runner) stillThere(ctx context.Context) error {
	started := time.Now()
	ictx, cancel := context.WithTimeout(ctx, idleWait)
	defer cancel()
	info, err := r.consumer.Info(ictx)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		return err
	}
	if err == nil {
		r.observeBacklog(ctx, info, time.Since(started))
	}
	return nil
}

// collect returns the messages of a Fetch, once it has ended.
func collect(b jetstream.MessageBatch, err error) (msgs []jetstream.Msg, _ error) {
	if err != nil {
		return nil, err
	}
	for m := range b.Messages() {
		msgs = append(msgs, m)
	}
	return msgs, b.Error()
}
