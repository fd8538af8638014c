package main

import (
	"fmt"
	"math/rand/v2"
	"sync"
)

// event is a message of the stream: an order to fulfil.
type event struct {
	ID        string
	Partition int
	Amount    int64
}

func eventID(e event) string { return e.ID }

// broker is an in-memory stand-in for a partitioned log with consumer
// groups (Kafka, Redpanda, Kinesis): it delivers at least once. A consumer
// fetches a batch from its partition's committed offset and commits the
// offset of what it acknowledged; whatever it did not commit is delivered
// again, to it or to the partition's next owner. Ownership has a generation,
// as a Kafka group does: a commit by an owner that lost the partition is
// refused.
type broker struct {
	mu    sync.Mutex
	parts []*partition
	// delivered counts the deliveries of each log entry, by partition and
	// offset.
	delivered map[[2]int]int
	// rebalanceLeft is how many partitions may still be handed to another
	// consumer in the middle of a batch; rng decides when.
	rebalanceLeft int
	rng           *rand.Rand
	consumers     []int // the group's live consumers
	// rebalances counts the partitions handed to another consumer while a
	// batch of them was in flight.
	rebalances int
}

// partition is one log and its consumer group state.
type partition struct {
	log       []event
	committed int // the next offset to deliver
	owner     int // consumer id, -1 when none
	gen       int // bumped whenever the owner changes
	busy      bool
}

// publish fills a broker with events spread over partitions, a share of them
// published twice (the producer retried a send whose acknowledgement it
// lost), and returns it with the number of duplicates.
func publish(events, partitions int, dupRate float64, seed uint64) (*broker, int) {
	rng := rand.New(rand.NewPCG(seed, 0xb0))
	b := &broker{delivered: map[[2]int]int{}, rng: rng}
	for range partitions {
		b.parts = append(b.parts, &partition{owner: -1})
	}
	dups := 0
	for i := range events {
		e := event{ID: fmt.Sprintf("order-%05d", i), Partition: i % partitions, Amount: 100 + rng.Int64N(10_000)}
		p := b.parts[e.Partition]
		p.log = append(p.log, e)
		if rng.Float64() < dupRate {
			p.log = append(p.log, e)
			dups++
		}
	}
	return b, dups
}

// join adds a consumer to the group, and rebalances.
func (b *broker) join(id int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.consumers = append(b.consumers, id)
	b.rebalance()
}

// leave removes a consumer (it died) from the group, and rebalances.
func (b *broker) leave(id int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, c := range b.consumers {
		if c == id {
			b.consumers = append(b.consumers[:i], b.consumers[i+1:]...)
			break
		}
	}
	b.rebalance()
}

// rebalance spreads the partitions over the consumers, round robin. A
// partition that changes owner gets a new generation; if its owner was in the
// middle of a batch, the new owner is delivered that batch again at once.
func (b *broker) rebalance() {
	for i, p := range b.parts {
		owner := -1
		if len(b.consumers) > 0 {
			owner = b.consumers[i%len(b.consumers)]
		}
		if p.owner != owner {
			b.handOver(p, owner)
		}
	}
}

// handOver gives p to owner.
func (b *broker) handOver(p *partition, owner int) {
	if p.busy && owner != -1 {
		b.rebalances++
	}
	p.owner, p.busy = owner, false
	p.gen++
}

// fetched is a batch a consumer took from a partition.
type fetched struct {
	part, gen, from int
	events          []event
}

// fetch gives consumer id a batch of up to max events from a partition it
// owns that has events to deliver and is not already being handled by it;
// ok is false when there is none now. With rebalances left, the partition may
// be handed to another consumer right after the fetch, while the batch is in
// flight.
func (b *broker) fetch(id, max int) (f fetched, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, p := range b.parts {
		if p.owner != id || p.busy || p.committed == len(p.log) {
			continue
		}
		end := min(p.committed+max, len(p.log))
		f = fetched{part: i, gen: p.gen, from: p.committed, events: p.log[p.committed:end]}
		for off := f.from; off < end; off++ {
			b.delivered[[2]int{i, off}]++
		}
		p.busy = true
		b.maybeRebalance(p, id)
		return f, true
	}
	return fetched{}, false
}

// maybeRebalance hands p to another consumer, sometimes, while id handles a
// batch of it.
func (b *broker) maybeRebalance(p *partition, id int) {
	if b.rebalanceLeft == 0 || len(b.consumers) < 2 || b.rng.IntN(4) != 0 {
		return
	}
	for _, c := range b.consumers {
		if c != id {
			b.rebalanceLeft--
			b.handOver(p, c)
			return
		}
	}
}

// commit moves the committed offset of f's partition to f.from+n, the events
// of the batch acknowledged in order, if the consumer still owns the
// partition in f's generation; it reports whether it did.
func (b *broker) commit(id int, f fetched, n int) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	p := b.parts[f.part]
	if p.owner != id || p.gen != f.gen {
		return false // the partition moved on: this consumer's commit is stale
	}
	p.busy = false
	p.committed = max(p.committed, f.from+n)
	return true
}

// done reports whether every partition is committed to its end.
func (b *broker) done() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range b.parts {
		if p.committed < len(p.log) {
			return false
		}
	}
	return true
}

// counts returns the log's entries, the deliveries and the redeliveries
// (deliveries of an entry after its first).
func (b *broker) counts() (entries, deliveries, redeliveries int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range b.parts {
		entries += len(p.log)
	}
	for _, n := range b.delivered {
		deliveries += n
		redeliveries += n - 1
	}
	return entries, deliveries, redeliveries
}
