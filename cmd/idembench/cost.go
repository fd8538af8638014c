package main

import (
	"context"
	"runtime"
	"time"
)

// scriptCommands are the commands idem sends: scripts, whose usec includes
// the commands they call.
var scriptCommands = []string{"evalsha", "eval", "evalsha_ro", "eval_ro", "script"}

// meter reads what a phase of the run costs: Redis CPU, from the server's
// INFO, and the process's allocations.
type meter struct {
	c client
	// redis is false when the server has no INFO commandstats (miniredis):
	// then only allocations are measured.
	redis bool
}

// newMeter returns a meter reading c's server, if it answers INFO
// commandstats.
func newMeter(ctx context.Context, c client) *meter {
	m := &meter{c: c}
	_, err := readServerCPU(ctx, c)
	m.redis = err == nil
	return m
}

// reading is what a meter read at one moment.
type reading struct {
	cpu     serverCPU
	redis   bool
	mallocs uint64
}

func (m *meter) read(ctx context.Context) reading {
	var r reading
	if m.redis {
		// Read even when the run was interrupted, so that the phase that
		// ended is measured whole.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		cpu, err := readServerCPU(ctx, m.c)
		r.cpu, r.redis = cpu, err == nil
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	r.mallocs = ms.Mallocs
	return r
}

// cost is what one side of a run cost over its phases.
type cost struct {
	// commandUsec is the usec, in INFO commandstats, of the commands the
	// side sends; processUsec is the server's process CPU time.
	commandUsec int64
	processUsec int64
	// redis is false if a phase could not be read on the server.
	redis   bool
	mallocs uint64
	phases  int
}

// add adds the phase between before and after, in which the side sent
// commands.
func (c *cost) add(before, after reading, commands []string) {
	if c.phases == 0 {
		c.redis = true
	}
	c.phases++
	c.mallocs += after.mallocs - before.mallocs
	if !before.redis || !after.redis {
		c.redis = false
		return
	}
	for _, name := range commands {
		c.commandUsec += after.cpu.usec[name] - before.cpu.usec[name]
	}
	c.processUsec += after.cpu.process - before.cpu.process
}

// perOp returns the side's Redis command CPU, Redis process CPU (both in µs;
// 0 where the server could not say) and allocations per operation.
func (c *cost) perOp(ops int64) (commandUsec, processUsec, allocs float64) {
	if ops <= 0 {
		return 0, 0, 0
	}
	n := float64(ops)
	if c.redis {
		commandUsec, processUsec = float64(c.commandUsec)/n, float64(c.processUsec)/n
	}
	return commandUsec, processUsec, float64(c.mallocs) / n
}
