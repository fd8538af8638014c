package idem

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// flakyScripter fails the next n script calls with err, then passes calls on
// to the real client.
type flakyScripter struct {
	redis.Scripter
	n   atomic.Int32
	err error
}

func (f *flakyScripter) fail(ctx context.Context) *redis.Cmd {
	cmd := redis.NewCmd(ctx)
	cmd.SetErr(f.err)
	return cmd
}

func (f *flakyScripter) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	if f.n.Add(-1) >= 0 {
		return f.fail(ctx)
	}
	return f.Scripter.EvalSha(ctx, sha, keys, args...)
}

func (f *flakyScripter) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	if f.n.Add(-1) >= 0 {
		return f.fail(ctx)
	}
	return f.Scripter.Eval(ctx, script, keys, args...)
}

// redisError is an error reply as go-redis returns it.
type redisError string

func (e redisError) Error() string { return string(e) }
func (redisError) RedisError()     {}

func TestStoreFailuresAreUnavailable(t *testing.T) {
	cases := []error{
		redisError("LOADING Redis is loading the dataset in memory"),
		redisError("READONLY You can't write against a read only replica."),
		redisError("CLUSTERDOWN The cluster is down"),
		&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")},
		context.DeadlineExceeded,
	}
	for _, cause := range cases {
		t.Run(cause.Error(), func(t *testing.T) {
			b := redistest.Miniredis(t)
			f := &flakyScripter{Scripter: b.Client, err: cause}
			s, err := openRedisStore(f)
			require.NoError(t, err)
			k, err := keeperOn(s)
			require.NoError(t, err)
			ctx := context.Background()
			var runs int
			fn := func(ctx context.Context) (int, error) { runs++; return 1, nil }

			f.n.Store(1)
			_, err = Do(ctx, k, "s", "key", fn)
			require.ErrorIs(t, err, ErrUnavailable)
			require.ErrorIs(t, err, cause)
			assert.Zero(t, runs, "the operation does not run when the claim failed")

			// The claim goes through, storing the result fails: the caller
			// gets the value and the error; the key stays claimed, so a retry
			// is told it is in progress rather than running the operation again.
			f.n.Store(0)
			out, err := k.Begin(ctx, "s", "key2")
			require.NoError(t, err)
			f.n.Store(1)
			require.ErrorIs(t, out.Claim.Complete(ctx, []byte("v"), 0), ErrUnavailable)
			_, err = k.Begin(ctx, "s", "key2")
			require.ErrorIs(t, err, ErrInProgress)
			f.n.Store(1)
			require.ErrorIs(t, out.Claim.Release(ctx), ErrUnavailable)
			f.n.Store(1)
			require.ErrorIs(t, out.Claim.Extend(ctx), ErrUnavailable)

			f.n.Store(0)
			v, err := Do(ctx, k, "s", "key", fn)
			require.NoError(t, err)
			assert.Equal(t, 1, v)
			assert.Equal(t, 1, runs)
		})
	}
}

func TestDoReturnsValueWhenResultCannotBeStored(t *testing.T) {
	b := redistest.Miniredis(t)
	f := &flakyScripter{Scripter: b.Client, err: redisError("LOADING Redis is loading the dataset in memory")}
	s, err := openRedisStore(f)
	require.NoError(t, err)
	k, err := keeperOn(s)
	require.NoError(t, err)
	ctx := context.Background()
	v, err := Do(ctx, k, "s", "k", func(ctx context.Context) (string, error) {
		f.n.Store(1) // the completion will fail
		return "charged", nil
	})
	assert.Equal(t, "charged", v, "the operation ran: its value is returned")
	require.ErrorIs(t, err, ErrUnavailable)
	_, err = Do(ctx, k, "s", "k", func(ctx context.Context) (string, error) {
		assert.Fail(t, "must not run again while the first claim's lease lasts")
		return "", nil
	})
	require.ErrorIs(t, err, ErrInProgress)
}
