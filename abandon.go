package idem

import (
	"context"
)

// abandonKey is AbandonRecord for the record of (scope, key).
func (k *Keeper) abandonKey(ctx context.Context, scope, key string, token int64) (Record, error) {
	started := k.startStep()
	r, err := k.abandon(ctx, scope, key, token)
	k.reportRecord(ctx, StepAbandon, scope, started, r, err)
	return r, err
}

func (k *Keeper) abandon(ctx context.Context, scope, key string, token int64) (Record, error) {
	if err := ValidateKey(key); err != nil {
		return Record{}, err
	}
	if err := checkToken("abandon", token); err != nil {
		return Record{}, err
	}
	if err := k.placementReady(ctx, false); err != nil {
		return Record{}, storeError(ctx, "abandon", err)
	}
	return k.abandonID(ctx, k.RecordID(scope, key), token)
}

// abandonID ends the lease of token on the record id; see Abandon.
func (k *Keeper) abandonID(ctx context.Context, id string, token int64) (Record, error) {
	r, err := k.store.Abandon(ctx, id, token)
	return r, storeError(ctx, "abandon", err)
}
