package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/proc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// holderEnv, when set to a Redis address, makes the test binary the holder
// process of TestAbandonAKilledHolder instead of running the tests.
const holderEnv = "IDEMCTL_TEST_HOLDER"

func TestMain(m *testing.M) {
	if addr := os.Getenv(holderEnv); addr != "" {
		os.Exit(runHolder(addr))
	}
	os.Exit(m.Run())
}

// runHolder claims ("t", "order-1") with a lease of an hour, records the
// checkpoint "charged", prints its token, and keeps the claim (renewing it)
// until it is killed.
func runHolder(addr string) int {
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{Addr: addr})
	k, err := idem.NewRedis(client, idem.WithLease(time.Hour))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	out, err := k.Begin(ctx, "t", "order-1")
	if err == nil && out.Claim == nil {
		err = fmt.Errorf("no claim: %+v", out)
	}
	if err == nil {
		err = out.Claim.Checkpoint(ctx, "charged", []byte("ch_1"))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	_, stop := out.Claim.KeepAlive(ctx)
	defer stop()
	fmt.Printf("token %d\n", out.Claim.Token())
	select {} // the operation runs until the process is killed
}

// TestAbandonAKilledHolder: a process holding a claim with a long lease is
// killed (SIGKILL) after recording a checkpoint; the key stays in progress
// for the rest of the lease. idemctl abandon ends the lease by the token it
// shows, and the retry takes the key over at once: Recovered, attempt 2,
// the checkpoint handed over, and the dead holder's token fenced off.
func TestAbandonAKilledHolder(t *testing.T) {
	srv := redistest.Start(t)
	b := &redistest.Backend{Client: redistest.NewClient(t, srv.Addr), Real: true}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), holderEnv+"="+srv.Addr)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, proc.Start(cmd))
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err, "the holder never claimed the key")
	dead, err := strconv.ParseInt(strings.TrimPrefix(strings.TrimSpace(line), "token "), 10, 64)
	require.NoError(t, err, "holder said %q", line)
	require.NoError(t, cmd.Process.Kill()) // SIGKILL: no cleanup, no release
	_ = cmd.Wait()
	_, _ = io.Copy(io.Discard, stdout)

	ctx := context.Background()
	k, err := idem.NewRedis(b.Client, idem.WithLease(time.Hour))
	require.NoError(t, err)
	_, err = k.Begin(ctx, "t", "order-1")
	require.ErrorIs(t, err, idem.ErrInProgress, "the killed holder's lease still blocks the key")

	r := ctl("-redis", "redis://"+srv.Addr, "inspect", "-scope", "t", "order-1")
	require.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.out, fmt.Sprintf("token        %d", dead))
	assert.Contains(t, r.out, `checkpoints  1: "charged" (4 bytes)`)

	r = ctl("-redis", "redis://"+srv.Addr, "abandon", "-scope", "t", "-yes", "order-1")
	require.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.out, "abandoned ")
	assert.Contains(t, r.out, `told it is recovered, with checkpoints 1: "charged" (4 bytes)`)

	retry, err := k.Begin(ctx, "t", "order-1")
	require.NoError(t, err, "the retry runs at once, not after the hour of lease")
	require.NotNil(t, retry.Claim)
	assert.True(t, retry.Claim.Recovered())
	assert.Equal(t, 2, retry.Claim.Attempt())
	assert.Greater(t, retry.Claim.Token(), dead)
	v, ok := retry.Claim.Checkpointed("charged")
	assert.True(t, ok, "the checkpoint of the killed holder is handed over")
	assert.Equal(t, "ch_1", string(v))
	require.NoError(t, retry.Claim.Complete(ctx, []byte("done"), 0))
}

// TestAbandon: abandon shows the claim and asks; confirmed, it ends the
// lease and the next claim is recovered; a second abandon, or one of a
// completed record, does nothing and says so.
func TestAbandon(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k, err := idem.NewRedis(b.Client, idem.WithLease(time.Hour))
		require.NoError(t, err)
		dead, err := k.Begin(ctx, "t", "stuck")
		require.NoError(t, err)

		r := ctl("-redis", url(b), "abandon", "-scope", "t", "stuck")
		assert.Equal(t, 2, r.code)
		assert.Contains(t, r.stderr, "pass -yes")
		r = ctlTerminal("n\n", "-redis", url(b), "abandon", "-scope", "t", "stuck")
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, "abandon this claim? [y/N]")
		assert.Contains(t, r.stderr, "known to be dead")
		_, err = k.Begin(ctx, "t", "stuck")
		require.ErrorIs(t, err, idem.ErrInProgress, "not confirmed: nothing done")

		r = ctlTerminal("y\n", "-redis", url(b), "-json", "abandon", "-scope", "t", "stuck")
		require.Equal(t, 0, r.code, r.stderr)
		var o abandonOutcome
		require.NoError(t, json.Unmarshal([]byte(r.out), &o))
		assert.True(t, o.Abandoned)
		assert.Equal(t, dead.Claim.Token(), o.Record.Token)
		require.NotNil(t, o.Record.LeaseLeftMS)
		assert.LessOrEqual(t, *o.Record.LeaseLeftMS, int64(0))

		r = ctl("-redis", url(b), "abandon", "-yes", "-scope", "t", "stuck")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Contains(t, r.out, "nothing to abandon: the lease of")

		next, err := k.Begin(ctx, "t", "stuck")
		require.NoError(t, err)
		assert.True(t, next.Claim.Recovered())
		require.NoError(t, next.Claim.Complete(ctx, []byte("done"), 0))
		r = ctl("-redis", url(b), "abandon", "-yes", "-scope", "t", "stuck")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Contains(t, r.out, "nothing to abandon: ")
		assert.Contains(t, r.out, "is completed")
		r = ctl("-redis", url(b), "abandon", "-yes", "-scope", "t", "never")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Contains(t, r.out, "nothing to abandon")
	})
}

