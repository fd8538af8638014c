package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// result is what one run of the command did.
type result struct {
	code        int
	out, stderr string
}

// ctl runs the command with args and no terminal.
func ctl(args ...string) result { return ctlWith(console{in: strings.NewReader("")}, args...) }

// ctlTerminal runs the command on a terminal where the person types input.
func ctlTerminal(input string, args ...string) result {
	return ctlWith(console{in: strings.NewReader(input), terminal: true}, args...)
}

func ctlWith(con console, args ...string) result {
	var out, stderr bytes.Buffer
	con.out, con.err = &out, &stderr
	code := run(context.Background(), args, con)
	return result{code: code, out: out.String(), stderr: stderr.String()}
}

// url returns the -redis flag of a backend.
func url(b *redistest.Backend) string { return "redis://" + b.Client.Options().Addr }

// decode reads the JSON lines of out.
func decode[T any](t *testing.T, out string) []T {
	t.Helper()
	var all []T
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var v T
		require.NoError(t, json.Unmarshal([]byte(line), &v), "line %q", line)
		all = append(all, v)
	}
	return all
}

func TestInspect(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, err := idem.NewRedis(b.Client, idem.WithLease(time.Hour))
		require.NoError(t, err)
		ctx := context.Background()
		_, err = idem.Do(ctx, k, "tenant", "order-1", func(context.Context) (string, error) { return "paid", nil })
		require.NoError(t, err)
		done, err := k.Inspect(ctx, "tenant", "order-1")
		require.NoError(t, err)
		running, err := k.Begin(ctx, "tenant", "order-2", idem.WithFingerprint([]byte("body")))
		require.NoError(t, err)

		r := ctl("-redis", url(b), "inspect", "-scope", "tenant", "order-1")
		require.Equal(t, 0, r.code, r.stderr)
		for _, want := range []string{"record       " + done.Key, "state        completed", "attempt      1",
			"recovered    no", "fingerprint  no", "result       value, 5 bytes", "claimed      ", "expires in   "} {
			assert.Contains(t, r.out, want)
		}
		r = ctl("-redis", url(b), "-json", "inspect", "-scope", "tenant", "order-1")
		require.Equal(t, 0, r.code, r.stderr)
		j := decode[jsonRecord](t, r.out)[0]
		assert.Equal(t, "completed", j.State)
		assert.Equal(t, done.Token, j.Token)
		assert.Equal(t, "value", j.Result)
		require.NotNil(t, j.Size)
		assert.Equal(t, 5, *j.Size)
		assert.Nil(t, j.LeaseLeftMS)
		assert.Positive(t, j.ExpiresInMS)
		assert.LessOrEqual(t, j.ExpiresInMS, idem.DefaultRetention.Milliseconds())

		r = ctl("-redis", url(b), "inspect", "-scope", "tenant", "-json", "order-2")
		require.Equal(t, 0, r.code, r.stderr)
		j = decode[jsonRecord](t, r.out)[0]
		assert.Equal(t, "pending", j.State)
		assert.Equal(t, running.Claim.Token(), j.Token)
		assert.True(t, j.Fingerprint)
		require.NotNil(t, j.LeaseLeftMS)
		assert.Positive(t, *j.LeaseLeftMS)
		r = ctl("-redis", url(b), "inspect", "-scope", "tenant", "order-2")
		assert.Contains(t, r.out, "held by attempt 1 until ")
		assert.Contains(t, r.out, "whether its operation is running is not known", "Redis knows the lease, not the operation")

		r = ctl("-redis", url(b), "inspect", "-scope", "tenant", "order-3")
		require.Equal(t, 0, r.code, "an absent record is an answer, not a failure")
		assert.Contains(t, r.out, "state        absent")
		r = ctl("-redis", url(b), "-json", "inspect", "order-1")
		assert.Equal(t, "absent", decode[jsonRecord](t, r.out)[0].State, "another scope is another record")
	})
}

