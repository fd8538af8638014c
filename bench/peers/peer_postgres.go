package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// postgresPeer is the seeds' Postgres design: one row per key in a logged
// table; a claim inserts the row, the result is written into it, a replay
// reads it.
type postgresPeer struct {
	db *pgxpool.Pool
	op *operation
	// claimFirst says how a call starts: with the claim, which also reads a
	// stored result (claimOrReadSQL), or with a look for the result
	// (lookupSQL), claiming (claimSQL) only on a miss.
	claimFirst                                       bool
	lookupSQL, claimSQL, claimOrReadSQL, completeSQL string
}

// The designs of -pg-design.
const (
	pgLookupFirst = "lookup"
	pgClaimFirst  = "claim"
)

// openPostgresSync opens the design with synchronous commit: a commit
// returns once its WAL is flushed to disk.
func openPostgresSync(ctx context.Context, e *env) (peer, error) {
	return openPostgres(ctx, e, "idempotency_sync", "on")
}

// openPostgresAsync opens the design with asynchronous commit: a commit
// returns before its WAL is flushed (a crash may lose the last commits).
func openPostgresAsync(ctx context.Context, e *env) (peer, error) {
	return openPostgres(ctx, e, "idempotency_async", "off")
}

// openPostgres opens a pool of e.pool connections with synchronous_commit
// set to syncCommit, and makes table anew.
func openPostgres(ctx context.Context, e *env, table, syncCommit string) (peer, error) {
	cfg, err := pgxpool.ParseConfig(e.postgres.connString())
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = int32(e.pool)
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = syncCommit
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	p := &postgresPeer{db: db, op: e.op, claimFirst: e.pgDesign == pgClaimFirst}
	if err := p.makeTable(ctx, table); err != nil {
		db.Close()
		return nil, err
	}
	return p, nil
}

// makeTable makes the table of the keys anew, and the statements on it. A
// row without a result is a claim in progress.
func (p *postgresPeer) makeTable(ctx context.Context, table string) error {
	ddl := fmt.Sprintf(`DROP TABLE IF EXISTS %[1]s;
CREATE TABLE %[1]s (
	key        text PRIMARY KEY,
	result     bytea,
	created_at timestamptz NOT NULL DEFAULT now()
)`, table)
	if _, err := p.db.Exec(ctx, ddl); err != nil {
		return fmt.Errorf("making table %s: %w", table, err)
	}
	p.lookupSQL = fmt.Sprintf(`SELECT result FROM %s WHERE key = $1`, table)
	p.claimSQL = fmt.Sprintf(`INSERT INTO %s (key) VALUES ($1) ON CONFLICT (key) DO NOTHING RETURNING true`, table)
	p.claimOrReadSQL = fmt.Sprintf(`WITH claimed AS (%s)
SELECT EXISTS (SELECT FROM claimed), (%s)`, p.claimSQL, p.lookupSQL)
	p.completeSQL = fmt.Sprintf(`UPDATE %s SET result = $2 WHERE key = $1`, table)
	return nil
}

func (p *postgresPeer) call(ctx context.Context, key string) ([]byte, error) {
	if p.claimFirst {
		return p.callClaimFirst(ctx, key)
	}
	return p.callLookupFirst(ctx, key)
}

// callLookupFirst looks for the stored result (a replay is this one SELECT);
// on a miss it claims, runs and completes: three round trips and two
// commits for a first execution.
func (p *postgresPeer) callLookupFirst(ctx context.Context, key string) ([]byte, error) {
	stored, found, err := p.lookup(ctx, key)
	if err != nil || found {
		return stored, err
	}
	claimed, err := p.claim(ctx, key)
	switch {
	case err != nil:
		return nil, err
	case !claimed: // claimed by another call since the lookup
		return p.storedSince(ctx, key)
	}
	return p.runAndComplete(ctx, key)
}

// storedSince returns the result of a key that another call claimed, or
// errInProgress if it has none yet.
func (p *postgresPeer) storedSince(ctx context.Context, key string) ([]byte, error) {
	stored, found, err := p.lookup(ctx, key)
	if err == nil && !found {
		err = errInProgress
	}
	return stored, err
}

// callClaimFirst claims, and in the same statement reads the result of a row
// that was there before: a replay is one round trip that commits nothing, a
// first execution two round trips and two commits.
func (p *postgresPeer) callClaimFirst(ctx context.Context, key string) ([]byte, error) {
	var claimed bool
	var stored []byte
	if err := p.db.QueryRow(ctx, p.claimOrReadSQL, key).Scan(&claimed, &stored); err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	switch {
	case claimed:
		return p.runAndComplete(ctx, key)
	case stored != nil:
		return stored, nil
	default:
		return nil, errInProgress
	}
}

// lookup returns the stored result of key, and whether there is a row:
// found with errInProgress when the row has no result yet.
func (p *postgresPeer) lookup(ctx context.Context, key string) (stored []byte, found bool, err error) {
	err = p.db.QueryRow(ctx, p.lookupSQL, key).Scan(&stored)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil, false, nil
	case err != nil:
		return nil, false, fmt.Errorf("lookup: %w", err)
	case stored == nil:
		return nil, true, errInProgress
	}
	return stored, true, nil
}

// claim inserts key's row, and says whether it did.
func (p *postgresPeer) claim(ctx context.Context, key string) (bool, error) {
	var claimed bool
	err := p.db.QueryRow(ctx, p.claimSQL, key).Scan(&claimed)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("claim: %w", err)
	}
	return claimed, nil
}

// runAndComplete runs the operation for a claimed key and writes its result.
func (p *postgresPeer) runAndComplete(ctx context.Context, key string) ([]byte, error) {
	res := p.op.run(key)
	if _, err := p.db.Exec(ctx, p.completeSQL, key, res); err != nil {
		return nil, fmt.Errorf("complete: %w", err)
	}
	return res, nil
}

func (p *postgresPeer) close() { p.db.Close() }
