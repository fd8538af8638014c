package idemhttp

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestMiddlewareRedis runs the middleware suite of TestMiddleware against
// real redis-server processes, one per test.
func TestMiddlewareRedis(t *testing.T) {
	redistest.Binary(t, "redis-server")
	suite(t, redistest.Real)
}

// BenchmarkMiddlewareReplayRedis measures a replayed request end to end on
// a local redis-server: one script round trip, decoding, writing.
func BenchmarkMiddlewareReplayRedis(b *testing.B) {
	s := redistest.Start(b)
	k, err := idem.NewRedis(s.Client(b))
	require.NoError(b, err)
	bench(b, k, true, nil)
}

// BenchmarkMiddlewareFirstRequestRedis measures a first request end to end
// on a local redis-server: claim, handler, complete (two round trips).
func BenchmarkMiddlewareFirstRequestRedis(b *testing.B) {
	s := redistest.Start(b)
	c := s.Client(b)
	c.AddHook(freshKeys())
	k, err := idem.NewRedis(c)
	require.NoError(b, err)
	bench(b, k, false, nil)
}

// freshKeys is a go-redis hook that gives every claim a record of its own,
// so that every request is a first one: it appends a count, one more at
// each claim, to the record key (KEYS[1]) of each call of claim.lua, and
// the latest count to that of complete.lua, after the key's hash tag. A
// claim's other arguments still name the request's own record id: they
// look it up in the index of compact claims, which stays empty (nothing
// here claims compactly). The benchmark's calls come one at a time.
func freshKeys() redistest.ScriptHook {
	var n atomic.Int64
	return redistest.ScriptHook{On: func(ctx context.Context, name string, cmd redis.Cmder, send func() error) error {
		if name != "claim" && name != "complete" {
			return send()
		}
		// A key already given its count is one whose EVALSHA was answered
		// NOSCRIPT, sent again by EVAL.
		args := cmd.Args()
		if key := args[3].(string); !strings.Contains(key, "#") {
			count := n.Load()
			if name == "claim" {
				count = n.Add(1)
			}
			args[3] = key + "#" + strconv.FormatInt(count, 10)
		}
		return send()
	}}
}