func TestForget(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, err := idem.NewRedis(b.Client, idem.WithLease(time.Hour))
		require.NoError(t, err)
		ctx := context.Background()
		state := func(key string) idem.RecordState {
			r, err := k.Inspect(ctx, "t", key)
			require.NoError(t, err)
			return r.State
		}
		_, err = idem.Do(ctx, k, "t", "done", func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)

		r := ctl("-redis", url(b), "forget", "-scope", "t", "done")
		assert.Equal(t, 2, r.code)
		assert.Contains(t, r.stderr, "pass -yes")
		r = ctlTerminal("n\n", "-redis", url(b), "forget", "-scope", "t", "done")
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, "forget this record? [y/N]")
		assert.Contains(t, r.stderr, "state        completed", "the record is shown before the question")
		assert.Equal(t, idem.StateCompleted, state("done"), "not confirmed: kept")

		r = ctlTerminal("y\n", "-redis", url(b), "forget", "-scope", "t", "done")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Contains(t, r.out, "forgot ")
		assert.Equal(t, idem.StateAbsent, state("done"))
		r = ctl("-redis", url(b), "forget", "-scope", "t", "done")
		assert.Equal(t, 0, r.code)
		assert.Contains(t, r.out, "nothing to forget")

		running, err := k.Begin(ctx, "t", "running")
		require.NoError(t, err)
		r = ctl("-redis", url(b), "forget", "-yes", "-scope", "t", "running")
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, "is held by a live lease")
		assert.Equal(t, idem.StatePending, state("running"))
		r = ctl("-redis", url(b), "-json", "forget", "-yes", "-force", "-scope", "t", "running")
		require.Equal(t, 0, r.code, r.stderr)
		var o forgetOutcome
		require.NoError(t, json.Unmarshal([]byte(r.out), &o))
		assert.True(t, o.Forgotten)
		assert.Equal(t, "pending", o.Record.State)
		assert.Equal(t, running.Claim.Token(), o.Record.Token)
		assert.ErrorIs(t, running.Claim.Complete(ctx, []byte("late"), 0), idem.ErrLeaseLost, "the holder is fenced off")
		assert.Equal(t, idem.StateAbsent, state("running"))
	})
}

func TestPending(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, err := idem.NewRedis(b.Client, idem.WithLease(time.Hour))
		require.NoError(t, err)
		ctx := context.Background()
		pending := map[string]int64{} // Redis key: token
		for _, key := range []string{"a", "b", "c"} {
			out, err := k.Begin(ctx, "s", key)
			require.NoError(t, err)
			r, err := k.Inspect(ctx, "s", key)
			require.NoError(t, err)
			pending[r.Key] = out.Claim.Token()
		}
		for _, key := range []string{"d", "e"} {
			_, err := idem.Do(ctx, k, "s", key, func(context.Context) (int, error) { return 1, nil })
			require.NoError(t, err)
		}

		r := ctl("-redis", url(b), "pending")
		require.Equal(t, 0, r.code, r.stderr)
		lines := strings.Split(strings.TrimSpace(r.out), "\n")
		require.Len(t, lines, 5, r.out)
		assert.True(t, strings.HasPrefix(lines[0], "KEY"))
		for key := range pending {
			assert.Contains(t, r.out, key)
		}
		assert.Equal(t, "3 pending records", lines[4])

		r = ctl("-redis", url(b), "pending", "-json", "-batch", "2")
		require.Equal(t, 0, r.code, r.stderr)
		got := map[string]int64{}
		for _, j := range decode[jsonRecord](t, r.out) {
			assert.Equal(t, "pending", j.State)
			got[j.Key] = j.Token
		}
		assert.Equal(t, pending, got)

		r = ctl("-redis", url(b), "-json", "pending", "-all")
		assert.Len(t, decode[jsonRecord](t, r.out), 5)
		r = ctl("-redis", url(b), "-json", "pending", "-limit", "2")
		assert.Len(t, decode[jsonRecord](t, r.out), 2)

		// A key from the listing names the record for inspect and forget.
		for key, token := range pending {
			r = ctl("-redis", url(b), "-json", "inspect", "-record", key)
			require.Equal(t, 0, r.code, r.stderr)
			assert.Equal(t, token, decode[jsonRecord](t, r.out)[0].Token)
			r = ctl("-redis", url(b), "forget", "-record", key, "-force", "-yes")
			require.Equal(t, 0, r.code, r.stderr)
			break
		}
		r = ctl("-redis", url(b), "-json", "pending")
		assert.Len(t, decode[jsonRecord](t, r.out), 2)
	})
}

