package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/bsm/redislock"
	"github.com/redis/go-redis/v9"
)

// The redislock peer's settings: how long a lock may be held, how long a
// result is kept (idem's defaults for its lease and retention).
const (
	lockTTL   = 30 * time.Second
	retention = 24 * time.Hour
)

// redislockPeer is the lock-then-check pattern on github.com/bsm/redislock:
// look for the result; on a miss take the key's lock, look again (another
// holder may have finished in between), run, store the result, release.
type redislockPeer struct {
	rdb    *redis.Client
	locker *redislock.Client
	op     *operation
}

func openRedislock(ctx context.Context, e *env) (peer, error) {
	if err := e.flushRedis(ctx); err != nil {
		return nil, err
	}
	rdb := e.redis.clientWithPool(e.pool)
	return &redislockPeer{rdb: rdb, locker: redislock.New(rdb), op: e.op}, nil
}

// call takes one GET for a replay; for a first execution GET, the lock
// (one script), GET, SET and the release (one script): five round trips.
func (p *redislockPeer) call(ctx context.Context, key string) ([]byte, error) {
	resultKey := "result:" + key
	if res, err := p.stored(ctx, resultKey); res != nil || err != nil {
		return res, err
	}
	lock, err := p.locker.Obtain(ctx, "lock:"+key, lockTTL, nil)
	if errors.Is(err, redislock.ErrNotObtained) {
		return nil, errInProgress
	}
	if err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	res, err := p.runLocked(ctx, key, resultKey)
	if rerr := lock.Release(context.WithoutCancel(ctx)); rerr != nil && err == nil {
		err = fmt.Errorf("release: %w", rerr)
	}
	return res, err
}

// runLocked runs the operation under the key's lock, unless its result was
// stored in the meantime, and stores the result.
func (p *redislockPeer) runLocked(ctx context.Context, key, resultKey string) ([]byte, error) {
	if res, err := p.stored(ctx, resultKey); res != nil || err != nil {
		return res, err
	}
	res := p.op.run(key)
	if err := p.rdb.Set(ctx, resultKey, res, retention).Err(); err != nil {
		return nil, fmt.Errorf("SET: %w", err)
	}
	return res, nil
}

// stored returns the stored result at resultKey, or nil if there is none.
func (p *redislockPeer) stored(ctx context.Context, resultKey string) ([]byte, error) {
	res, err := p.rdb.Get(ctx, resultKey).Bytes()
	switch {
	case errors.Is(err, redis.Nil):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("GET: %w", err)
	}
	return res, nil
}

func (p *redislockPeer) close() { p.rdb.Close() }