// TestAbandonLeavesAClaimMadeWhileAsking: a claim made while the operator
// read the prompt (the lease of the one shown ran out, and a redelivery took
// the key over) is not the one abandoned.
func TestAbandonLeavesAClaimMadeWhileAsking(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k, err := idem.NewRedis(b.Client, idem.WithLease(300*time.Millisecond))
		require.NoError(t, err)
		_, err = k.Begin(ctx, "t", "stuck")
		require.NoError(t, err)
		redelivery, err := idem.NewRedis(b.Client, idem.WithLease(time.Minute))
		require.NoError(t, err)
		var live *idem.Claim
		in := &whileReading{r: strings.NewReader("y\n"), f: func() {
			b.Advance(400 * time.Millisecond)
			out, err := redelivery.Begin(ctx, "t", "stuck")
			require.NoError(t, err)
			require.True(t, out.Claim.Recovered())
			live = out.Claim
		}}
		r := ctlWith(console{in: in, terminal: true}, "-redis", url(b), "abandon", "-scope", "t", "stuck")
		require.NotNil(t, live)
		require.Equal(t, 0, r.code, r.stderr)
		assert.Contains(t, r.out, "nothing to abandon")
		assert.Contains(t, r.out, "which was left alone")
		_, err = redelivery.Begin(ctx, "t", "stuck")
		assert.ErrorIs(t, err, idem.ErrInProgress, "the live claim's lease is untouched")
		require.NoError(t, live.Complete(ctx, []byte("done"), 0))
	})
}

// TestForgetByToken: forget -token removes the record only if its token is
// the one named; another is left alone, and the command says so.
func TestForgetByToken(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k, err := idem.NewRedis(b.Client, idem.WithLease(time.Hour))
		require.NoError(t, err)
		_, err = idem.Do(ctx, k, "t", "done", func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
		rec, err := k.Inspect(ctx, "t", "done")
		require.NoError(t, err)

		r := ctl("-redis", url(b), "forget", "-yes", "-scope", "t", "-token", strconv.FormatInt(rec.Token+1, 10), "done")
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, "not forgotten")
		assert.Contains(t, r.stderr, "which was left alone")
		again, err := k.Inspect(ctx, "t", "done")
		require.NoError(t, err)
		assert.Equal(t, idem.StateCompleted, again.State)

		r = ctl("-redis", url(b), "forget", "-yes", "-scope", "t", "-token", strconv.FormatInt(rec.Token, 10), "done")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Contains(t, r.out, "forgot ")
		r = ctl("-redis", url(b), "forget", "-yes", "-scope", "t", "-token", "-3", "done")
		assert.Equal(t, 2, r.code)
	})
}

// TestForgetRefusesCheckpoints: forget without -force refuses a record whose
// lease ran out but that holds checkpoints, and names them; inspect shows
// them, by name and size, in text and JSON.
func TestForgetRefusesCheckpoints(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		const lease = 200 * time.Millisecond
		k, err := idem.NewRedis(b.Client, idem.WithLease(lease))
		require.NoError(t, err)
		out, err := k.Begin(ctx, "t", "order-1")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Checkpoint(ctx, "charged", []byte("ch_1")))
		require.NoError(t, out.Claim.Checkpoint(ctx, "label printed", nil))
		b.Advance(lease + 50*time.Millisecond) // the holder died; the lease ran out

		r := ctl("-redis", url(b), "inspect", "-scope", "t", "order-1")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Contains(t, r.out, `checkpoints  2: "charged" (4 bytes), "label printed" (0 bytes)`)
		assert.Contains(t, r.out, "its holder stopped renewing it")
		r = ctl("-redis", url(b), "-json", "inspect", "-scope", "t", "order-1")
		j := decode[jsonRecord](t, r.out)[0]
		assert.Equal(t, []jsonCheckpoint{{"charged", 4}, {"label printed", 0}}, j.Checkpoints)
		assert.NotEmpty(t, j.LeaseEnd)
		assert.NotEmpty(t, j.ReadAt)

		r = ctl("-redis", url(b), "forget", "-yes", "-scope", "t", "order-1")
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, "holds checkpoints")
		assert.Contains(t, r.stderr, `"charged" (4 bytes)`)
		next, err := k.Begin(ctx, "t", "order-1")
		require.NoError(t, err)
		assert.True(t, next.Claim.Recovered(), "not forgotten: the next attempt takes it over")
		_, ok := next.Claim.Checkpointed("charged")
		assert.True(t, ok)
	})
}

