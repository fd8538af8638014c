package idemwatermill_test

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemwatermill"
	"github.com/redis/go-redis/v9"
)

// An order is delivered twice. The handler charges once; the redelivery
// publishes the shipment the first run produced, the same message with the
// same UUID, so that consumers of shipments can drop the copy.
func Example() {
	mr, err := miniredis.Run() // an embedded Redis: use your own client
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	keeper, err := idem.NewRedis(redis.NewClient(&redis.Options{Addr: mr.Addr()}))
	if err != nil {
		panic(err)
	}
	once, err := idemwatermill.Middleware(keeper) // key: the message UUID
	if err != nil {
		panic(err)
	}

	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(once)
	var charges atomic.Int64
	router.AddHandler("shipping", "orders", pubsub, "shipments", pubsub,
		func(msg *message.Message) ([]*message.Message, error) {
			charges.Add(1) // the side effect
			shipment := message.NewMessage(watermill.NewUUID(), []byte("shipment for "+string(msg.Payload)))
			return []*message.Message{shipment}, nil
		})

	ctx := context.Background()
	shipments, err := pubsub.Subscribe(ctx, "shipments")
	if err != nil {
		panic(err)
	}
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	order := message.NewMessage("order-42", []byte("order 42"))
	var uuids []string
	for range 2 { // the order, then its redelivery
		if err := pubsub.Publish("orders", order.Copy()); err != nil {
			panic(err)
		}
		s := <-shipments
		s.Ack()
		fmt.Println(string(s.Payload))
		uuids = append(uuids, s.UUID)
	}
	fmt.Println("the same shipment:", uuids[0] == uuids[1])
	fmt.Println("charges:", charges.Load())
	// Output:
	// shipment for order 42
	// shipment for order 42
	// the same shipment: true
	// charges: 1
}
