package idem_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/idem"
)

// The process that held a claim was killed after it charged the card; its
// lease would block the key until it ran out. The operator, shown the
// record, abandons the claim by the id and token shown: the retry takes the
// key over at once, told it is recovered, with the checkpoint.
func ExampleKeeper_AbandonRecord() {
	client, done := newClient()
	defer done()
	keeper, _ := idem.NewRedis(client)
	ctx := context.Background()
	out, _ := keeper.Begin(ctx, "tenant-42", "order-1004")
	_ = out.Claim.Checkpoint(ctx, "charged", []byte("ch_1"))
	// The process dies here.

	_, err := keeper.Begin(ctx, "tenant-42", "order-1004")
	fmt.Println("retry:", errors.Is(err, idem.ErrInProgress))

	shown, _ := keeper.Inspect(ctx, "tenant-42", "order-1004")
	fmt.Println("shown:", shown.State, "attempt", shown.Attempt, "checkpoints", shown.Checkpoints)
	rec, _ := keeper.AbandonRecord(ctx, shown.ID, shown.Token)
	fmt.Println("abandoned:", rec.Token == shown.Token && rec.LeaseLeft <= 0)

	retry, _ := keeper.Begin(ctx, "tenant-42", "order-1004")
	charge, _ := retry.Claim.Checkpointed("charged")
	fmt.Println("retry: recovered", retry.Claim.Recovered(), "attempt", retry.Claim.Attempt(), "charged", string(charge))
	// Output:
	// retry: true
	// shown: pending attempt 1 checkpoints [{charged 4}]
	// abandoned: true
	// retry: recovered true attempt 2 charged ch_1
}

// ForgetRecord removes a record only if it is the one the operator was
// shown: a claim made since is left alone.
func ExampleKeeper_ForgetRecord() {
	client, done := newClient()
	defer done()
	keeper, _ := idem.NewRedis(client)
	ctx := context.Background()
	_, _ = idem.Do(ctx, keeper, "tenant-42", "order-1005", func(ctx context.Context) (string, error) { return "paid", nil })
	shown, _ := keeper.Inspect(ctx, "tenant-42", "order-1005")

	gone, _ := keeper.ForgetRecord(ctx, shown.ID, shown.Token, false)
	fmt.Println("forgot:", gone.State)
	_, _ = keeper.Begin(ctx, "tenant-42", "order-1005") // the customer uses the key again

	again, err := keeper.ForgetRecord(ctx, shown.ID, shown.Token, true) // confirmed late, or resent
	fmt.Println("again:", again.State, err)
	now, _ := keeper.Inspect(ctx, "tenant-42", "order-1005")
	fmt.Println("now:", now.State)
	// Output:
	// forgot: completed
	// again: absent <nil>
	// now: pending
}
