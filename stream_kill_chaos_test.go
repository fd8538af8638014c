package idem

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/proc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/runlog"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// chaosWorker is a worker process of TestStreamConsumerKillOutagePause.
type chaosWorker struct {
	name, log string
	cmd       *exec.Cmd
	done      chan struct{} // closed when the process has exited, err set
	err       error
}

// stopMidHandler stops w (SIGSTOP) while one of its handlers is under way
// (a start in its log with no run after it) and returns those handlers;
// stopped between two, w is let go on for a moment and tried again.
func stopMidHandler(t *testing.T, w *chaosWorker, deadline time.Time) []runlog.RunLine {
	t.Helper()
	for {
		require.True(t, time.Now().Before(deadline), "worker %s was never stopped mid-handler", w.name)
		require.NoError(t, w.cmd.Process.Signal(syscall.SIGSTOP))
		under, err := runlog.Unfinished(w.log)
		require.NoError(t, err)
		if len(under) > 0 {
			return under
		}
		require.NoError(t, w.cmd.Process.Signal(syscall.SIGCONT))
		time.Sleep(time.Millisecond)
	}
}

// TestStreamConsumerKillOutagePause: three worker processes
// (internal/streamworker, a side-effect log each) consume 600 entries of
// a stream on a redis-server with AOF (appendfsync always) while, in turn,
// one is killed with SIGKILL in the middle of a handler and started again
// under its name, the redis-server is killed and started again on its
// data twice (two fifths of a lease later, then a whole lease later), and
// another worker is stopped (SIGSTOP) in the middle of a handler for three
// leases, then let go on (SIGCONT). No worker exits on the outages; no id is lost; no handler runs
// again once its outcome was stored; every run of an id beyond its first
// is Recovered (the killed and the stopped handlers' ids among them), and
// the stopped handlers' late completions are not stored.
func TestStreamConsumerKillOutagePause(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	c := srv.Client(t)
	ctx := context.Background()
	const (
		messages    = 600
		batch       = 4
		concurrency = 1
		lease       = 2 * time.Second
		delay       = 50 * time.Millisecond // each handler's run
		pause       = 3 * lease
	)
	bin := buildStreamWorker(t)
	ids := make([]string, messages)
	pipe := c.Pipeline()
	for i := range ids {
		ids[i] = "id-" + strconv.Itoa(i)
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": ids[i]}})
	}
	_, err := pipe.Exec(ctx)
	require.NoError(t, err)
	require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())

	dir := t.TempDir()
	var logs []string
	refused := &refusedCounter{w: &testWriter{t}} // the dials the workers' go-redis logged as refused: the outages they saw
	start := func(name string) *chaosWorker {
		w := &chaosWorker{name: name, log: filepath.Join(dir, fmt.Sprintf("%s.%d.log", name, len(logs))), done: make(chan struct{})}
		logs = append(logs, w.log)
		w.cmd = exec.Command(bin, "-addr", srv.Addr, "-name", name, "-lease", lease.String(),
			"-batch", strconv.Itoa(batch), "-concurrency", strconv.Itoa(concurrency),
			"-log", w.log, "-delay", delay.String())
		stdout, err := w.cmd.StdoutPipe()
		require.NoError(t, err)
		w.cmd.Stderr = refused
		require.NoError(t, proc.Start(w.cmd))
		line, err := bufio.NewReader(stdout).ReadString('\n')
		require.NoError(t, err)
		require.Equal(t, "ready\n", line)
		go func() { w.err = w.cmd.Wait(); close(w.done) }()
		t.Cleanup(func() { _ = w.cmd.Process.Kill(); <-w.done })
		return w
	}
	workers := []*chaosWorker{start("w0"), start("w1"), start("w2")}
	alive := func() {
		t.Helper()
		for _, w := range workers {
			select {
			case <-w.done:
				t.Fatalf("worker %s exited: %v", w.name, w.err)
			default:
			}
		}
	}
	deadline := time.Now().Add(60 * time.Second) // a bound, not a margin
	waitRuns := func(n int) {
		t.Helper()
		for {
			l, err := runlog.Read(logs...)
			require.NoError(t, err)
			if len(l.Runs) >= n {
				return
			}
			alive()
			require.True(t, time.Now().Before(deadline), "the workers ran %d handlers, waiting for %d", len(l.Runs), n)
			time.Sleep(10 * time.Millisecond)
		}
	}

	// A SIGKILL mid-handler, and the worker started again under its name
	// (it reads its own pending entries first).
	waitRuns(messages / 10)
	killed := stopMidHandler(t, workers[0], deadline)
	require.NoError(t, workers[0].cmd.Process.Signal(syscall.SIGKILL))
	<-workers[0].done
	workers[0] = start("w0")

	// The redis-server killed, and started again on its AOF: first after
	// two fifths of a lease (shorter than half a lease, it loses no lease),
	// then after a whole lease (leases run out: their claims are taken over).
	outages := []time.Duration{lease * 2 / 5, lease}
	for i, outage := range outages {
		waitRuns((2 + i) * messages / 10)
		srv.Stop()
		time.Sleep(outage)
		srv.Restart(t)
		alive()
	}

	// A worker stopped mid-handler for three leases.
	waitRuns((2 + len(outages)) * messages / 10)
	stopped := stopMidHandler(t, workers[1], deadline)
	time.Sleep(pause)
	require.NoError(t, workers[1].cmd.Process.Signal(syscall.SIGCONT))

	for {
		alive()
		groups, err := c.XInfoGroups(ctx, "s").Result()
		require.NoError(t, err)
		if groups[0].Pending == 0 && groups[0].Lag == 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "entries still pending (%d) or unread (%d)", groups[0].Pending, groups[0].Lag)
		time.Sleep(20 * time.Millisecond)
	}
	for _, w := range workers {
		require.NoError(t, w.cmd.Process.Signal(syscall.SIGTERM))
		<-w.done
		assert.NoError(t, w.err, "worker %s on SIGTERM", w.name)
	}

	l, err := runlog.Read(logs...)
	require.NoError(t, err)
	n := l.Count(ids)
	k, err := NewRedis(c, WithLease(lease))
	require.NoError(t, err)
	notCompleted := 0
	for _, id := range ids {
		r, err := k.Inspect(ctx, "s g", id)
		require.NoError(t, err)
		if r.State != StateCompleted {
			notCompleted++
		}
	}
	dead, err := c.XLen(ctx, "s:dead-letter").Result()
	require.NoError(t, err)
	t.Logf("go test -race -count=1 -run '^TestStreamConsumerKillOutagePause$' .: %s; %d not completed, %d dead-lettered; "+
		"the SIGKILL stopped %d handlers, the SIGSTOP (%s, a lease %s) %d; "+
		"the outages (%v): %d dials refused",
		n, notCompleted, dead, len(killed), pause, lease, len(stopped), outages, refused.count())
	for _, p := range n.Problems {
		t.Log(p)
	}
	assert.Zero(t, n.Lost, "ids never handled")
	assert.Zero(t, notCompleted, "ids whose record is not completed")
	assert.Zero(t, dead, "entries dead-lettered")
	assert.Zero(t, n.AgainAfterStored, "handlers run again after their outcome was stored")
	assert.Zero(t, n.StoredWithoutRun, "outcomes stored with no run")
	assert.Equal(t, n.SecondRuns, n.Recovered, "second runs, and those Recovered")
	assertTakenOver(t, l, killed, "killed")
	assertTakenOver(t, l, stopped, "stopped")
	for _, s := range stopped {
		assert.NotContains(t, l.Stored[s.RID], s.Token, "%s: the stopped handler's late outcome was stored", s.ID)
		assert.True(t, slices.ContainsFunc(l.Runs, func(r runlog.RunLine) bool { return r.ID == s.ID && r.Token == s.Token }),
			"%s: the stopped handler did not make its side effect once let go on", s.ID)
	}
}

// refusedCounter passes a worker's stderr on to w, counting the
// connections it says were refused.
type refusedCounter struct {
	w  io.Writer
	mu sync.Mutex
	n  int
}

func (r *refusedCounter) Write(p []byte) (int, error) {
	r.mu.Lock()
	r.n += bytes.Count(p, []byte("connection refused"))
	r.mu.Unlock()
	return r.w.Write(p)
}

func (r *refusedCounter) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n
}

// assertTakenOver checks that each handler of under (killed or stopped
// mid-handler) was run again by a later claim, Recovered.
func assertTakenOver(t *testing.T, l *runlog.Logs, under []runlog.RunLine, what string) {
	t.Helper()
	for _, u := range under {
		assert.True(t, slices.ContainsFunc(l.Runs, func(r runlog.RunLine) bool { return r.ID == u.ID && r.Token > u.Token && r.Recovered }),
			"%s: the %s handler (token %d) was not run again, Recovered", u.ID, what, u.Token)
	}
}
