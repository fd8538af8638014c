package redistest

import (
	"context"
	"errors"
	"testing"

	"github.com/idemkit/idem/internal/scriptname"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestScriptHook: a registered script's calls reach On by name, alone and
// in a pipeline; an error On returns without sending is the command's, and
// the script does not run; other commands pass by.
func TestScriptHook(t *testing.T) {
	b := Miniredis(t)
	ctx := context.Background()
	sc := redis.NewScript(`return redis.call('INCR', KEYS[1])`)
	scriptname.Register(sc.Hash(), "incr")
	var seen []string
	refuse := errors.New("connection reset by peer")
	b.Client.AddHook(ScriptHook{On: func(ctx context.Context, name string, cmd redis.Cmder, send func() error) error {
		seen = append(seen, name)
		if len(seen) == 3 {
			return refuse
		}
		return send()
	}})

	require.NoError(t, b.Client.Set(ctx, "other", 1, 0).Err())
	n, err := sc.Run(ctx, b.Client, []string{"n"}).Int() // EVALSHA: NOSCRIPT, then EVAL
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	_, err = sc.Run(ctx, b.Client, []string{"n"}).Int()
	assert.ErrorIs(t, err, refuse)
	pipe := b.Client.Pipeline()
	sc.EvalSha(ctx, pipe, []string{"n"})
	_, err = pipe.Exec(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{"incr", "incr", "incr", "incr"}, seen)
	v, err := b.Client.Get(ctx, "n").Int()
	require.NoError(t, err)
	assert.Equal(t, 2, v, "the refused call did not run")
}
