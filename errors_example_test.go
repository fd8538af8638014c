package idem_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/idem"
)

// A declined card is the payment's answer: stored with its code and details,
// so that a retry, in this process or another, can map it (to an HTTP status,
// a gRPC code) as the first call did.
func ExampleFinalCode() {
	client, done := newClient()
	defer done()
	keeper, _ := idem.NewRedis(client)
	ctx := context.Background()

	charge := func(ctx context.Context) (Receipt, error) {
		fmt.Println("asking the bank")
		return Receipt{}, idem.FinalCode(errors.New("card declined"), "card_declined",
			map[string]string{"decline_code": "insufficient_funds"})
	}
	for i := 0; i < 2; i++ {
		_, err := idem.Do(ctx, keeper, "tenant-42", "order-1004", charge)
		var final *idem.FinalError
		if errors.As(err, &final) {
			fmt.Printf("%s: %v %v replayed: %t\n", final.Code, err, final.Details, final.Replayed)
		}
	}
	// Output:
	// asking the bank
	// card_declined: card declined map[decline_code:insufficient_funds] replayed: false
	// card_declined: card declined map[decline_code:insufficient_funds] replayed: true
}
