package idem_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

type OrderPlaced struct {
	ID     string
	Amount int
}

// A queue consumer: each batch the broker delivers is claimed in one round
// trip, its new messages handled, and their completion stored in one more.
// Redeliveries and the producer's duplicates are acknowledged without
// running the handler again.
func ExampleConsume() {
	client, done := newClient()
	defer done()
	keeper, err := idem.NewRedis(client)
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	id := func(m OrderPlaced) string { return m.ID }
	handle := func(ctx context.Context, m OrderPlaced) error {
		fmt.Println("  charging", m.ID, m.Amount)
		return nil
	}

	// The producer sent o-1 twice; the broker delivers the batch, then
	// delivers it again (the consumer restarted before acknowledging).
	batch := []OrderPlaced{{"o-1", 100}, {"o-2", 250}, {"o-1", 100}}
	for delivery := 1; delivery <= 2; delivery++ {
		fmt.Println("delivery", delivery)
		results, err := idem.Consume(ctx, keeper, "orders", batch, id, handle)
		if err != nil {
			panic(err)
		}
		for i, r := range results {
			fmt.Printf("  %s: %s, ack %v\n", batch[i].ID, r.Status, r.Ack)
		}
	}
	// Output:
	// delivery 1
	//   charging o-1 100
	//   charging o-2 250
	//   o-1: handled, ack true
	//   o-2: handled, ack true
	//   o-1: duplicate, ack true
	// delivery 2
	//   o-1: replayed, ack true
	//   o-2: replayed, ack true
	//   o-1: duplicate, ack true
}

// Recovery points: an order is charged, then shipped. The first attempt dies
// after the charge; the attempt that takes the order over finds the charge's
// checkpoint and goes on with shipping, which fails, so it releases the key;
// the retry continues from the same checkpoint. The card is charged once.
func ExampleClaim_Checkpoint() {
	// An embedded Redis whose clock the example moves.
	redisServer, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer redisServer.Close()
	now := time.Now()
	redisServer.SetTime(now)
	client := redis.NewClient(&redis.Options{Addr: redisServer.Addr()})
	defer client.Close()
	keeper, err := idem.NewRedis(client) // lease 30s
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	shippingDown := true
	fulfil := func(ctx context.Context, c *idem.Claim, dies bool) (string, error) {
		charge, charged := c.Checkpointed("charged")
		if !charged {
			fmt.Println("  charging the card")
			charge = []byte("ch_1")
			if err := c.Checkpoint(ctx, "charged", charge); err != nil {
				return "", err
			}
		}
		if dies {
			return "", errors.New("the process died")
		}
		if shippingDown {
			shippingDown = false
			return "", errors.New("shipping service unavailable")
		}
		fmt.Println("  shipping, paid by", string(charge))
		return "shipped", nil
	}

	fmt.Println("attempt 1")
	out, err := keeper.Begin(ctx, "shop", "order-7")
	if err != nil {
		panic(err)
	}
	_, err = fulfil(ctx, out.Claim, true)
	fmt.Println("  ->", err)                  // no Complete, no Release: the process is gone
	redisServer.SetTime(now.Add(time.Minute)) // its lease runs out

	for attempt := 2; attempt <= 3; attempt++ {
		fmt.Println("attempt", attempt)
		v, err := idem.Do(ctx, keeper, "shop", "order-7", func(ctx context.Context) (string, error) {
			c, _ := idem.ClaimFromContext(ctx)
			_, charged := c.Checkpointed("charged")
			fmt.Printf("  recovered %v, charged %v\n", c.Recovered(), charged)
			return fulfil(ctx, c, false)
		})
		fmt.Printf("  -> %q, %v\n", v, err)
	}
	// Output:
	// attempt 1
	//   charging the card
	//   -> the process died
	// attempt 2
	//   recovered true, charged true
	//   -> "", shipping service unavailable
	// attempt 3
	//   recovered false, charged true
	//   shipping, paid by ch_1
	//   -> "shipped", <nil>
}
