package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

// baseClient is what a baseline needs of a go-redis client: a plain client,
// or with -baseline-autopipeline an AutoPipeliner.
type baseClient interface {
	redis.Cmdable
	Do(ctx context.Context, args ...any) *redis.Cmd
}

// baseline is the least an application could do in idem's place, run at the
// same concurrency: the floor idem's figures are compared with.
type baseline struct {
	c    baseClient
	http *httpBench // for bare
	body []byte
	// prefix starts the baseline's Redis keys: the run's scope and the
	// baseline's name.
	prefix string
	// keys is the number of new keys handed out (setnx, pair), or of the
	// stored values (get).
	keys                 atomic.Uint64
	leaseMs, retentionMs string
}

// claimValue is what pair's SET NX writes: a claim's worth of bytes.
const claimValue = "claimed:1"

// newBaseline returns the side -baseline names, on c (through an
// AutoPipeliner with -baseline-autopipeline) or, for bare, on w's HTTP
// server; and a function that closes what it opened. The get baseline's
// values are stored before it returns.
func newBaseline(ctx context.Context, o *options, w *workload, c client, stdout io.Writer) (*side, func(), error) {
	b := &baseline{
		c: c, http: w.http, body: w.body,
		prefix:      w.scope + ":" + o.baseline + ":",
		leaseMs:     strconv.FormatInt(idem.DefaultLease.Milliseconds(), 10),
		retentionMs: strconv.FormatInt(o.retention.Milliseconds(), 10),
	}
	closeAP := func() {}
	if o.baselineAP {
		ap, err := newAutoPipeliner(o, c)
		if err != nil {
			return nil, nil, err
		}
		b.c, closeAP = ap, func() { ap.Close() }
	}
	var s *side
	switch o.baseline {
	case baselineSetNX:
		s = newSide(b.setNX, []string{"set"})
	case baselinePair:
		s = newSide(b.pair, []string{"set"})
	case baselineGet:
		s = newSide(b.get, []string{"get"})
		if !o.json {
			fmt.Fprintf(stdout, "storing %d values for the get baseline...\n", o.keys)
		}
		if err := b.store(ctx, w, o.keys, o.retention); err != nil {
			closeAP()
			return nil, nil, err
		}
	case baselineBare:
		s = newSide(b.bare, nil)
	case baselineBareGet:
		s = newSide(b.bareGet, []string{"get"})
		if err := b.store(ctx, w, o.keys, o.retention); err != nil {
			closeAP()
			return nil, nil, err
		}
	default:
		closeAP()
		return nil, nil, fmt.Errorf("-baseline %q: no such baseline", o.baseline)
	}
	return s, closeAP, nil
}

// setNX is the least an idempotency check could do: one SET NX of the result
// under a new key.
func (b *baseline) setNX(ctx context.Context, wk *worker) {
	key := wk.keyWith(b.prefix, b.keys.Add(1))
	start := time.Now()
	err := b.c.SetNX(ctx, key, b.body, wk.w.o.retention).Err()
	b.done(wk, start, err, false)
}

// pair is the floor of a first execution: SET NX PX of a claim under a new
// key, then SET XX PX of the result, two round trips as idem's claim and
// complete are.
func (b *baseline) pair(ctx context.Context, wk *worker) {
	key := wk.keyWith(b.prefix, b.keys.Add(1))
	start := time.Now()
	err := b.c.Do(ctx, "set", key, claimValue, "px", b.leaseMs, "nx").Err()
	if err == nil {
		err = b.c.Do(ctx, "set", key, b.body, "px", b.retentionMs, "xx").Err()
	}
	if errors.Is(err, redis.Nil) {
		err = fmt.Errorf("pair baseline: %s: the SET did not take", key)
	}
	b.done(wk, start, err, false)
}

// get is the floor of a replay: GET of one of the stored values.
func (b *baseline) get(ctx context.Context, wk *worker) {
	key := wk.keyWith(b.prefix, wk.rng.Uint64N(b.keys.Load()))
	start := time.Now()
	v, err := b.c.Get(ctx, key).Bytes()
	if err == nil && len(v) != len(b.body) {
		err = fmt.Errorf("get baseline: %s holds %d bytes, want %d", key, len(v), len(b.body))
	}
	b.done(wk, start, err, true)
}

// store writes the n values the get baseline reads.
func (b *baseline) store(ctx context.Context, w *workload, n int, retention time.Duration) error {
	b.keys.Store(uint64(n))
	err := w.forEachKey(ctx, n, func(ctx context.Context, wk *worker, id uint64) error {
		return b.c.Set(ctx, wk.keyWith(b.prefix, id), b.body, retention).Err()
	})
	if err != nil {
		return fmt.Errorf("storing the values of the get baseline: %w", err)
	}
	return nil
}

// bare is the same HTTP handler as idem's side, without the middleware, over
// the same client.
func (b *baseline) bare(ctx context.Context, wk *worker) {
	key := wk.key(b.keys.Add(1))
	start := time.Now()
	status, _, err := b.http.post(ctx, b.http.bareURL, key)
	if err == nil && status != 200 {
		err = fmt.Errorf("bare baseline: HTTP %d", status)
	}
	b.done(wk, start, err, false)
}

// bareGet is the same HTTP request to a handler that GETs one of the stored
// values from Redis and answers it: the floor of a replay by any middleware
// that keeps its responses in Redis, one round trip from the handler.
func (b *baseline) bareGet(ctx context.Context, wk *worker) {
	id := wk.rng.Uint64N(b.keys.Load())
	start := time.Now()
	status, _, err := b.http.postGet(ctx, b.http.bareGetURL, wk.key(id), wk.keyWith(b.prefix, id))
	if err == nil && status != 200 {
		err = fmt.Errorf("bare-get baseline: HTTP %d", status)
	}
	b.done(wk, start, err, true)
}

// done counts an operation that started at start and ended with err.
func (b *baseline) done(wk *worker, start time.Time, err error, replay bool) {
	lat := time.Since(start)
	switch {
	case err != nil:
		wk.stats.fail(err)
		return
	case replay:
		wk.stats.replayed++
	default:
		wk.stats.executed++
	}
	wk.stats.record(lat)
}