// TestPendingCluster lists the pending records of every master.
func TestPendingCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	k, err := idem.NewRedis(c.Client(t, nil), idem.WithLease(time.Hour))
	require.NoError(t, err)
	ctx := context.Background()
	want := map[string]bool{}
	for i := range 20 {
		key := "order-" + string(rune('a'+i))
		_, err := k.Begin(ctx, "s", key)
		require.NoError(t, err)
		r, err := k.Inspect(ctx, "s", key)
		require.NoError(t, err)
		want[r.Key] = true
	}
	cluster := strings.Join(c.Addrs(), ",")
	r := ctl("-cluster", cluster, "-json", "pending", "-batch", "3")
	require.Equal(t, 0, r.code, r.stderr)
	got := map[string]bool{}
	for _, j := range decode[jsonRecord](t, r.out) {
		got[j.Key] = true
	}
	assert.Equal(t, want, got)

	r = ctl("-cluster", cluster, "-json", "inspect", "-scope", "s", "order-a")
	require.Equal(t, 0, r.code, r.stderr)
	assert.Equal(t, "pending", decode[jsonRecord](t, r.out)[0].State)
	r = ctl("-cluster", cluster, "forget", "-scope", "s", "-force", "-yes", "order-a")
	require.Equal(t, 0, r.code, r.stderr)

	// Markers on a Cluster, of a Keeper that places a scope's keys in
	// shards by default there, as idemctl does without -scope-shards.
	mk, err := idem.NewRedis(c.Client(t, nil))
	require.NoError(t, err)
	// Six messages in one shard, so that the Cluster keeps them compactly
	// (a slot's share of fewer than four is kept in records): the last
	// characters of a placed id name its shard.
	shard := func(m string) string { id := mk.RecordID("s", m); return id[len(id)-placedTagLen:] }
	msgs := []string{"m0"}
	for n := 1; len(msgs) < 6; n++ {
		if m := fmt.Sprint("m", n); shard(m) == shard("m0") {
			msgs = append(msgs, m)
		}
	}
	_, err = idem.Consume(ctx, mk, "s", msgs, func(s string) string { return s }, func(context.Context, string) error { return nil })
	require.NoError(t, err)
	r = ctl("-cluster", cluster, "-json", "inspect", "-scope", "s", msgs[3])
	require.Equal(t, 0, r.code, r.stderr)
	m4 := decode[jsonRecord](t, r.out)[0]
	assert.Equal(t, "completed", m4.State)
	assert.True(t, m4.Compact)
	r = ctl("-cluster", cluster, "-scope-shards", "0", "inspect", "-scope", "s", msgs[3])
	assert.Equal(t, 1, r.code, "-scope-shards 0 on a prefix of the Cluster's default placement: refused")
	assert.Contains(t, r.stderr, fmt.Sprintf("WithScopeShards(%d)", idem.ClusterScopeShards))
	r = ctl("-cluster", cluster, "-json", "pending", "-all")
	require.Equal(t, 0, r.code, r.stderr)
	markers := 0
	for _, j := range decode[jsonRecord](t, r.out) {
		if j.Compact && j.State == "completed" {
			markers += j.Claims
		}
	}
	assert.Equal(t, len(msgs), markers, "listed by call, on every master")
}

// TestMiddlewareRecords: a record of idemhttp's middleware, under a prefix
// of the demo's kind, is named by its tenant and Idempotency-Key, and is
// found by a listing that matches every run's prefix.
func TestMiddlewareRecords(t *testing.T) {
	b := redistest.Real(t)
	k, err := idem.NewRedis(b.Client, idem.WithPrefix("idem-demo:0a1b2c3d:"))
	require.NoError(t, err)
	guard, err := idemhttp.New(k, idemhttp.WithScope(func(r *http.Request) (string, error) { return r.Header.Get("Tenant"), nil }))
	require.NoError(t, err)
	api := guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"charge":"ch_1"}`))
	}))
	req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"amount":100}`))
	req.Header.Set("Idempotency-Key", "order-1")
	req.Header.Set("Tenant", "acme")
	api.ServeHTTP(httptest.NewRecorder(), req)

	r := ctl("-redis", url(b), "-json", "pending", "-all", "-match", "idem-demo:*:")
	require.Equal(t, 0, r.code, r.stderr)
	listed := decode[jsonRecord](t, r.out)
	require.Len(t, listed, 1)
	assert.Equal(t, "completed", listed[0].State)
	assert.Equal(t, "bytes", listed[0].Result, "a stored response is bytes in idemhttp's encoding")

	r = ctl("-redis", url(b), "-prefix", "idem-demo:0a1b2c3d:", "-json", "inspect", "-scope", "acme", "order-1")
	require.Equal(t, 0, r.code, r.stderr)
	named := decode[jsonRecord](t, r.out)[0]
	named.AgeMS, named.ExpiresInMS, named.ReadAt = listed[0].AgeMS, listed[0].ExpiresInMS, listed[0].ReadAt // read a moment apart
	assert.Equal(t, listed[0], named, "named by tenant and key: the same record")
	r = ctl("-redis", url(b), "-json", "inspect", "-record", listed[0].Key)
	assert.Equal(t, listed[0].Key, decode[jsonRecord](t, r.out)[0].Key)
}

