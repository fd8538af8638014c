package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

// consumerConfig sizes the consumer scenario.
type consumerConfig struct {
	Events     int           // distinct events the producer publishes
	Partitions int           // partitions of the stream
	Consumers  int           // consumer processes at any time
	Batch      int           // most events a consumer takes at once
	DupRate    float64       // share of events the producer publishes twice
	CrashRate  float64       // chance that a consumer dies in the middle of a batch
	MaxCrashes int           // crashes in all, at most
	Rebalances int           // partitions handed to another consumer in the middle of a batch
	Lease      time.Duration // of the consumers' claims
	Seed       uint64
}

// defaultConsumers finishes in a few seconds on a laptop, on miniredis.
func defaultConsumers() consumerConfig {
	return consumerConfig{
		Events: 1000, Partitions: 4, Consumers: 3, Batch: 50, DupRate: 0.05,
		CrashRate: 0.25, MaxCrashes: 3, Rebalances: 3, Lease: time.Second, Seed: 1,
	}
}

func (c consumerConfig) validate() error {
	switch {
	case c.Events < 1 || c.Partitions < 1 || c.Consumers < 1 || c.Batch < 1:
		return errors.New("-events, -partitions, -consumers and -batch must be at least 1")
	case !(c.DupRate >= 0 && c.DupRate <= 1) || !(c.CrashRate >= 0 && c.CrashRate <= 1):
		return errors.New("-dups and -crash must be in [0, 1]")
	case c.MaxCrashes < 0 || c.Rebalances < 0:
		return errors.New("-maxcrashes and -rebalances must not be negative")
	case c.Lease < 10*time.Millisecond:
		return errors.New("-lease must be at least 10ms")
	}
	return nil
}

// steps are what fulfilling an order does, each a side effect that must
// happen once: a checkpoint follows each.
var steps = [...]string{"reserve stock", "charge card", "ship parcel"}

// effects is the outside world: every side effect, by event and step.
type effects struct {
	mu sync.Mutex
	n  map[string]*[len(steps)]int
}

func newEffects() *effects { return &effects{n: map[string]*[len(steps)]int{}} }

func (e *effects) apply(id string, step int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n[id] == nil {
		e.n[id] = new([len(steps)]int)
	}
	e.n[id][step]++
}

// consumerReport is what the scenario counted.
type consumerReport struct {
	Guarded                      bool // the consumers used idem
	Events, Entries, Duplicates  int  // distinct events, log entries, entries published twice
	Deliveries, Redeliveries     int  // entries delivered, and delivered again
	Handled, Suppressed, Retried int  // handled and stored; acknowledged without running (handled before, or twice in a batch); not acknowledged
	Crashes, Rebalances          int
	Recovered, StepsSkipped      int // claims taken over from a dead consumer; steps not done again thanks to checkpoints
	Batches, BatchRoundTrips     int // batches handled by a live consumer, and their round trips, checkpoints apart
	Checkpoints                  int // checkpoints written
	StaleCommits                 int // commits refused to a consumer that had lost its partition
	Effects                      map[string][len(steps)]int
	Took                         time.Duration
}

// scenario runs the consumer scenario: the state its consumers share.
type scenario struct {
	cfg     consumerConfig
	base    *redis.Client
	prefix  string
	guarded bool
	broker  *broker
	effects *effects

	mu       sync.Mutex
	rep      consumerReport
	crashes  int
	nextID   int
	crashRng *mrand.Rand
}

// consume publishes cfg.Events events and has cfg.Consumers consumer
// processes handle them, each with its own client of base's Redis, until
// every partition is committed to its end or ctx ends. Guarded consumers use
// idem.Consume and checkpoints; unguarded ones run the handler for every
// delivery.
func consume(ctx context.Context, base *redis.Client, cfg consumerConfig, guarded bool) (*consumerReport, error) {
	b, dups := publish(cfg.Events, cfg.Partitions, cfg.DupRate, cfg.Seed)
	b.rebalanceLeft = cfg.Rebalances
	var id [4]byte
	_, _ = rand.Read(id[:])
	s := &scenario{
		cfg: cfg, base: base, guarded: guarded, broker: b, effects: newEffects(),
		prefix:   "idem-demo-consumer:" + hex.EncodeToString(id[:]) + ":",
		crashRng: mrand.New(mrand.NewPCG(cfg.Seed, 0xc4)),
	}
	s.rep = consumerReport{Events: cfg.Events, Duplicates: dups, Guarded: guarded}
	started := time.Now()
	var wg sync.WaitGroup
	first := make([]*process, cfg.Consumers)
	for i := range first {
		first[i] = s.newProcess() // the group forms before anyone fetches
	}
	for _, p := range first {
		s.start(ctx, p, &wg)
	}
	wg.Wait()
	s.rep.Took = time.Since(started)
	s.rep.Entries, s.rep.Deliveries, s.rep.Redeliveries = b.counts()
	s.rep.Rebalances = b.rebalances
	s.rep.Effects = map[string][len(steps)]int{}
	for k, v := range s.effects.n {
		s.rep.Effects[k] = *v
	}
	if !b.done() {
		return &s.rep, errors.New("the consumers did not get through the stream before -deadline")
	}
	return &s.rep, nil
}

