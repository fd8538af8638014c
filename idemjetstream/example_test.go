package idemjetstream_test

import (
	"context"
	"errors"
	"log"
	"os/signal"
	"syscall"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemjetstream"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
)

// A consumer of the ORDERS stream that fulfils each order once, however
// often JetStream delivers it or the producer publishes it (with
// jetstream.WithMsgID(orderID)). It needs a nats-server with JetStream and
// a Redis, so it is compiled but not run: there is no Output to check
// (the tests start both servers and check the same behaviour).
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
		Durable:       "fulfil",
		AckWait:       30 * time.Second, // as the lease: after a crash, both must run out
		MaxAckPending: 4 * idemjetstream.DefaultBatch,
	})
	if err != nil {
		log.Fatal(err)
	}

	keeper, err := idem.NewRedis(redis.NewClient(&redis.Options{Addr: "localhost:6379"})) // lease 30s
	if err != nil {
		log.Fatal(err)
	}
	runner, err := idemjetstream.New(keeper, "orders", cons,
		func(ctx context.Context, m jetstream.Msg) error {
			if c, ok := idem.ClaimFromContext(ctx); ok && c.Recovered() {
				// A worker died while handling this order: see what it did
				// before doing it again.
				if done, err := alreadyFulfilled(ctx, m.Data()); done || err != nil {
					return err
				}
			}
			return fulfil(ctx, m.Data()) // nil: Ack; an error: NakWithDelay(1s)
		},
		idemjetstream.WithConcurrency(8),
	)
	if err != nil {
		log.Fatal(err) // misuse: idem.ErrInvalidConfig
	}
	// Until SIGTERM: then the handlers started finish and are settled.
	if err := runner.Run(ctx); !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

func fulfil(ctx context.Context, order []byte) error { return nil }

func alreadyFulfilled(ctx context.Context, order []byte) (bool, error) { return false, nil }
