package idemkafka_test

import (
	"context"
	"fmt"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemkafka"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// A consumer of a topic whose producer sends each order with an "id"
// header, and sends order-1 twice: the second copy is answered as handled
// before, its handler not run. Kafka runs in the process (kfake) and Redis
// is miniredis; a service gives its brokers and its Redis instead.
func Example() {
	kafka, err := kfake.NewCluster(kfake.SeedTopics(1, "orders"))
	if err != nil {
		panic(err)
	}
	defer kafka.Close()
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		panic(err)
	}
	defer mr.Close()
	keeper, err := idem.NewRedis(redis.NewClient(&redis.Options{Addr: mr.Addr()}))
	if err != nil {
		panic(err)
	}

	producer, err := kgo.NewClient(kgo.SeedBrokers(kafka.ListenAddrs()...), kgo.DefaultProduceTopic("orders"))
	if err != nil {
		panic(err)
	}
	defer producer.Close()
	for _, id := range []string{"order-1", "order-2", "order-1", "order-3"} {
		rec := &kgo.Record{Value: []byte(id), Headers: []kgo.RecordHeader{{Key: "id", Value: []byte(id)}}}
		if err := producer.ProduceSync(context.Background(), rec).FirstErr(); err != nil {
			panic(err)
		}
	}

	ctx, stop := context.WithCancel(context.Background())
	runner, err := idemkafka.New(keeper, "orders", []kgo.Opt{
		kgo.SeedBrokers(kafka.ListenAddrs()...),
		kgo.ConsumerGroup("fulfil"),
		kgo.ConsumeTopics("orders"),
	}, func(ctx context.Context, rec *kgo.Record) error {
		fmt.Println("fulfil", string(rec.Value))
		if string(rec.Value) == "order-3" {
			stop() // the example ends here; a service runs until it is told to stop
		}
		return nil
	}, idemkafka.WithKey(idemkafka.Header("id")))
	if err != nil {
		panic(err)
	}
	fmt.Println(runner.Run(ctx))
	// Output:
	// fulfil order-1
	// fulfil order-2
	// fulfil order-3
	// context canceled
}
