// Package idemjetstream runs a NATS JetStream pull consumer through
// idem.Consume, so that each message is handled at most once per key however
// often JetStream delivers it or the producer sends it.
//
//	js, _ := jetstream.New(nc)
//	cons, _ := js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
//		Durable: "fulfil", AckWait: 30 * time.Second, MaxAckPending: 2000,
//	})
//	runner, err := idemjetstream.New(keeper, "orders", cons,
//		func(ctx context.Context, m jetstream.Msg) error { return fulfil(ctx, m.Data()) },
//		idemjetstream.WithConcurrency(8),
//	)
//	if err != nil { ... } // misuse: idem.ErrInvalidConfig
//	err = runner.Run(ctx) // until ctx is done: then the batch in hand is finished and settled
//
// A message's key is its Nats-Msg-Id header (jetstream.WithMsgID when
// publishing), or what WithKey returns. JetStream drops a duplicate published
// within the stream's Duplicates window; idem answers one published later,
// and every redelivery, as handled before, within the Keeper's marker
// retention (by default 7 days, idem.DefaultMarkerRetention). A message
// published without Nats-Msg-Id is keyed by its stream sequence: its
// redeliveries are handled once, but a producer's second publish of it is
// handled again; WithKey(MsgIDRequired) rejects such a message instead.
//
// Each batch (Fetch, by default DefaultBatch: 500 messages) is claimed in one
// round trip to Redis and settled in one more when its handlers are quick;
// then each message is acknowledged (Ack), redelivered later (NakWithDelay)
// or terminated (Term), as Run's doc says. A message terminated (rejected by
// idem, or not handled at its last delivery, the consumer's MaxDeliver) is
// first given to WithDeadLetter's hook (PublishDeadLetter publishes it to a
// subject, with its reason, stream sequence and delivery count), or, without
// one, reported to WithErrorHandler. A runner that dies mid-batch leaves its
// claims pending and its messages unacknowledged: JetStream redelivers them
// after the consumer's AckWait, and another runner handles them once the
// lease has run out too, its handlers told Recovered. Set the AckWait equal
// to the lease (both 30s by default), or a little longer: the longer of the
// two bounds how long a crash delays a message, and New refuses an AckWait
// shorter than the lease, which would redeliver a message while its claim is
// alive.
package idemjetstream