// whileReading runs f once, when the command first reads the answer.
type whileReading struct {
	r    io.Reader
	f    func()
	done bool
}

func (w *whileReading) Read(p []byte) (int, error) {
	if !w.done {
		w.done = true
		w.f()
	}
	return w.r.Read(p)
}

// TestForgetRemovesOnlyTheRecordItShowed: forget shows a record and asks;
// the record removed must be the one shown (same token), or nothing: a
// claim made while the operator read the prompt (a redelivery taking the
// abandoned key over) is not removed, even with -force.
func TestForgetRemovesOnlyTheRecordItShowed(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k, err := idem.NewRedis(b.Client, idem.WithLease(300*time.Millisecond))
		require.NoError(t, err)
		dead, err := k.Begin(ctx, "t", "stuck") // its process died
		require.NoError(t, err)
		b.Advance(400 * time.Millisecond) // its lease has run out: "abandoned"
		redelivery, err := idem.NewRedis(b.Client, idem.WithLease(time.Minute))
		require.NoError(t, err)

		var live *idem.Claim
		in := &whileReading{r: strings.NewReader("y\n"), f: func() {
			out, err := redelivery.Begin(ctx, "t", "stuck") // a redelivery takes the key over
			require.NoError(t, err)
			require.True(t, out.Claim.Recovered())
			live = out.Claim
		}}
		r := ctlWith(console{in: in, terminal: true}, "-redis", url(b), "forget", "-force", "-scope", "t", "stuck")
		require.NotNil(t, live)
		t.Logf("shown token %d, live token %d; exit %d: %s%s", dead.Claim.Token(), live.Token(), r.code, r.out, r.stderr)

		_, err = redelivery.Begin(ctx, "t", "stuck")
		assert.ErrorIs(t, err, idem.ErrInProgress, "idemctl removed a live claim it never showed: the next call runs the operation beside it")
		assert.Equal(t, 1, r.code, "not forgotten: the record shown was replaced")
		assert.Contains(t, r.stderr, "which was left alone")
	})
}

// TestCompactClaimsAndMarkers: a message handled by Consume has no record
// of its own: inspect finds its marker in the index, forget removes it,
// and pending lists the markers and compact claims by call; an index of
// another layout is refused.
func TestCompactClaimsAndMarkers(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k, err := idem.NewRedis(b.Client, idem.WithLease(time.Hour))
		require.NoError(t, err)
		_, err = idem.Consume(ctx, k, "t", []string{"m1", "m2"}, func(s string) string { return s },
			func(context.Context, string) error { return nil })
		require.NoError(t, err)
		// "held": a Consume whose handler is still running holds a compact
		// claim of it.
		running, release, consumed := make(chan struct{}), make(chan struct{}), make(chan error, 1)
		go func() {
			_, err := idem.Consume(ctx, k, "t", []string{"held"}, func(s string) string { return s },
				func(context.Context, string) error { close(running); <-release; return nil })
			consumed <- err
		}()
		<-running
		var once sync.Once
		done := func() { once.Do(func() { close(release) }) }
		defer done()

		r := ctl("-redis", url(b), "inspect", "-scope", "t", "m1")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Contains(t, r.out, "a marker in the index")
		assert.Contains(t, r.out, "completed")

		r = ctl("-redis", url(b), "-json", "inspect", "-scope", "t", "held")
		require.Equal(t, 0, r.code, r.stderr)
		held := decode[jsonRecord](t, r.out)[0]
		assert.Equal(t, "pending", held.State)
		assert.True(t, held.Compact)

		r = ctl("-redis", url(b), "pending", "-all")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Contains(t, r.out, "2 markers of this call")
		assert.Contains(t, r.out, "1 compact claims of this call")

		r = ctl("-redis", url(b), "-json", "pending")
		require.Equal(t, 0, r.code, r.stderr)
		rows := decode[jsonRecord](t, r.out)
		require.Len(t, rows, 1)
		assert.Equal(t, 1, rows[0].Claims)
		assert.Empty(t, rows[0].ID)
		done()
		require.NoError(t, <-consumed)

		r = ctl("-redis", url(b), "forget", "-yes", "-scope", "t", "m1")
		require.Equal(t, 0, r.code, r.stderr)
		out, err := k.Begin(ctx, "t", "m1")
		require.NoError(t, err)
		require.NotNil(t, out.Claim, "forgotten: claimed again")

		require.NoError(t, b.Client.HSet(ctx, "idem:i3", "", "v1 scale=5000").Err())
		r = ctl("-redis", url(b), "inspect", "-scope", "t", "m2")
		assert.Equal(t, 1, r.code, "an index of another layout")
		assert.Contains(t, r.stderr, "v1 scale=5000")
	})
}
