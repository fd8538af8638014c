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
// INFO, and the process's CPU time and allocations.
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
	cpu   serverCPU
	redis bool
	// clientUsec is the process's CPU time, user plus system, in
	// microseconds; client is false where it cannot be read.
	clientUsec int64
	client     bool
	mallocs    uint64
}

// read reads the server and the process, at the start of a phase (start),
// or at its end: the process is read last at the start and first at the
// end, so that its figures leave out reading the server.
func (m *meter) read(ctx context.Context, start bool) reading {
	var r reading
	if start {
		m.readServer(ctx, &r)
	}
	r.clientUsec, r.client = processCPU()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	r.mallocs = ms.Mallocs
	if !start {
		m.readServer(ctx, &r)
	}
	return r
}

// readServer reads the server's CPU figures into r, if the server has them.
func (m *meter) readServer(ctx context.Context, r *reading) {
	if !m.redis {
		return
	}
	// Read even when the run was interrupted, so that the phase that
	// ended is measured whole.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	cpu, err := readServerCPU(ctx, m.c)
	r.cpu, r.redis = cpu, err == nil
}

// cost is what one side of a run cost over its phases.
type cost struct {
	// commandUsec is the usec, in INFO commandstats, of the commands the
	// side sends; processUsec is the server's process CPU time.
	commandUsec int64
	processUsec int64
	// redis is false if a phase could not be read on the server.
	redis bool
	// clientUsec is the process's CPU time; client is false if a phase
	// could not read it.
	clientUsec int64
	client     bool
	mallocs    uint64
	phases     int
}

// add adds the phase between before and after, in which the side sent
// commands.
func (c *cost) add(before, after reading, commands []string) {
	if c.phases == 0 {
		c.redis, c.client = true, true
	}
	c.phases++
	c.mallocs += after.mallocs - before.mallocs
	c.clientUsec += after.clientUsec - before.clientUsec
	c.client = c.client && before.client && after.client
	if !before.redis || !after.redis {
		c.redis = false
		return
	}
	for _, name := range commands {
		c.commandUsec += after.cpu.usec[name] - before.cpu.usec[name]
	}
	c.processUsec += after.cpu.process - before.cpu.process
}

// costPerOp is what one operation of a side cost, on average.
type costPerOp struct {
	// commandUsec is the Redis usec of its commands (INFO commandstats),
	// processUsec the Redis process's CPU time (INFO cpu), both 0 where the
	// server could not say; clientUsec is this process's CPU time, 0 where
	// it could not be read; allocs this process's allocations.
	commandUsec, processUsec, clientUsec, allocs float64
}

// perOp returns the side's costs per operation.
func (c *cost) perOp(ops int64) costPerOp {
	if ops <= 0 {
		return costPerOp{}
	}
	n := float64(ops)
	p := costPerOp{allocs: float64(c.mallocs) / n}
	if c.redis {
		p.commandUsec, p.processUsec = float64(c.commandUsec)/n, float64(c.processUsec)/n
	}
	if c.client {
		p.clientUsec = float64(c.clientUsec) / n
	}
	return p
}

// processPerSec returns the server's process CPU time (INFO cpu) over the
// side's phases, in µs per second of d, the side's measured time; 0 where
// the server could not say.
func (c *cost) processPerSec(d time.Duration) float64 {
	if !c.redis || d <= 0 {
		return 0
	}
	return float64(c.processUsec) / d.Seconds()
}
