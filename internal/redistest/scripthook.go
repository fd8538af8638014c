package redistest

import (
	"context"

	"github.com/idemkit/idem/internal/scriptname"
	"github.com/redis/go-redis/v9"
)

// ScriptHook is a go-redis hook through which a test acts on the calls of
// the idem package's scripts, by name: On is called with each call of a
// script (EVALSHA, or EVAL after NOSCRIPT, sent alone or in a pipeline), the
// script's name, the base name of its file in lua/ ("claim", "extend",
// "v3_claim"), and the command (a *redis.Cmd; in a pipeline, the first
// script call's), to read or rewrite; send sends it. On may delay it, send it and change nothing,
// or not send it and return an error, which is then the command's error, as
// a dropped connection's would be. Every other command goes as it came. Add
// it with client.AddHook.
type ScriptHook struct {
	On func(ctx context.Context, name string, cmd redis.Cmder, send func() error) error
}

// DialHook implements redis.Hook.
func (h ScriptHook) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (h ScriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		name := scriptname.Of(cmd.Args())
		if name == "" {
			return next(ctx, cmd)
		}
		err := h.On(ctx, name, cmd, func() error { return next(ctx, cmd) })
		if err != nil && cmd.Err() == nil {
			cmd.SetErr(err)
		}
		return err
	}
}

// ProcessPipelineHook implements redis.Hook: a pipeline that holds calls of
// scripts is handed to On once, as a whole, with the first of them.
func (h ScriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		name, first := "", redis.Cmder(nil)
		for _, cmd := range cmds {
			if name = scriptname.Of(cmd.Args()); name != "" {
				first = cmd
				break
			}
		}
		if name == "" {
			return next(ctx, cmds)
		}
		err := h.On(ctx, name, first, func() error { return next(ctx, cmds) })
		if err != nil {
			for _, cmd := range cmds {
				if cmd.Err() == nil {
					cmd.SetErr(err)
				}
			}
		}
		return err
	}
}
