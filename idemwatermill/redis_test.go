package idemwatermill_test

import (
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/require"
)

// newMiniKeeper returns a Keeper on a miniredis of its own, stopped with
// the test, and that miniredis. Clients come from the root's test helpers
// (internal/redistest.NewClient), and so do redis-servers (Start).
func newMiniKeeper(t testing.TB, opts ...idem.Option) (*idem.Keeper, *miniredis.Miniredis) {
	t.Helper()
	m := miniredis.RunT(t)
	k, err := idem.NewRedis(redistest.NewClient(t, m.Addr()), opts...)
	require.NoError(t, err)
	return k, m
}
