package idem_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

// A consumer group reads a stream of orders in which the producer sent
// order-1 twice: the handler runs once for it, every entry is acknowledged.
func ExampleStreamConsumer() {
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		panic(err)
	}
	defer mr.Close()
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer client.Close()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	for _, id := range []string{"order-1", "order-2", "order-1"} {
		client.XAdd(ctx, &redis.XAddArgs{Stream: "orders", Values: map[string]any{"id": id}})
	}

	keeper, err := idem.NewRedis(client)
	if err != nil {
		panic(err)
	}
	c, err := idem.NewStreamConsumer(keeper, client, "orders", "billing", "worker-1", idem.WithLease(10*time.Second))
	if err != nil {
		panic(err)
	}
	handled := 0
	err = c.Run(ctx,
		func(m redis.XMessage) string { return m.Values["id"].(string) }, // the producer's id
		func(ctx context.Context, m redis.XMessage) error {
			fmt.Println("bill", m.Values["id"])
			if handled++; handled == 2 {
				stop() // the entries under way are settled and acknowledged
			}
			return nil
		})
	fmt.Println(err)
	pending, _ := client.XPending(context.Background(), "orders", "billing").Result()
	fmt.Println("pending:", pending.Count)
	// Output:
	// bill order-1
	// bill order-2
	// context canceled
	// pending: 0
}
