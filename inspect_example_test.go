package idem_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/idem"
)

// An operator looks at a key a customer asks about, and lets the customer
// use it again.
func ExampleKeeper_Inspect() {
	client, done := newClient()
	defer done()
	keeper, _ := idem.NewRedis(client)
	ctx := context.Background()
	_, _ = idem.Do(ctx, keeper, "tenant-42", "order-1001", func(ctx context.Context) (Receipt, error) {
		return Receipt{ChargeID: "ch_1", Amount: 4200}, nil
	})

	rec, err := keeper.Inspect(ctx, "tenant-42", "order-1001")
	if err != nil {
		panic(err)
	}
	fmt.Println(rec.State, "attempt", rec.Attempt, "recovered", rec.Recovered)
	fmt.Println("result:", rec.Stored, rec.Size, "bytes")

	gone, _ := keeper.Forget(ctx, "tenant-42", "order-1001", false)
	fmt.Println("forgot a", gone.State, "record")
	rec, _ = keeper.Inspect(ctx, "tenant-42", "order-1001")
	fmt.Println(rec.State)
	// Output:
	// completed attempt 1 recovered false
	// result: value 25 bytes
	// forgot a completed record
	// absent
}

// Forget refuses a key whose operation is running, unless forced; a forced
// Forget fences the running attempt off.
func ExampleKeeper_Forget() {
	client, done := newClient()
	defer done()
	keeper, _ := idem.NewRedis(client)
	ctx := context.Background()
	out, _ := keeper.Begin(ctx, "tenant-42", "order-1002") // running elsewhere

	_, err := keeper.Forget(ctx, "tenant-42", "order-1002", false)
	fmt.Println(errors.Is(err, idem.ErrInProgress))
	_, err = keeper.Forget(ctx, "tenant-42", "order-1002", true)
	fmt.Println(err)
	err = out.Claim.Complete(ctx, []byte("late"), 0)
	fmt.Println(errors.Is(err, idem.ErrLeaseLost))
	// Output:
	// true
	// <nil>
	// true
}

// Scan lists the operations in progress, or abandoned by a crashed process.
func ExampleKeeper_Scan() {
	client, done := newClient()
	defer done()
	keeper, _ := idem.NewRedis(client)
	ctx := context.Background()
	_, _ = keeper.Begin(ctx, "tenant-42", "order-1003")

	for rec, err := range keeper.Scan(ctx, idem.ScanOptions{State: idem.StatePending}) {
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Println(rec.State, "attempt", rec.Attempt, "lease running:", rec.LeaseLeft > 0)
	}
	// Output:
	// pending attempt 1 lease running: true
}
