package idem

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// commandCounter counts the commands a client sends by name, and apart
// those sent alone, outside a pipeline.
type commandCounter struct {
	mu        sync.Mutex
	n, alone  map[string]int
	pipelines int
}

func (c *commandCounter) count(pipeline bool, cmds ...redis.Cmder) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n, c.alone = map[string]int{}, map[string]int{}
	}
	if pipeline {
		c.pipelines++
	}
	for _, cmd := range cmds {
		c.n[strings.ToLower(cmd.Name())]++
		if !pipeline {
			c.alone[strings.ToLower(cmd.Name())]++
		}
	}
}

// get returns how many commands name were sent, and how many of them alone.
func (c *commandCounter) get(name string) (n, alone int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[name], c.alone[name]
}

func (c *commandCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *commandCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.count(false, cmd)
		return next(ctx, cmd)
	}
}

func (c *commandCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.count(true, cmds...)
		return next(ctx, cmds)
	}
}

// unorderedAutoPipeline is the AutoPipeliner setting openRedisStore's
// documentation suggests: two unordered batches in flight, a 200µs flush
// delay.
func unorderedAutoPipeline() *redis.AutoPipelineOptions {
	return &redis.AutoPipelineOptions{
		MaxBatchSize: 300, MaxConcurrentBatches: 2, Unordered: true,
		MaxFlushDelay: 200 * time.Microsecond,
	}
}

// autoPipelined returns a Keeper on an AutoPipeliner of b's client, made with
// apo (nil: go-redis's defaults), with its scripts loaded, and a counter of
// the commands sent.
func autoPipelined(t *testing.T, b *redistest.Backend, apo *redis.AutoPipelineOptions, opts ...Option) (*Keeper, *commandCounter) {
	t.Helper()
	cmds := &commandCounter{}
	b.Client.AddHook(cmds)
	ap, err := b.Client.AutoPipelineWithOptions(apo)
	require.NoError(t, err)
	t.Cleanup(func() { ap.Close() })
	s, err := openRedisStore(ap)
	require.NoError(t, err)
	k, err := keeperOn(s, opts...)
	require.NoError(t, err)
	// The scripts, and the prefix's record for the Keeper: one EVALSHA.
	require.NoError(t, s.LoadScripts(context.Background()))
	return k, cmds
}

func TestAutoPipelinerBatchesTheScripts(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, cmds := autoPipelined(t, b, nil)
		ctx := context.Background()
		const n = 64
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				key := fmt.Sprint("ap-", i)
				v, err := Do(ctx, k, "s", key, func(ctx context.Context) (string, error) { return key, nil })
				assert.NoError(t, err)
				assert.Equal(t, key, v)
				again, err := Do(ctx, k, "s", key, func(ctx context.Context) (string, error) { return "ran twice", nil })
				assert.NoError(t, err)
				assert.Equal(t, key, again)
			}()
		}
		wg.Wait()
		evalsha, alone := cmds.get("evalsha")
		assert.Equal(t, 3*n+1, evalsha, "claim, complete, replay: one script each, and the prefix's record once (LoadScripts)")
		eval, _ := cmds.get("eval")
		assert.Zero(t, eval, "the scripts were loaded: no fallback")
		// How deep the batches are depends on timing: logged, not asserted.
		t.Logf("%d scripts: %d alone, the others in %d pipelines", evalsha, alone, cmds.pipelines)
	})
}