func TestUsageErrors(t *testing.T) {
	b := redistest.Miniredis(t)
	for _, args := range [][]string{
		{},
		{"nonsense"},
		{"-nonsense", "inspect", "k"},
		{"-redis", url(b), "-cluster", "127.0.0.1:1", "inspect", "k"},
		{"-redis", "http://x", "inspect", "k"},
		{"-redis", url(b), "-prefix", "a{b", "inspect", "k"},
		{"-redis", url(b), "inspect"},
		{"-redis", url(b), "inspect", "a", "b"},
		{"-redis", url(b), "inspect", ""},
		{"-redis", url(b), "inspect", "-record", "idem:{short}"},
		{"-redis", url(b), "inspect", "-record", "no-braces"},
		{"-redis", url(b), "inspect", "-record", "idem:{AAAAAAAAAAAAAAAAAAAAAA}", "k"},
		{"-redis", url(b), "forget"},
		{"-redis", url(b), "forget", "-token", "x", "k"},
		{"-redis", url(b), "abandon"},
		{"-redis", url(b), "abandon", "-token", "-1", "k"},
		{"-redis", url(b), "abandon", "a", "b"},
		{"-redis", url(b), "pending", "extra"},
		{"-redis", url(b), "pending", "-batch", "5000"},
		{"-redis", url(b), "pending", "-match", "a{"},
	} {
		r := ctl(args...)
		assert.Equal(t, 2, r.code, "%q: %s", args, r.stderr)
		assert.NotEmpty(t, r.stderr, "%q says what is wrong", args)
	}
	assert.Equal(t, 0, ctl("-h").code)
	assert.Equal(t, 0, ctl("inspect", "-h").code)
}

// quietLogger drops go-redis's log lines, as main does.
func init() { redis.SetLogger(quietLogger{}) }

func TestUnavailable(t *testing.T) {
	b := redistest.Miniredis(t)
	addr := url(b)
	b.Stop()
	for _, args := range [][]string{{"inspect", "k"}, {"forget", "-yes", "k"}, {"abandon", "-yes", "k"}, {"pending"}} {
		r := ctl(append([]string{"-redis", addr}, args...)...)
		assert.Equal(t, 1, r.code, "%q", args)
		assert.Contains(t, r.stderr, "store unavailable", "%q", args)
	}
}

// TestScopeShards: the records of a Keeper made WithScopeShards are named
// by scope and key with -scope-shards, and by the key pending lists;
// without -scope-shards, a scope and key are refused, the prefix's
// placement named.
func TestScopeShards(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k, err := idem.NewRedis(b.Client, idem.WithLease(time.Hour), idem.WithScopeShards(4))
		require.NoError(t, err)
		ctx := context.Background()
		held, err := k.Begin(ctx, "t", "held")
		require.NoError(t, err)
		require.NotNil(t, held.Claim)

		r := ctl("-redis", url(b), "-json", "-scope-shards", "4", "inspect", "-scope", "t", "held")
		require.Equal(t, 0, r.code, r.stderr)
		got := decode[jsonRecord](t, r.out)[0]
		assert.Equal(t, "pending", got.State)
		assert.Equal(t, k.RecordID("t", "held"), got.ID)
		r = ctl("-redis", url(b), "-json", "inspect", "-scope", "t", "held")
		assert.Equal(t, 1, r.code, "without -scope-shards: refused, not another id")
		assert.Contains(t, r.stderr, "WithScopeShards(4)", "the prefix's placement is named")
		assert.Empty(t, r.out)

		r = ctl("-redis", url(b), "-json", "pending")
		require.Equal(t, 0, r.code, r.stderr)
		listed := decode[jsonRecord](t, r.out)
		require.Len(t, listed, 1)
		assert.Equal(t, got.Key, listed[0].Key)
		assert.Equal(t, got.ID, listed[0].ID)
		r = ctl("-redis", url(b), "forget", "-record", listed[0].Key, "-force", "-yes")
		require.Equal(t, 0, r.code, r.stderr)
		o, err := k.Inspect(ctx, "t", "held")
		require.NoError(t, err)
		assert.Equal(t, idem.StateAbsent, o.State, "forgotten by its Redis key")
	})
}
