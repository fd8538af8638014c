package idemkafka

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/integration"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Runner consumes Kafka topics as a member of a consumer group with
// idem.Consume: it polls records, handles each at most once per key, and
// commits each partition's offset only past records whose outcome is
// stored in Redis or that were dead-lettered. Make one with New; its zero
// value is not usable, and Run runs once.
type Runner struct {
	keeper *idem.Keeper
	scope  string
	handle func(ctx context.Context, rec *kgo.Record) error
	s      settings
	lease  time.Duration // the claims' lease: s.lease or the Keeper's
	client *kgo.Client
	ran    atomic.Bool // Run was called
	// fail ends Run with its cause, from a partition's goroutine (Consume
	// refusing a batch: misuse). Set by Run before any such goroutine
	// starts.
	fail context.CancelCauseFunc
	// workers counts the partitions' goroutines.
	workers sync.WaitGroup
	// backlogAt is when the backlog is next to be reported (Unix
	// nanoseconds; 0: at the first poll); read and written by Run's
	// goroutine only.
	backlogAt int64

	mu sync.Mutex
	// parts are the partitions that have records, or a goroutine, here:
	// one is added by Run for a partition's records and removed by the
	// rebalance callbacks, once its goroutine has ended. Guarded by mu.
	parts map[topicPartition]*partition
	// held is how many records the partitions hold, polled and not yet
	// settled or dropped. Guarded by mu.
	held int
	// room is signalled (never blocks) when held goes down.
	room chan struct{}
	// released, when set (by tests), is called by release once it has
	// stopped its partitions, before it waits for them.
	released func(lost bool)
}

// topicPartition names a partition.
type topicPartition struct {
	topic     string
	partition int32
}

// String names tp as a backlog report does: "orders/3".
func (tp topicPartition) String() string {
	return tp.topic + "/" + strconv.Itoa(int(tp.partition))
}

// New returns a Runner that joins a consumer group with a client made of
// opts and handles each record with handle, keyed by Position (or WithKey)
// under scope, on keeper. opts must name the group (kgo.ConsumerGroup) and
// its topics (kgo.ConsumeTopics or kgo.ConsumeRegex), beside the brokers
// (kgo.SeedBrokers); New adds kgo.DisableAutoCommit,
// kgo.BlockRebalanceOnPoll (held only while a poll's records are handed to
// their partitions) and its own OnPartitionsRevoked and OnPartitionsLost,
// which replace any in opts. The
// Runner commits itself (Run's doc says when); Client returns the client.
//
// One scope holds the keys of every topic and partition the Runner
// consumes: the same key in two of them is one operation (a producer's
// duplicate that landed elsewhere is answered as handled before). Position,
// the default key, names the topic and partition, so it never meets
// another record's.
//
// handle must not commit. Its context carries the idem.Claim
// (idem.ClaimFromContext); check Claim.Recovered to reconcile the side
// effects of an attempt that died.
//
// The error wraps idem.ErrInvalidConfig when keeper or handle is nil, opts
// name no consumer group or are refused by kgo.NewClient, or an option
// refuses its setting.
func New(keeper *idem.Keeper, scope string, opts []kgo.Opt, handle func(ctx context.Context, rec *kgo.Record) error, options ...Option) (*Runner, error) {
	if keeper == nil || handle == nil {
		return nil, fmt.Errorf("%w: idemkafka.New needs a Keeper and a handler", idem.ErrInvalidConfig)
	}
	r := &Runner{
		keeper: keeper, scope: scope, handle: handle, s: defaultSettings(),
		parts: make(map[topicPartition]*partition), room: make(chan struct{}, 1),
	}
	for _, o := range options {
		if o == nil {
			continue
		}
		if err := o(&r.s); err != nil {
			return nil, err
		}
	}
	r.lease = r.s.lease
	if r.lease == 0 {
		r.lease = integration.Lease(keeper)
	}
	all := append(append([]kgo.Opt(nil), opts...),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsRevoked(func(_ context.Context, _ *kgo.Client, m map[string][]int32) { r.release(m, false) }),
		kgo.OnPartitionsLost(func(_ context.Context, _ *kgo.Client, m map[string][]int32) { r.release(m, true) }),
	)
	cl, err := kgo.NewClient(all...)
	if err != nil {
		return nil, fmt.Errorf("%w: idemkafka.New: %w", idem.ErrInvalidConfig, err)
	}
	if g, _ := cl.OptValue(kgo.ConsumerGroup).(string); g == "" {
		cl.Close()
		return nil, fmt.Errorf("%w: idemkafka.New: the client's options name no consumer group (kgo.ConsumerGroup)", idem.ErrInvalidConfig)
	}
	r.client = cl
	return r, nil
}

