// Package idemkafka runs a Kafka consumer group member through
// idem.Consume, on franz-go, so that each record is handled at most once per
// key however often Kafka delivers it, and commits each partition's offset
// only past records whose outcome is stored.
//
//	runner, err := idemkafka.New(keeper, "orders", []kgo.Opt{
//		kgo.SeedBrokers("localhost:9092"),
//		kgo.ConsumerGroup("fulfil"),
//		kgo.ConsumeTopics("orders"),
//	}, func(ctx context.Context, rec *kgo.Record) error { return fulfil(ctx, rec.Value) },
//		idemkafka.WithDeadLetterTopic("orders.dead"),
//	)
//	if err != nil { ... } // misuse: idem.ErrInvalidConfig
//	err = runner.Run(ctx) // until ctx is done: the handlers running finish, are stored and committed
//
// Kafka redelivers in bursts: a rebalance, a restart or a commit that did
// not land gives a member again every record after its partition's last
// commit. Each partition's records go to idem.Consume in batches (500 by
// default), claimed in one round trip to Redis and stored in one more when
// the handlers are quick: a record handled before is answered from its
// stored outcome, its handler not run again.
//
// A record's key is its place in Kafka (Position: topic, partition, offset,
// timestamp) unless WithKey says otherwise: every redelivery is caught, but
// a message the producer sends twice is two records, handled twice. Give
// each message an id in a header and key by it (WithKey(Header("id"))) to
// catch those too, within the Keeper's marker retention (7 days
// (DefaultMarkerRetention) by default). A record's Kafka key usually names an entity shared by many
// messages; RecordKey keys by it only when it is the message's own id.
//
// A partition's offset is committed past a record only once its outcome is
// stored in Redis, or it was dead-lettered (rejected by idem, or its
// handler failed WithMaxDeliveries times): a record whose handler failed is
// tried again, after the retry delay, and its partition waits for it. On a
// rebalance the partitions revoked stop starting handlers, and the running
// ones finish, are stored and committed before the partitions go; a lost
// partition commits nothing more. A runner that dies leaves its claims
// pending: the partition's next owner handles its records again once the
// lease has run out (30s (DefaultLease) by default), told Recovered.
package idemkafka
