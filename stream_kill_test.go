package idem

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/proc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStreamConsumerKill: three worker processes (internal/streamworker,
// built by the test) consume 200,000 entries, a fifth of them duplicate
// ids (half within a batch of their first, half far from it), and one is
// killed with SIGKILL mid-batch (while it holds entries it read). No id is lost, every entry is
// acknowledged, the handlers that ran again are those of the killed
// worker's settle window (and those running), and the killed worker's
// entries are acknowledged within the lease and a few seconds of the kill.
func TestStreamConsumerKill(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	const (
		entries     = 200_000
		batch       = 500
		concurrency = 8
		lease       = 2 * time.Second
	)

	bin := buildStreamWorker(t)

	// The ids: a fifth repeat an earlier one, half of those within the
	// last batch's width, half from anywhere before.
	r := rand.New(rand.NewPCG(26, 5))
	ids := make([]string, 0, entries)
	distinct := map[string]bool{}
	for len(ids) < entries {
		switch n := len(ids); {
		case n > batch && r.IntN(10) == 0:
			ids = append(ids, ids[n-1-r.IntN(batch)])
		case n > batch && r.IntN(9) == 0:
			ids = append(ids, ids[r.IntN(n)])
		default:
			id := "id-" + strconv.Itoa(n)
			ids = append(ids, id)
			distinct[id] = true
		}
	}
	for i := 0; i < len(ids); i += 10_000 {
		pipe := c.Pipeline()
		for _, id := range ids[i:min(i+10_000, len(ids))] {
			pipe.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: map[string]any{"id": id}})
		}
		_, err := pipe.Exec(ctx)
		require.NoError(t, err)
	}
	require.NoError(t, c.XGroupCreateMkStream(ctx, "s", "g", "0").Err())

	workers := make([]*exec.Cmd, 3)
	for i := range workers {
		w := exec.Command(bin, "-addr", srv.Addr, "-name", fmt.Sprint("w", i), "-lease", lease.String(),
			"-batch", fmt.Sprint(batch), "-concurrency", fmt.Sprint(concurrency))
		stdout, err := w.StdoutPipe()
		require.NoError(t, err)
		w.Stderr = &testWriter{t}
		require.NoError(t, proc.Start(w))
		workers[i] = w
		t.Cleanup(func() { _ = w.Process.Kill(); _ = w.Wait() })
		line, err := bufio.NewReader(stdout).ReadString('\n')
		require.NoError(t, err)
		require.Equal(t, "ready\n", line)
	}

	deadline := time.Now().Add(2 * time.Minute) // a bound, not a margin
	for c.HLen(ctx, "ran").Val() < int64(len(distinct)/4) {
		require.True(t, time.Now().Before(deadline), "the workers handled %d ids", c.HLen(ctx, "ran").Val())
		time.Sleep(5 * time.Millisecond)
	}
	// The worker is killed mid-batch: stopped (SIGSTOP), and killed only
	// while it holds entries it read and has not acknowledged; stopped
	// between two batches, it holds none and is let go on for a moment.
	// (Killed at once, it sometimes died between batches, and the test had
	// nothing to check.)
	var (
		pendingAtKill []redis.XPendingExt
		err           error
	)
	for {
		require.True(t, time.Now().Before(deadline), "worker w0 never held entries when stopped")
		require.NoError(t, workers[0].Process.Signal(syscall.SIGSTOP))
		pendingAtKill, err = c.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: "s", Group: "g", Consumer: "w0", Start: "-", End: "+", Count: 100_000}).Result()
		require.NoError(t, err)
		if len(pendingAtKill) > 0 {
			break
		}
		require.NoError(t, workers[0].Process.Signal(syscall.SIGCONT))
		time.Sleep(time.Millisecond)
	}
	killed := time.Now()
	require.NoError(t, workers[0].Process.Signal(syscall.SIGKILL))
	_ = workers[0].Wait()
	var lastOfKilled time.Time
	killedIDs := map[string]bool{}
	for _, p := range pendingAtKill {
		killedIDs[p.ID] = true
	}
	for {
		require.True(t, time.Now().Before(deadline), "entries still pending or unread")
		if len(killedIDs) > 0 {
			pend, err := c.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: "s", Group: "g", Start: "-", End: "+", Count: 100_000}).Result()
			require.NoError(t, err)
			still := map[string]bool{}
			for _, p := range pend {
				if killedIDs[p.ID] {
					still[p.ID] = true
				}
			}
			killedIDs = still
			if len(still) == 0 {
				lastOfKilled = time.Now()
			}
		}
		groups, err := c.XInfoGroups(ctx, "s").Result()
		require.NoError(t, err)
		if len(killedIDs) == 0 && groups[0].Pending == 0 && groups[0].Lag == 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("the killed worker held %d entries; all acknowledged %s after the kill", len(pendingAtKill), lastOfKilled.Sub(killed).Round(time.Millisecond))
	assert.Less(t, lastOfKilled.Sub(killed), lease+5*time.Second, "the killed worker's entries are acknowledged within the lease and a few seconds")

	ran, err := c.HGetAll(ctx, "ran").Result()
	require.NoError(t, err)
	lost, again := 0, 0
	for id := range distinct {
		switch n, _ := strconv.Atoi(ran[id]); {
		case n == 0:
			lost++
		case n > 1:
			again += n - 1
		}
	}
	t.Logf("%d entries, %d distinct ids: %d lost, %d runs again (bound %d: the settle window's count twice, and the handlers running)",
		entries, len(distinct), lost, again, 2*defaultSettleCount+concurrency)
	assert.Zero(t, lost, "ids never handled")
	assert.Equal(t, len(distinct), len(ran), "ids handled that were never sent")
	assert.LessOrEqual(t, again, 2*defaultSettleCount+concurrency, "handlers that ran again")
}

// buildStreamWorker builds internal/streamworker into a temporary
// directory and returns the binary's path.
func buildStreamWorker(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "streamworker")
	build := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", bin, "./internal/streamworker")
	var out bytes.Buffer
	build.Stdout, build.Stderr = &out, &out
	require.NoError(t, proc.Start(build))
	require.NoError(t, build.Wait(), "building the worker: %s", out.String())
	return bin
}

// testWriter writes a worker's stderr to the test's log.
type testWriter struct{ t *testing.T }

func (w *testWriter) Write(p []byte) (int, error) { w.t.Logf("worker: %s", p); return len(p), nil }