// newProcess makes a consumer process, with a client of its own, and has it
// join the group.
func (s *scenario) newProcess() *process {
	s.mu.Lock()
	id := s.nextID
	s.nextID++
	s.mu.Unlock()
	p := &process{s: s, id: id, dead: &deadHook{}, rt: &roundTrips{}}
	p.client = clientLike(s.base)
	p.client.AddHook(p.dead) // first: a dead process's commands reach nothing, and are not counted
	p.client.AddHook(p.rt)
	s.broker.join(id)
	return p
}

// clientLike returns a new client of base's server, with base's settings
// but connections, and push notification handling, of its own.
func clientLike(base *redis.Client) *redis.Client {
	opt := *base.Options()
	opt.PushNotificationProcessor = nil // base's, once it started: each client makes its own
	return redis.NewClient(&opt)
}

// start runs p; if it dies, it leaves the group and a replacement joins, as
// an orchestrator would restart it.
func (s *scenario) start(ctx context.Context, p *process, wg *sync.WaitGroup) {
	wg.Go(func() {
		defer p.client.Close()
		if p.run(ctx) == errCrashed && ctx.Err() == nil {
			s.broker.leave(p.id)
			s.start(ctx, s.newProcess(), wg)
		}
	})
}

var errCrashed = errors.New("the consumer process died")

// process is one consumer process.
type process struct {
	s      *scenario
	id     int
	client *redis.Client
	keeper *idem.Keeper
	dead   *deadHook
	rt     *roundTrips
	// crashAt and crashStep say where this batch dies: before the event at
	// crashAt (crashStep -1) or right after checkpointing step crashStep of
	// it; crashAt -1: the batch does not die.
	crashAt, crashStep int
	// places holds the place in the batch of each event's first occurrence.
	places map[string]int
	ctx    context.Context
	cancel context.CancelFunc
}

// run takes batches until the stream is done, ctx ends, or the process dies.
func (p *process) run(ctx context.Context) error {
	s := p.s
	k, err := idem.NewRedis(p.client, idem.WithPrefix(s.prefix), idem.WithLease(s.cfg.Lease), idem.WithRetention(10*time.Minute))
	if err != nil {
		return err
	}
	p.keeper = k
	p.ctx, p.cancel = context.WithCancel(ctx)
	defer p.cancel()
	for !s.broker.done() && p.ctx.Err() == nil {
		f, ok := s.broker.fetch(p.id, s.cfg.Batch)
		if !ok {
			sleepCtx(p.ctx, 5*time.Millisecond)
			continue
		}
		p.planCrash(len(f.events))
		acked, wait, err := p.batch(f.events)
		if err != nil {
			return err
		}
		if !s.broker.commit(p.id, f, acked) {
			s.count(func(r *consumerReport) { r.StaleCommits++ })
		}
		if acked < len(f.events) {
			sleepCtx(p.ctx, wait) // some were in progress elsewhere: come back later
		}
	}
	return nil
}

// planCrash decides whether, and where, the next batch of n events dies.
func (p *process) planCrash(n int) {
	s := p.s
	s.mu.Lock()
	defer s.mu.Unlock()
	p.crashAt = -1
	if s.crashes < s.cfg.MaxCrashes && s.crashRng.Float64() < s.cfg.CrashRate {
		s.crashes++
		p.crashAt, p.crashStep = s.crashRng.IntN(n), s.crashRng.IntN(len(steps)+1)-1
	}
}

// batch handles one batch and returns how many events, from its start, may be
// acknowledged, and how long to wait before fetching again if not all.
func (p *process) batch(events []event) (acked int, wait time.Duration, err error) {
	if !p.s.guarded {
		return p.unguarded(events)
	}
	p.places = make(map[string]int, len(events))
	for i, e := range events {
		if _, ok := p.places[e.ID]; !ok {
			p.places[e.ID] = i
		}
	}
	before, checkpoints := p.rt.n.Load(), p.rt.checkpoints.Load()
	res, err := idem.Consume(p.ctx, p.keeper, "orders", events, eventID, p.handle)
	if p.dead.dead.Load() {
		return 0, 0, errCrashed // a dead process acknowledges nothing
	}
	if err != nil {
		return 0, 0, err
	}
	p.s.count(func(r *consumerReport) {
		r.Batches++
		r.BatchRoundTrips += int(p.rt.n.Load() - before - (p.rt.checkpoints.Load() - checkpoints))
	})
	for i, r := range res {
		p.s.count(func(rep *consumerReport) { tally(rep, r) })
		if r.Ack && acked == i {
			acked++
		}
	}
	return acked, retryAfter(res, acked), nil
}