// TestAutoPipelinerSurvivesScriptFlush flushes Redis's script cache again
// and again while many callers run operations through an AutoPipeliner (in
// the unordered setting openRedisStore suggests): the EVALSHA of a whole batch
// then fails with NOSCRIPT, and each call falls back to EVAL. No call may
// fail, and no operation may run twice.
func TestAutoPipelinerSurvivesScriptFlush(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, cmds := autoPipelined(t, b, unorderedAutoPipeline(), WithCoalescing(true))
		ctx := context.Background()
		callers, ops, keys, flushes := 64, 40, 300, 15 // ops per caller
		if !b.Real {
			callers, ops, keys = 16, 20, 100 // miniredis runs Lua slowly
		}
		runs := make([]atomic.Int32, keys)
		var done atomic.Int64
		var wg sync.WaitGroup
		for c := 0; c < callers; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < ops; i++ {
					n := (c*ops + i*7) % keys // each key is asked for by several callers
					v, err := Do(ctx, k, "s", fmt.Sprint("flush-", n), func(ctx context.Context) (int, error) {
						runs[n].Add(1)
						return n, nil
					}, WithWait(time.Minute))
					if assert.NoError(t, err) {
						assert.Equal(t, n, v)
					}
					done.Add(1)
				}
			}()
		}
		flusher := redis.NewClient(&redis.Options{Addr: b.Client.Options().Addr})
		defer flusher.Close()
		flushed := 0
		for ; flushed < flushes && done.Load() < int64(callers*ops); flushed++ {
			require.NoError(t, flusher.ScriptFlush(ctx).Err())
			// Let some calls through before the next flush.
			for from := done.Load(); done.Load() < min(from+20, int64(callers*ops)); {
				time.Sleep(100 * time.Microsecond)
			}
		}
		wg.Wait()
		for n := range runs {
			assert.LessOrEqual(t, runs[n].Load(), int32(1), "key %d ran more than once", n)
		}
		require.Positive(t, flushed)
		evalsha, _ := cmds.get("evalsha")
		eval, _ := cmds.get("eval")
		assert.GreaterOrEqual(t, eval, flushed-1, "after a flush the next script falls back to EVAL")
		t.Logf("%d flushes, %d EVALSHA, %d EVAL fallbacks", flushed, evalsha, eval)
	})
}

// noScript answers NOSCRIPT to every EVALSHA, as a server whose script cache
// keeps being flushed would, and counts the calls.
type noScript struct {
	redis.Scripter
	evalsha, eval atomic.Int32
	evalErr       error // if set, EVAL fails with it
}

func (s *noScript) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	s.evalsha.Add(1)
	cmd := redis.NewCmd(ctx)
	cmd.SetErr(redis.ErrNoScript)
	return cmd
}

func (s *noScript) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	s.eval.Add(1)
	if s.evalErr != nil {
		cmd := redis.NewCmd(ctx)
		cmd.SetErr(s.evalErr)
		return cmd
	}
	return s.Scripter.Eval(ctx, script, keys, args...)
}

func TestNoScriptFallsBackOncePerCall(t *testing.T) {
	b := redistest.Miniredis(t)
	ns := &noScript{Scripter: b.Client}
	s, err := openRedisStore(ns)
	require.NoError(t, err)
	k, err := keeperOn(s)
	require.NoError(t, err)
	ctx := context.Background()
	check := func(what string, f func()) {
		t.Helper()
		ns.evalsha.Store(0)
		ns.eval.Store(0)
		f()
		assert.EqualValues(t, 1, ns.evalsha.Load(), what)
		assert.EqualValues(t, 1, ns.eval.Load(), what)
	}
	var out Outcome
	check("the prefix's record, once a store", func() { require.NoError(t, s.LoadScripts(ctx)) })
	check("claim", func() { out, err = k.Begin(ctx, "s", "k"); require.NoError(t, err) })
	check("extend", func() { require.NoError(t, out.Claim.Extend(ctx)) })
	check("complete", func() { require.NoError(t, out.Claim.Complete(ctx, []byte("v"), 0)) })
	check("replay", func() {
		got, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		assert.Equal(t, "v", string(got.Value))
	})

	// An EVAL that fails is the call's error; nothing is tried a third time.
	ns.evalErr = redisError("LOADING Redis is loading the dataset in memory")
	check("failing claim", func() {
		_, err = k.Begin(ctx, "s", "k2")
		require.ErrorIs(t, err, ErrUnavailable)
		require.ErrorIs(t, err, ns.evalErr)
		assert.False(t, errors.Is(err, redis.ErrNoScript))
	})
}
