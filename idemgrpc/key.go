package idemgrpc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/idemkit/idem"
	"google.golang.org/grpc/metadata"
)

type keyContext struct{}

// ContextWithKey returns a copy of ctx whose calls through the client
// interceptor carry key, instead of a random one, on every attempt. Use it
// when the key comes from elsewhere (a message id, the client's own retry
// of a logical operation). A key already in the outgoing metadata wins.
func ContextWithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyContext{}, key)
}

// callKey returns the key a client call carries, and ctx with the key in
// its outgoing metadata: the key already there, else the one of
// ContextWithKey, else a new random one. An unusable key is refused with an
// error wrapping idem.ErrInvalidKey, before anything is sent.
func callKey(ctx context.Context, header string) (context.Context, string, error) {
	md, _ := metadata.FromOutgoingContext(ctx)
	switch vs := md.Get(header); len(vs) {
	case 0:
	case 1:
		return ctx, vs[0], idem.ValidateKey(vs[0])
	default:
		return ctx, "", fmt.Errorf("%w: %d %s metadata values", idem.ErrInvalidKey, len(vs), header)
	}
	key, ok := ctx.Value(keyContext{}).(string)
	if !ok {
		key = newKey()
	}
	if err := idem.ValidateKey(key); err != nil {
		return ctx, key, err
	}
	return metadata.AppendToOutgoingContext(ctx, header, key), key, nil
}

// newKey returns 128 random bits in hex.
func newKey() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// incomingKey returns the key of a server call, whether the call has one,
// and an error wrapping idem.ErrInvalidKey if the key cannot be used.
func incomingKey(ctx context.Context, header string) (key string, present bool, err error) {
	md, _ := metadata.FromIncomingContext(ctx)
	switch vs := md.Get(header); len(vs) {
	case 0:
		return "", false, nil
	case 1:
		return vs[0], true, idem.ValidateKey(vs[0])
	default:
		return "", true, fmt.Errorf("%w: %d %s metadata values", idem.ErrInvalidKey, len(vs), header)
	}
}
