package idem

import (
	"context"
	_ "embed"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// The checkpoint step of redisStore: lua/checkpoint.lua.
var (
	//go:embed lua/checkpoint.lua
	checkpointBody   string
	checkpointScript = newLuaScript("checkpoint", checkpointBody)
)

// Checkpoint implements recordStore: one script, one round trip. With
// WithReplicas it waits for the replicas as a completion does.
func (s *redisStore) Checkpoint(ctx context.Context, claim claimFence, name string, value []byte, keep time.Duration) error {
	if claim.Ref > 0 {
		key := s.key(claim.ID)
		index, calls := s.v3Names(key)
		return s.checkpoint(ctx, []string{key, index, v3CallKey(calls, claim.Token)},
			[]any{claim.Token, name, value, MaxCheckpoints, claim.Ref, millis(keep)})
	}
	return s.checkpoint(ctx, []string{s.key(claim.ID)}, []any{claim.Token, name, value, MaxCheckpoints})
}

// checkpoint runs checkpoint.lua on keys with args.
func (s *redisStore) checkpoint(ctx context.Context, keys []string, args []any) error {
	var cmd *redis.Cmd
	if s.durable != nil {
		cmd = s.durable.run(ctx, s.client, "checkpoint", checkpointScript, keys, args...)
	} else {
		cmd = checkpointScript.Run(ctx, s.client, keys, args...)
	}
	res, err := cmd.Slice()
	if err != nil {
		return err
	}
	if replyCode(res) == checkpointFull {
		return fmt.Errorf("%w: the record holds %d checkpoints, the most it may", ErrInvalidCheckpoint, MaxCheckpoints)
	}
	return transitionReply(res)
}
