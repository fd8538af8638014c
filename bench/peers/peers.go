package main

import (
	"context"
	"fmt"
)

// peer is one way of making an operation idempotent, open and ready.
type peer interface {
	// call runs the operation for key through the peer: the first call with
	// a key runs it, a later one gets the stored result. It returns the
	// result the caller gets.
	call(ctx context.Context, key string) ([]byte, error)
	// close releases what the peer opened.
	close()
}

// needs says which servers a peer needs.
type needs uint8

const (
	needRedis needs = 1 << iota
	needPostgres
)

// peerSpec describes a peer: its name on the command line, its label in the
// table, what it needs, and how to open it.
type peerSpec struct {
	name  string
	label string
	needs needs
	// idempotent is false for the peer without idempotency, whose replays
	// run the operation again.
	idempotent bool
	open       func(ctx context.Context, e *env) (peer, error)
}

// The peers, in the order they run.
var peerSpecs = []peerSpec{
	{name: "postgres", label: "Postgres design, pgx (synchronous commit)", needs: needPostgres, idempotent: true, open: openPostgresSync},
	{name: "postgres-async", label: "Postgres design, pgx (asynchronous commit)", needs: needPostgres, idempotent: true, open: openPostgresAsync},
	{name: "redislock", label: "bsm/redislock lock-then-check", needs: needRedis, idempotent: true, open: openRedislock},
	{name: "fiber", label: "Fiber v3 idempotency middleware", idempotent: true, open: openFiber},
	{name: "nethttp", label: "bare net/http, no idempotency", open: openNetHTTP},
	{name: "idem", label: "idem Do", needs: needRedis, idempotent: true, open: openIdemDo},
	{name: "idemhttp", label: "idem middleware on net/http", needs: needRedis, idempotent: true, open: openIdemHTTP},
}

func peerNames() []string {
	names := make([]string, len(peerSpecs))
	for i, s := range peerSpecs {
		names[i] = s.name
	}
	return names
}

func specOf(name string) peerSpec {
	for _, s := range peerSpecs {
		if s.name == name {
			return s
		}
	}
	panic("peers: unknown peer " + name)
}

// env is what a peer opens on: the servers, the operation, and the size of
// the pools.
type env struct {
	op   *operation
	pool int
	// pgDesign is how the Postgres design starts a call: pgLookupFirst or
	// pgClaimFirst.
	pgDesign string
	redis    *redisServer
	postgres *postgresServer
}

// flushRedis empties the Redis server, so that each peer starts on an empty
// one.
func (e *env) flushRedis(ctx context.Context) error {
	c := e.redis.client()
	defer c.Close()
	if err := c.FlushAll(ctx).Err(); err != nil {
		return fmt.Errorf("FLUSHALL: %w", err)
	}
	return nil
}

// needsOf returns what the peers named need, together.
func needsOf(names []string) needs {
	var n needs
	for _, name := range names {
		n |= specOf(name).needs
	}
	return n
}