// Client returns the Runner's Kafka client, for producing (a reply, a
// dead letter of one's own). Run closes it when it returns; do not poll
// or commit with it.
func (r *Runner) Client() *kgo.Client { return r.client }

// Run polls and handles records until ctx is done, then leaves the group,
// closes the client and returns ctx's error.
//
// Each partition the Runner is given is handled on a goroutine of its own,
// in its order: up to WithBatch of its records polled are handed to one
// idem.Consume call (the Keeper's Observer is told of every claim,
// completion, release and renewal), and then its records are settled in
// order:
//
//   - Ack true (handled, handled before, a repeat of one that was): settled.
//   - MessageRejected (an invalid key, another fingerprint, a corrupt
//     record): dead-lettered (WithDeadLetter, WithDeadLetterTopic), then
//     settled.
//   - MessageRetry whose handler failed or panicked for the
//     WithMaxDeliveries-th time: dead-lettered with a reason that wraps
//     ErrMaxDeliveries, then settled.
//   - MessageRetry otherwise (a handler's error, another consumer holding
//     the key, Redis unreachable, the lease lost): not settled.
//
// The partition's offset is then committed (one synchronous OffsetCommit)
// past the last record of the unbroken run of settled ones from its start:
// never past a record not settled. The records from the first one not
// settled on are tried again, after the retry delay (WithRetryDelay), or
// the time left on another holder's lease: those handled meanwhile are
// answered from their stored outcomes, their handlers not run again. A
// record that keeps failing thus holds up its partition until it is
// dead-lettered; other partitions go on. A commit that fails is reported
// to the error handler; the next one covers its records.
//
// Redis unreachable does not stop Run: a batch none of whose claims
// reached Redis runs no handler, is reported to the error handler, and is
// tried again after the retry delay, without counting as a delivery, for
// as long as the outage lasts. Run holds at most WithMaxInFlight records,
// and polls no more until some are settled.
//
// On a rebalance, the partitions revoked stop starting handlers; the
// handlers running finish, their outcomes are stored and the offsets
// committed before the partitions go to another member (the
// OnPartitionsRevoked callback waits for it). A partition lost (the member
// was thrown out of the group: a session timeout) stops the same way, but
// nothing of it is committed: its next owner reads it from the last
// commit, and answers what was stored from Redis.
//
// When ctx is done Run stops polling; the handlers that have started run to
// the end, their contexts not cancelled, and are stored and committed as
// above; those not started do not start (their keys are released). Then
// Run leaves the group and closes the client. A handler that never returns
// keeps Run from returning.
//
// A handler's panic is a failure of its record, not of Run: it is
// recovered, and its record settled as for a handler's error (an error
// that holds the panic's value and stack), counting as a delivery.
//
// Run returns ctx's error once ctx is done; Consume's error, wrapping
// idem.ErrInvalidConfig, when it refuses a batch (misuse); an error when
// the client was closed or Run was called before. It reports to the
// Keeper's Observer, beside the steps of idem.Consume, each record
// dead-lettered (idem.StepStream, idem.ResultDeadLettered, Err the
// reason), and the backlog (idem.StepBacklog) of each partition it holds
// records of, ID naming it ("orders/3"): at the first poll that brings
// records, then at most every 10 seconds (backlogEvery), from the polls'
// own answers, at no request. Lag is the records Kafka held past the
// partition's last poll that brought records of it (its high watermark
// less the next offset), Pending the records of it the Runner holds not
// settled.
func (r *Runner) Run(ctx context.Context) error {
	if !r.ran.CompareAndSwap(false, true) {
		return fmt.Errorf("%w: idemkafka: Run was called before (a Runner runs once)", idem.ErrInvalidConfig)
	}
	rctx, cancel := context.WithCancelCause(ctx)
	r.fail = cancel
	err := r.poll(rctx)
	cancel(err)
	r.workers.Wait()
	r.client.Close()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return context.Cause(rctx)
}

