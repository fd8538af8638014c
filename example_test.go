package idem_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

// newClient returns a client of an embedded miniredis, so that the examples
// run without a Redis server. Use your own *redis.Client (or ClusterClient,
// Ring, failover client) in production.
func newClient() (*redis.Client, func()) {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	return c, func() { c.Close(); m.Close() }
}

type Receipt struct {
	ChargeID string
	Amount   int
}

func ExampleDo() {
	client, done := newClient()
	defer done()
	keeper, err := idem.NewRedis(client)
	if err != nil {
		panic(err)
	}
	ctx := context.Background()

	charge := func(ctx context.Context) (Receipt, error) {
		fmt.Println("charging the card")
		return Receipt{ChargeID: "ch_1", Amount: 4200}, nil
	}
	// The client sends the same payment twice: it runs once.
	for i := 0; i < 2; i++ {
		r, err := idem.Do(ctx, keeper, "tenant-42", "order-1001", charge)
		fmt.Println(r, err)
	}
	// Output:
	// charging the card
	// {ch_1 4200} <nil>
	// {ch_1 4200} <nil>
}

func ExampleDo_fingerprint() {
	client, done := newClient()
	defer done()
	keeper, _ := idem.NewRedis(client)
	ctx := context.Background()

	pay := func(body string) error {
		_, err := idem.Do(ctx, keeper, "tenant-42", "order-1002",
			func(ctx context.Context) (string, error) { return "paid " + body, nil },
			idem.WithFingerprint([]byte(body)))
		return err
	}
	fmt.Println(pay("amount=10"))
	fmt.Println(pay("amount=10"))
	fmt.Println(errors.Is(pay("amount=99"), idem.ErrMismatch))
	// Output:
	// <nil>
	// <nil>
	// true
}

func ExampleFinal() {
	client, done := newClient()
	defer done()
	keeper, _ := idem.NewRedis(client)
	ctx := context.Background()

	declined := func(ctx context.Context) (Receipt, error) {
		fmt.Println("asking the bank")
		return Receipt{}, idem.Final(errors.New("card declined"))
	}
	for i := 0; i < 2; i++ {
		_, err := idem.Do(ctx, keeper, "tenant-42", "order-1003", declined)
		var final *idem.FinalError
		if errors.As(err, &final) {
			fmt.Println(err, "replayed:", final.Replayed)
		}
	}
	// Output:
	// asking the bank
	// card declined replayed: false
	// card declined replayed: true
}

func ExampleKeeper_Begin() {
	client, done := newClient()
	defer done()
	keeper, _ := idem.NewRedis(client)
	ctx := context.Background()

	handle := func(messageID string) {
		out, err := keeper.Begin(ctx, "orders-queue", messageID)
		switch {
		case errors.Is(err, idem.ErrInProgress):
			fmt.Println(messageID, "is being handled elsewhere: redeliver later")
			return
		case err != nil:
			fmt.Println("store unavailable, do not ack:", err)
			return
		case out.Replayed:
			fmt.Printf("%s already handled: %s\n", messageID, out.Value)
			return
		}
		// out.Claim.Token() is the fencing token to pass to downstream writes.
		fmt.Println(messageID, "handled now, attempt", out.Claim.Attempt())
		if err := out.Claim.Complete(ctx, []byte("shipped"), 0); err != nil {
			fmt.Println("result not stored:", err)
		}
	}
	handle("msg-1")
	handle("msg-1")
	// Output:
	// msg-1 handled now, attempt 1
	// msg-1 already handled: shipped
}
