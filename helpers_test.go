package idem

import (
	"context"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// newKeeper returns a Keeper on b's client.
func newKeeper(t testing.TB, b *redistest.Backend, opts ...Option) *Keeper {
	t.Helper()
	k, err := NewRedis(b.Client, opts...)
	require.NoError(t, err, "NewRedis")
	return k
}

// quietLogger drops go-redis's own log lines (dial failures in the
// unavailability tests), which the tests assert on as errors instead.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

func init() { redis.SetLogger(quietLogger{}) }
