package idemgrpc_test

import (
	"context"
	"fmt"
	"net"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// A payments service guarded by the server interceptor, called through the
// client interceptor: the retried call gets the first answer, and the card
// is charged once.
func Example() {
	mr, _ := miniredis.Run() // any Redis; miniredis keeps the example self-contained
	defer mr.Close()
	keeper, _ := idem.NewRedis(redis.NewClient(&redis.Options{Addr: mr.Addr()}))

	guard, err := idemgrpc.UnaryServerInterceptor(keeper)
	if err != nil {
		panic(err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(guard))
	charges := 0
	registerService(srv, paymentsService, func(ctx context.Context, _ string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		claim, _ := idem.ClaimFromContext(ctx)
		charges++ // charge the card, passing claim.Token() on as a fencing token
		return wrapperspb.String(fmt.Sprintf("charged %s: ch_%d, attempt %d", req.GetValue(), charges, claim.Attempt())), nil
	}, "Charge")
	lis := bufconn.Listen(1 << 20) // an in-memory network
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	retry, err := idemgrpc.UnaryClientInterceptor()
	if err != nil {
		panic(err)
	}
	conn, err := grpc.NewClient("passthrough:///payments",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(retry),
	)
	if err != nil {
		panic(err)
	}
	defer conn.Close()

	// The caller's own retry of one logical operation: the same key. Without
	// ContextWithKey, each call gets a random key, kept across its retries.
	ctx := idemgrpc.ContextWithKey(context.Background(), "order-42")
	for range 2 {
		var info idemgrpc.CallInfo
		out := new(wrapperspb.StringValue)
		err := conn.Invoke(ctx, chargeMethod, wrapperspb.String("10 EUR"), out, idemgrpc.Info(&info))
		fmt.Printf("%s (err %v, attempts %d, replayed %t)\n", out.GetValue(), err, info.Attempts, info.Replayed)
	}

	// The same key with another request is refused, never replayed.
	err = conn.Invoke(ctx, chargeMethod, wrapperspb.String("99 EUR"), new(wrapperspb.StringValue))
	fmt.Println(status.Code(err), reason(err))
	fmt.Println("charges:", charges)
	// Output:
	// charged 10 EUR: ch_1, attempt 1 (err <nil>, attempts 1, replayed false)
	// charged 10 EUR: ch_1, attempt 1 (err <nil>, attempts 1, replayed true)
	// FailedPrecondition KEY_REUSED
	// charges: 1
}