// poll polls records and hands them to their partitions until ctx is done
// (Run's, or a partition's goroutine failed) or the client is closed.
func (r *Runner) poll(ctx context.Context) error {
	for {
		room := r.waitRoom(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		fetches := r.client.PollRecords(ctx, room)
		if fetches.IsClientClosed() {
			r.client.AllowRebalance()
			return errors.New("idemkafka: the client was closed")
		}
		failed := false
		fetches.EachError(func(topic string, partition int32, err error) {
			if ctx.Err() == nil {
				failed = true
				r.report(fmt.Errorf("idemkafka: poll %s/%d: %w", topic, partition, err))
			}
		})
		r.dispatch(ctx, fetches)
		r.client.AllowRebalance()
		if failed && fetches.NumRecords() == 0 && !sleep(ctx, r.s.retryDelay) {
			return ctx.Err()
		}
	}
}

// waitRoom waits until the Runner holds fewer than WithMaxInFlight records,
// or ctx is done, and returns how many more it may take.
func (r *Runner) waitRoom(ctx context.Context) int {
	for {
		r.mu.Lock()
		room := r.s.maxInFlight - r.held
		r.mu.Unlock()
		if room > 0 {
			return room
		}
		select {
		case <-r.room:
		case <-ctx.Done():
			return 0
		}
	}
}

// dispatch hands the records of fetches to their partitions, starting the
// goroutine of a partition that has none. It runs while the client holds
// rebalances back (BlockRebalanceOnPoll), so every record belongs to a
// partition the Runner owns.
func (r *Runner) dispatch(ctx context.Context, fetches kgo.Fetches) {
	r.mu.Lock()
	fetches.EachPartition(func(p kgo.FetchTopicPartition) {
		if len(p.Records) == 0 {
			return
		}
		tp := topicPartition{p.Topic, p.Partition}
		part := r.parts[tp]
		if part == nil {
			part = newPartition(ctx, tp)
			r.parts[tp] = part
			r.workers.Go(func() { r.work(ctx, part) })
		}
		part.lag = max(p.HighWatermark-p.Records[len(p.Records)-1].Offset-1, 0)
		for _, rec := range p.Records {
			part.queue = append(part.queue, &pending{rec: rec})
		}
		r.held += len(p.Records)
		part.signal()
	})
	r.mu.Unlock()
	r.observeBacklog(ctx)
}

// release stops the partitions in m, revoked (lost false) or lost, and
// waits for their goroutines to end: the handlers running finish and are
// stored; a revoked partition commits what it settled, a lost one
// nothing. It is the client's rebalance callback.
func (r *Runner) release(m map[string][]int32, lost bool) {
	var gone []*partition
	r.mu.Lock()
	for topic, ps := range m {
		for _, p := range ps {
			tp := topicPartition{topic, p}
			if part := r.parts[tp]; part != nil {
				if lost {
					part.lost.Store(true)
				}
				part.cancel()
				delete(r.parts, tp)
				gone = append(gone, part)
			}
		}
	}
	r.mu.Unlock()
	if r.released != nil {
		r.released(lost)
	}
	for _, part := range gone {
		<-part.done
	}
}

// report gives err to the error handler, if there is one.
func (r *Runner) report(err error) {
	if r.s.onError != nil {
		r.s.onError(err)
	}
}

// observer returns the Keeper's Observer, nil when there is none.
func (r *Runner) observer() idem.Observer { return integration.Observer(r.keeper) }

// backlogEvery is how often, at most, Run reports the backlog
// (idem.StepBacklog).
const backlogEvery = 10 * time.Second

// observeBacklog tells the Keeper's Observer, if any and when due, the
// backlog of each partition the Runner holds records of, in order; it
// waits for the first poll that brings records to tell anything.
func (r *Runner) observeBacklog(ctx context.Context) {
	o := r.observer()
	now := time.Now()
	if o == nil || now.UnixNano() < r.backlogAt {
		return
	}
	type backlog struct {
		tp           topicPartition
		lag, pending int64
	}
	r.mu.Lock()
	bs := make([]backlog, 0, len(r.parts))
	for tp, p := range r.parts {
		bs = append(bs, backlog{tp, p.lag, int64(len(p.queue))})
	}
	r.mu.Unlock()
	if len(bs) == 0 {
		return
	}
	r.backlogAt = now.Add(backlogEvery).UnixNano()
	slices.SortFunc(bs, func(a, b backlog) int {
		return cmp.Or(cmp.Compare(a.tp.topic, b.tp.topic), cmp.Compare(a.tp.partition, b.tp.partition))
	})
	for _, b := range bs {
		o.Observe(ctx, idem.Event{Step: idem.StepBacklog, Result: idem.ResultDone, Scope: r.scope,
			ID: b.tp.String(), Lag: b.lag, Pending: b.pending})
	}
}

// sleep waits d, or until ctx is done; it tells whether ctx is still
// alive.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
