package main

import (
	"context"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/redis/go-redis/v9"
)

// idemPeer is idem.Do with default options on a plain go-redis client.
type idemPeer struct {
	rdb *redis.Client
	k   *idem.Keeper
	op  *operation
}

func openIdemDo(ctx context.Context, e *env) (peer, error) {
	rdb, k, err := openKeeper(ctx, e)
	if err != nil {
		return nil, err
	}
	return &idemPeer{rdb: rdb, k: k, op: e.op}, nil
}

// openKeeper empties Redis and returns a Keeper with default options on a
// plain client of e.pool connections.
func openKeeper(ctx context.Context, e *env) (*redis.Client, *idem.Keeper, error) {
	if err := e.flushRedis(ctx); err != nil {
		return nil, nil, err
	}
	rdb := e.redis.clientWithPool(e.pool)
	k, err := idem.NewRedis(rdb)
	if err != nil {
		rdb.Close()
		return nil, nil, err
	}
	return rdb, k, nil
}

// call is one idem.Do: a claim for a replay (which answers the result), a
// claim and a completion for a first execution.
func (p *idemPeer) call(ctx context.Context, key string) ([]byte, error) {
	return idem.Do(ctx, p.k, "", key, func(context.Context) ([]byte, error) {
		return p.op.run(key), nil
	})
}

func (p *idemPeer) close() { p.rdb.Close() }

// idemHTTPPeer is idemhttp's middleware with default options on net/http.
type idemHTTPPeer struct {
	*netHTTPPeer
	rdb *redis.Client
}

func openIdemHTTP(ctx context.Context, e *env) (peer, error) {
	rdb, k, err := openKeeper(ctx, e)
	if err != nil {
		return nil, err
	}
	guard, err := idemhttp.New(k)
	if err != nil {
		rdb.Close()
		return nil, err
	}
	p, err := startNetHTTP(e, idemhttp.DefaultKeyHeader, guard)
	if err != nil {
		rdb.Close()
		return nil, err
	}
	return &idemHTTPPeer{netHTTPPeer: p, rdb: rdb}, nil
}

func (p *idemHTTPPeer) close() {
	p.netHTTPPeer.close()
	p.rdb.Close()
}
