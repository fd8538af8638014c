package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/integration"
)

// bench sets a run up, runs it, and returns what it measured.
func bench(ctx context.Context, o *options, stdout, stderr io.Writer) (*Result, error) {
	h, err := setup(ctx, o, stdout, stderr)
	if err != nil {
		return nil, err
	}
	defer h.close()
	if err := h.onMeasure(ctx, "start"); err != nil {
		return nil, err
	}
	if err := h.measure(ctx, stdout); err != nil {
		return nil, err
	}
	if err := h.onMeasure(ctx, "stop"); err != nil {
		return nil, err
	}
	if h.memory != nil {
		h.idemMemory, h.baseMemory, h.memoryMethod = h.memory.finish(ctx, h.idem, h.base)
	}
	return h.result(), nil
}

// harness is a run set up: the Keeper under test, the workload, the two
// sides of the run, and what measures them.
type harness struct {
	o      *options
	server string
	w      *workload
	// k is the Keeper under test; cache0 its replay cache's counts when
	// the clock started.
	k      *idem.Keeper
	cache0 idem.ReplayCacheStats
	// cnt counts the commands idem's client sends while idem's side runs,
	// baseCnt the baseline client's while the baseline's side runs.
	cnt, baseCnt *counter
	meter        *meter
	idem         *side
	// base is the baseline's side; nil without -baseline.
	base *side
	// memory measures, with -workload batch, the memory each side's ids
	// take; nil in other workloads. idemMemory, baseMemory and
	// memoryMethod are what it found.
	memory                 *memoryProbe
	idemMemory, baseMemory memory
	memoryMethod           string

	closers []func()
}

// close closes what setup opened, last first.
func (h *harness) close() {
	for _, c := range slices.Backward(h.closers) {
		c()
	}
	h.closers = nil
}

// setup connects to Redis, makes the Keeper and the two sides of the run,
// and completes the keys of a replay run: all that comes before the clock
// starts.
func setup(ctx context.Context, o *options, stdout, stderr io.Writer) (_ *harness, err error) {
	h := &harness{o: o}
	defer func() {
		if err != nil {
			h.close()
		}
	}()
	idemClient, baseClient, err := h.connect(ctx, stderr)
	if err != nil {
		return nil, err
	}
	if o.workload == workloadBatch {
		// Before the Keeper writes anything of its own.
		h.memory = newMemoryProbe(ctx, o, idemClient, baseClient)
	}
	o.run = newRunTag()
	k, closeKeeper, err := newKeeper(ctx, o, idemClient)
	if err != nil {
		return nil, err
	}
	h.closers = append(h.closers, closeKeeper)
	if err := h.makeSides(ctx, k, baseClient, stdout); err != nil {
		return nil, err
	}
	h.closers = append(h.closers, func() {
		for _, s := range []*side{h.idem, h.base} {
			if s != nil {
				s.closePacing()
			}
		}
	})
	if o.workload == "replay" {
		if !o.json {
			fmt.Fprintf(stdout, "completing %d keys for the replay run...\n", o.keys)
		}
		if err := h.w.seed(ctx); err != nil {
			return nil, err
		}
	}
	h.k, h.cache0 = k, k.ReplayCacheStats()
	h.meter = newMeter(ctx, baseClient)
	if h.memory != nil {
		h.memory.start(ctx)
	}
	if !o.json {
		printHeader(stdout, o, h.server)
	}
	if err := h.prefill(ctx, stderr); err != nil {
		return nil, err
	}
	return h, nil
}

// connect returns a client for idem, counting its commands, and one for the
// baseline and the meter, once the server answers.
func (h *harness) connect(ctx context.Context, stderr io.Writer) (idemClient, baseClient client, err error) {
	idemClient, baseClient, server, closeClients, err := connect(h.o, stderr)
	if err != nil {
		return nil, nil, err
	}
	h.closers = append(h.closers, closeClients)
	if err := idemClient.Ping(ctx).Err(); err != nil {
		return nil, nil, fmt.Errorf("reaching Redis: %w", err)
	}
	if err := baseClient.Ping(ctx).Err(); err != nil {
		return nil, nil, fmt.Errorf("reaching Redis for the baseline (see -baseline-db): %w", err)
	}
	if h.server = server; h.server == "" {
		h.server = serverName(ctx, idemClient)
	}
	h.cnt, h.baseCnt = &counter{}, &counter{}
	idemClient.AddHook(h.cnt)
	baseClient.AddHook(h.baseCnt)
	return idemClient, baseClient, nil
}

// makeSides makes the workload and idem's side on k, through the server of
// -mode http if asked, and the baseline's side on c.
func (h *harness) makeSides(ctx context.Context, k *idem.Keeper, c client, stdout io.Writer) error {
	o := h.o
	h.w = newWorkload(o, k)
	h.idem = newSide(h.w.doOp, scriptCommands)
	h.idem.cnt = h.cnt
	if o.workload == workloadBatch {
		h.idem.op = h.w.consumeOp
		h.idem.ran = h.w.ran
		h.idem.streams = newStreams(o, h.idem.ran)
		h.idem.prefill = h.w.prefillConsume
	}
	if o.mode == modeHTTP {
		hb, err := startHTTP(o, k, c, h.w.scope, h.w.ran, newBitset())
		if err != nil {
			return err
		}
		h.closers = append(h.closers, hb.close)
		h.w.http, h.idem.op = hb, h.w.httpOp
	}
	switch {
	case o.baseline == "":
		return nil
	case o.workload == workloadBatch:
		base, err := newConsumerBaseline(o, h.w.scope, integration.Lease(k), c)
		if err != nil {
			return err
		}
		h.base, base.cnt = base, h.baseCnt
		return nil
	}
	base, closeBase, err := newBaseline(ctx, o, h.w, c, stdout)
	if err != nil {
		return err
	}
	h.closers = append(h.closers, closeBase)
	h.base, base.cnt = base, h.baseCnt
	return nil
}

// onMeasure runs -on-measure's program, if any, with the argument what
// ("start" before the first measured slice, "stop" after the last, before
// the memory is read), and waits for it.
func (h *harness) onMeasure(ctx context.Context, what string) error {
	if h.o.onMeasure == "" {
		return nil
	}
	cmd := exec.CommandContext(context.WithoutCancel(ctx), h.o.onMeasure, what)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("-on-measure %s %s: %w", h.o.onMeasure, what, err)
	}
	return nil
}