// retryAfter is how long to wait before fetching again a batch whose first
// acked events were committed: the lease left on the first event held
// elsewhere, or a short pause for any other reason.
func retryAfter(res []idem.MessageResult, acked int) time.Duration {
	var ip *idem.InProgressError
	if acked < len(res) && errors.As(res[acked].Err, &ip) {
		return ip.RetryAfter
	}
	return 20 * time.Millisecond
}

// tally counts one message's result.
func tally(rep *consumerReport, r idem.MessageResult) {
	switch {
	case r.Status == idem.MessageHandled:
		rep.Handled++
	case r.Ack:
		rep.Suppressed++
	default:
		rep.Retried++
	}
}

// handle fulfils an order: its steps in turn, each followed by a checkpoint;
// the steps an earlier attempt checkpointed are not done again.
func (p *process) handle(ctx context.Context, e event) error {
	c, _ := idem.ClaimFromContext(ctx)
	if c.Recovered() {
		p.s.count(func(r *consumerReport) { r.Recovered++ })
	}
	at := p.places[e.ID]
	if at == p.crashAt && p.crashStep == -1 {
		return p.die() // after handling the batch's earlier events, before storing them
	}
	for i, step := range steps {
		if _, done := c.Checkpointed(step); done {
			p.s.count(func(r *consumerReport) { r.StepsSkipped++ })
			continue
		}
		if err := ctx.Err(); err != nil {
			return err // the lease is lost, or the process is stopping
		}
		p.s.effects.apply(e.ID, i)
		p.rt.checkpoints.Add(1)
		if err := c.Checkpoint(ctx, step, nil); err != nil {
			return err
		}
		p.s.count(func(r *consumerReport) { r.Checkpoints++ })
		if at == p.crashAt && i == p.crashStep {
			return p.die() // between two steps, right after a checkpoint
		}
	}
	return nil
}

// die kills the process: nothing it sends reaches Redis any more, and its
// batch stops.
func (p *process) die() error {
	p.dead.dead.Store(true)
	p.cancel()
	p.s.count(func(r *consumerReport) { r.Crashes++ })
	return errCrashed
}

// unguarded handles a batch without idem: every delivery runs every step.
func (p *process) unguarded(events []event) (int, time.Duration, error) {
	for i, e := range events {
		if i == p.crashAt {
			return 0, 0, p.die()
		}
		for step := range steps {
			p.s.effects.apply(e.ID, step)
		}
		p.s.count(func(r *consumerReport) { r.Handled++ })
	}
	p.s.count(func(r *consumerReport) { r.Batches++ })
	return len(events), 0, nil
}

func (s *scenario) count(f func(r *consumerReport)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(&s.rep)
}

// deadHook makes every command of a dead process fail, as a process that is
// gone sends nothing.
type deadHook struct{ dead atomic.Bool }

var errDead = errors.New("the process is dead")

func (h *deadHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *deadHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.dead.Load() {
			cmd.SetErr(errDead)
			return errDead
		}
		return next(ctx, cmd)
	}
}

func (h *deadHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.dead.Load() {
			for _, c := range cmds {
				c.SetErr(errDead)
			}
			return errDead
		}
		return next(ctx, cmds)
	}
}

// roundTrips counts a process's round trips to Redis (a command sent alone
// or a pipeline), and, apart, its checkpoints.
type roundTrips struct{ n, checkpoints atomic.Int64 }

func (h *roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !handshake(cmd) {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) > 0 && !handshake(cmds[0]) {
			h.n.Add(1)
		}
		return next(ctx, cmds)
	}
}

// handshake reports whether cmd is part of go-redis's connection set-up.
func handshake(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "client", "auth", "select", "ping":
		return true
	}
	return false
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// consumerVerdict is what the effects say: events whose steps took effect
// more than once, and events with a step that never took effect.
type consumerVerdict struct {
	Effects int
	Twice   []string
	Lost    []string
}

func checkEffects(rep *consumerReport) consumerVerdict {
	var v consumerVerdict
	for i := range rep.Events {
		id := fmt.Sprintf("order-%05d", i)
		n := rep.Effects[id]
		for step, c := range n {
			v.Effects += c
			switch {
			case c > 1:
				v.Twice = append(v.Twice, fmt.Sprintf("%s: %s took effect %d times", id, steps[step], c))
			case c == 0:
				v.Lost = append(v.Lost, fmt.Sprintf("%s: %s never took effect", id, steps[step]))
			}
		}
	}
	return v
}

func (v consumerVerdict) ok() bool { return len(v.Twice) == 0 && len(v.Lost) == 0 }
