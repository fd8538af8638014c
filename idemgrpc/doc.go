// Package idemgrpc makes unary gRPC calls idempotent with an
// "idempotency-key" metadata entry, on an idem.Keeper, at both ends:
//
//	keeper, err := idem.NewRedis(client)
//	...
//	guard, err := idemgrpc.UnaryServerInterceptor(keeper,
//		idemgrpc.WithTenant(func(ctx context.Context) (string, error) { return accountID(ctx) }),
//	)
//	...
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(auth, guard))
//
//	retry, err := idemgrpc.UnaryClientInterceptor() // a key per call, kept across retries
//	...
//	conn, err := grpc.NewClient(target, grpc.WithChainUnaryInterceptor(retry), creds)
//
// On the server, the first call with a key runs the handler and stores its
// answer, the response message or the status with its code and details;
// every retry gets that answer back exactly, with "idempotent-replayed: true"
// in its header metadata. A retry while the first call runs gets Aborted
// with a RetryInfo; the same key on another request gets
// FailedPrecondition; a store that cannot be reached gets Unavailable and
// nothing runs. UnaryServerInterceptor documents every answer.
//
// On the client, each guarded call carries a random key (or the caller's,
// ContextWithKey) on every attempt, and is retried on Unavailable, Aborted
// and ResourceExhausted, honouring RetryInfo, with jittered exponential
// backoff, a bounded number of attempts and the call's context. Info reports
// the attempts and whether the answer was a replay.
//
// Methods whose proto declares idempotency_level NO_SIDE_EFFECTS or
// IDEMPOTENT pass through both by default; WithMethods lists the guarded
// methods instead.
package idemgrpc
