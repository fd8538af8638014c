package idem

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestScriptCost logs what Redis spends on each script path, per call, from
// INFO commandstats deltas on a real redis-server the test starts, beside the
// plain commands that are the floor of the same work: a GET of a stored
// 200-byte result for a replay, SET NX PX then SET XX PX for a first
// execution. It asserts nothing about speed; it is the measurement the
// scripts are tuned against:
//
//	IDEM_REQUIRE_REDIS=1 go test -count=1 -v -run TestScriptCost .
//
// Every path runs n calls, by one caller (one call after another) and by 64
// concurrent callers, in rounds; the table gives the median and the minimum
// of the rounds. A script's cost is its EVALSHA line (and EVAL's, which is
// none once the scripts are loaded): on Redis 7 the commands a script calls
// are also counted on their own lines, and are not added again. A batch
// script's cost is given per record. "process" is the server's whole CPU
// time (INFO cpu) over the same calls, reading and writing the network
// included.
//
// It asserts how many commands (redis.call) the claim and the settle calls
// of a Consume call make, at batches of 3 and 500 (consumeCommandBounds):
// counts, exact on a given Redis, not speed.
func TestScriptCost(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 64})
	t.Cleanup(func() { c.Close() })
	s, err := openRedisStore(c)
	require.NoError(t, err)
	require.NoError(t, s.LoadScripts(context.Background()))
	for _, sc := range []*redis.Script{floorClaim, floorComplete, floorReplay} {
		require.NoError(t, sc.Load(context.Background(), c).Err())
	}
	n, rounds := 1000, 3
	if testing.Short() {
		n, rounds = 200, 2
	}
	m := &costMeter{t: t, c: c, n: n}
	for r := range rounds {
		for _, callers := range []int{1, 64} {
			m.round, m.callers = fmt.Sprintf("%d-%d-", r, callers), callers
			costScripts(t, m, s)
			costBatches(t, m, s)
			costFloors(m)
		}
	}
	t.Logf("Redis CPU per call, µs: %d rounds of %d calls per path, median (min) of the rounds, redis-server %s\n%s",
		rounds, n, m.version(), m.table())
	costConsumeCommands(t, c)
}

// consumeCommandBounds are the most commands (redis.call from a script) that
// the claim calls and the settle calls of one Consume call may make, by batch
// size, for a batch of new messages and for one in which a fifth were
// handled before. They are the counts of a run on Redis 7.0.15
// (TestScriptCost logs them), so that a change to the scripts that adds a
// command fails here and one that removes some lowers them.
// A batch of 500 is one script call of each (v3Chunk is 1000). The index's
// TTL upkeep (PEXPIRE) is due in some calls only, by Redis's clock: it is
// bounded apart, once a call at most.
var consumeCommandBounds = map[int]struct{ claimNew, settleNew, claimAgain, settleAgain int64 }{
	3:   {claimNew: 5, settleNew: 4, claimAgain: 6, settleAgain: 4},
	500: {claimNew: 5, settleNew: 4, claimAgain: 6, settleAgain: 4},
}

// costConsumeCommands counts the commands that the two script calls of a
// Consume call make (INFO commandstats: on Redis 7 a script's commands are
// counted on their own lines), the claim's apart from the settle's: the
// count is read again when the first handler runs, after the claim call has
// returned and before the settle (one settle for the batch: the handlers
// return within the settle window). It asserts them against
// consumeCommandBounds.
func costConsumeCommands(t *testing.T, c *redis.Client) {
	ctx := context.Background()
	for _, size := range []int{3, 500} {
		k, err := NewRedis(c, WithPrefix(fmt.Sprintf("cmds%d:", size)), WithLease(time.Hour))
		require.NoError(t, err)
		require.NoError(t, k.store.(*redisStore).LoadScripts(ctx))
		count := func(batch []string) (claim, settle map[string]int64) {
			before := commandCalls(t, c)
			var mid map[string]int64
			_, err := Consume(ctx, k, "s", batch, func(s string) string { return s }, func(context.Context, string) error {
				if mid == nil {
					mid = commandCalls(t, c)
				}
				return nil
			}, WithSettleWindow(time.Hour, len(batch)))
			require.NoError(t, err)
			after := commandCalls(t, c)
			return callsBetween(before, mid), callsBetween(mid, after)
		}
		// Then a batch of as many, a fifth of them (one at least) handled
		// by the first.
		first, again := make([]string, size), make([]string, size)
		for i := range first {
			first[i], again[i] = fmt.Sprint("first-", i), fmt.Sprint("again-", i)
		}
		done := max(1, size/5)
		copy(again, first[:done])
		claimNew, settleNew := count(first)
		claimAgain, settleAgain := count(again)
		bound, chunk := consumeCommandBounds[size], v3Chunk
		for _, x := range []struct {
			what  string
			calls map[string]int64
			bound int64
		}{
			{fmt.Sprintf("claim of %d new", size), claimNew, bound.claimNew},
			{fmt.Sprintf("settle of %d new", size), settleNew, bound.settleNew},
			{fmt.Sprintf("claim of %d, %d handled before", size, done), claimAgain, bound.claimAgain},
			{fmt.Sprintf("settle of %d, %d handled before", size, done), settleAgain, bound.settleAgain},
		} {
			scripts, commands := x.calls["evalsha"]+x.calls["eval"], int64(0)
			for name, n := range x.calls {
				if name != "evalsha" && name != "eval" && name != "pexpire" {
					commands += n
				}
			}
			t.Logf("Consume, batch %d, %s: %d script call(s), %d commands and %d PEXPIRE %v", size, x.what, scripts, commands, x.calls["pexpire"], x.calls)
			assert.EqualValues(t, (size+chunk-1)/chunk, scripts, "batch %d, %s: a script call a chunk", size, x.what)
			assert.LessOrEqual(t, commands, x.bound, "batch %d, %s: commands in the script calls, PEXPIRE aside", size, x.what)
			assert.LessOrEqual(t, x.calls["pexpire"], scripts, "batch %d, %s: the index's TTL renewed once a call at most", size, x.what)
		}
	}
}

// commandCalls reads the calls of each command from INFO commandstats.
func commandCalls(t *testing.T, c *redis.Client) map[string]int64 {
	info, err := c.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	calls := map[string]int64{}
	for _, line := range strings.Split(info, "\r\n") {
		name, fields, ok := strings.Cut(line, ":")
		cmd, isCmd := strings.CutPrefix(name, "cmdstat_")
		if !ok || !isCmd {
			continue
		}
		for _, f := range strings.Split(fields, ",") {
			if v, ok := strings.CutPrefix(f, "calls="); ok {
				calls[cmd], _ = strconv.ParseInt(v, 10, 64)
			}
		}
	}
	return calls
}

// callsBetween is what each command's calls grew by from before to after,
// the INFO reads themselves and a new connection's commands left out.
func callsBetween(before, after map[string]int64) map[string]int64 {
	out := map[string]int64{}
	for cmd, n := range after {
		switch cmd {
		case "info", "hello", "ping", "auth", "select":
			continue
		}
		if strings.HasPrefix(cmd, "client|") {
			continue
		}
		if d := n - before[cmd]; d > 0 {
			out[cmd] = d
		}
	}
	return out
}

// costLease and costKeep are the lease and the pending record's time to live
// of the measured claims.
const costLease, costKeep = 30 * time.Second, time.Hour

// costScripts measures each single-record script path, every phase on the
// records the phase before left.
func costScripts(t *testing.T, m *costMeter, s *redisStore) {
	ctx := context.Background()
	payload := costPayload()
	fp := fingerprintDigest([]byte(`{"amount":1000,"currency":"EUR"}`))
	toks := make([]int64, m.n)
	claim := func(ids []string, fp, attempt string, want claimStatus) func(i int) error {
		return func(i int) error {
			r, err := s.Claim(ctx, ids[i], claimRequest{Fingerprint: fp, Attempt: attempt, Lease: costLease, Keep: costKeep})
			if err == nil && r.Status != want {
				err = fmt.Errorf("claim status %d, want %d", r.Status, want)
			}
			if want == statusClaimed {
				toks[i] = r.Token
			}
			return err
		}
	}
	complete := func(ids []string) func(i int) error {
		return func(i int) error { return errOf(s.Complete(ctx, ids[i], toks[i], payload, costKeep)) }
	}

	a := m.ids("a")
	m.measure("claim, new key", scriptStats, claim(a, "", "first", statusClaimed))
	m.measure("complete", scriptStats, complete(a))
	m.measure("replay (claim of a completed record)", scriptStats, claim(a, "", "replayer", statusCompleted))

	f := m.ids("f")
	m.measure("claim, new key, fingerprint", scriptStats, claim(f, fp, "first", statusClaimed))
	m.measure("complete, fingerprint", scriptStats, complete(f))
	m.measure("replay, fingerprint", scriptStats, claim(f, fp, "replayer", statusCompleted))

	p := m.ids("p")
	m.prepare(claim(p, fp, "first", statusClaimed))
	m.measure("in progress (claim of a live lease)", scriptStats, claim(p, fp, "other", statusInProgress))
	m.measure("extend", scriptStats, func(i int) error { return s.Extend(ctx, p[i], toks[i], costLease, costKeep) })
	m.measure("checkpoint", scriptStats, func(i int) error {
		return s.Checkpoint(ctx, claimFence{ID: p[i], Token: toks[i]}, "charged", []byte("ch_1"), 0)
	})
	m.measure("release, with a checkpoint", scriptStats, func(i int) error { return s.Release(ctx, p[i], toks[i], costKeep) })
	m.measure("claim after release, checkpoint carried", scriptStats, claim(p, fp, "second", statusClaimed))

	r := m.ids("r")
	m.prepare(claim(r, "", "first", statusClaimed))
	m.measure("release", scriptStats, func(i int) error { return s.Release(ctx, r[i], toks[i], costKeep) })
}

// costBatches measures the batch scripts per record: each caller claims,
// completes and replays its share of the records in calls of batchChunk.
func costBatches(t *testing.T, m *costMeter, s *redisStore) {
	ctx := context.Background()
	payload := costPayload()
	ids := m.ids("b")
	toks := make([]int64, m.n)
	shares := m.shares()
	batches := func(f func(ids []string, from int) error) func(i int) error {
		return func(i int) error {
			from, to := shares[i][0], shares[i][1]
			return f(ids[from:to], from)
		}
	}
	claim := func(attempt string, want claimStatus) func(i int) error {
		return batches(func(ids []string, from int) error {
			for j, r := range s.ClaimBatch(ctx, batchClaimRequest{IDs: ids, Attempt: attempt, Lease: costLease, Keep: costKeep}) {
				if r.Err != nil || r.Reply.Status != want {
					return fmt.Errorf("batch claim: status %d, want %d: %v", r.Reply.Status, want, r.Err)
				}
				toks[from+j] = r.Reply.Token
			}
			return nil
		})
	}
	m.measureShares("batch claim, new keys", len(shares), claim("first", statusClaimed))
	m.measureShares("batch complete", len(shares), batches(func(ids []string, from int) error {
		items := make([]batchCompletion, len(ids))
		for j, id := range ids {
			items[j] = batchCompletion{claimFence: claimFence{ID: id, Token: toks[from+j]}, Value: payload, Keep: costKeep}
		}
		for _, err := range s.CompleteBatch(ctx, items) {
			if err != nil {
				return err
			}
		}
		return nil
	}))
	m.measureShares("batch claim, replays", len(shares), claim("replayer", statusCompleted))
}

// costFloors measures the plain commands that do the same work as a first
// execution and as a replay, with values of the sizes of the records.
func costFloors(m *costMeter) {
	ctx := context.Background()
	keys := m.ids("floor")
	for i := range keys {
		keys[i] = "floor:{" + keys[i] + "}"
	}
	pending := strings.Repeat("p", 46)
	result := strings.Repeat("x", 46+2+benchBody)
	m.measure("floor: SET NX PX (claim)", []string{"set"}, func(i int) error {
		return m.c.SetNX(ctx, keys[i], pending, costKeep).Err()
	})
	m.measure("floor: SET XX PX (complete)", []string{"set"}, func(i int) error {
		return m.c.SetXX(ctx, keys[i], result, costKeep).Err()
	})
	m.measure("floor: GET of the result (replay)", []string{"get"}, func(i int) error {
		return m.c.Get(ctx, keys[i]).Err()
	})
	// The least a script can do for each step: what EVALSHA itself costs.
	m.measure("script floor: GET, SET PX if none (claim)", scriptStats, func(i int) error {
		return floorClaim.Run(ctx, m.c, []string{keys[i] + "s"}, pending, costKeep.Milliseconds()).Err()
	})
	m.measure("script floor: GET, SET PX (complete)", scriptStats, func(i int) error {
		return floorComplete.Run(ctx, m.c, []string{keys[i] + "s"}, result, costKeep.Milliseconds()).Err()
	})
	m.measure("script floor: GET, a byte test (replay)", scriptStats, func(i int) error {
		return floorReplay.Run(ctx, m.c, []string{keys[i] + "s"}).Err()
	})
}

// The floor scripts: a claim, a completion and a replay reduced to their
// commands.
var (
	floorClaim = redis.NewScript(`if not redis.call('GET', KEYS[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0`)
	floorComplete = redis.NewScript(`local v = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1`)
	floorReplay = redis.NewScript(`local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 1) == 120 then
  return v
end
return 0`)
)

// costPayload is a 200-byte result in its envelope.
func costPayload() []byte {
	return append([]byte{envelopeV1, kindBytes}, bytes.Repeat([]byte("x"), benchBody)...)
}

// scriptStats are the INFO commandstats lines of script calls.
var scriptStats = []string{"evalsha", "eval"}

// costMeter measures phases of n operations by INFO deltas, in rounds.
type costMeter struct {
	t *testing.T
	c *redis.Client
	n int
	// round names the round under way, so that each has its own keys;
	// callers is how many goroutines make its calls.
	round   string
	callers int
	// names are the paths in the order first measured; samples, each
	// round's figures of a path, by caller count.
	names   []string
	samples map[costSeries][]costSample
}

type costSeries struct {
	path    string
	callers int
}

// costSample is a path's Redis CPU per operation in one round: the command
// lines' usec, and the server process's CPU.
type costSample struct{ usec, process float64 }

// ids returns m.n record ids of the round's group.
func (m *costMeter) ids(group string) []string {
	out := make([]string, m.n)
	for i := range out {
		out[i] = recordID("cost", m.round+group+strconv.Itoa(i))
	}
	return out
}

// prepare runs op for 0..n-1, unmeasured.
func (m *costMeter) prepare(op func(i int) error) {
	require.NoError(m.t, m.run(m.n, op))
}

// measure runs op for 0..n-1 over m.callers goroutines and keeps the Redis
// CPU per operation, of the commandstats lines commands.
func (m *costMeter) measure(path string, commands []string, op func(i int) error) {
	m.measureLines(path, commands, m.n, op)
}

// measureShares runs op for 0..calls-1 over m.callers goroutines, where the
// calls make m.n operations (records, for a batch script) in all, and keeps
// the Redis CPU per operation of script calls.
func (m *costMeter) measureShares(path string, calls int, op func(i int) error) {
	m.measureLines(path, scriptStats, calls, op)
}

// measureLines runs op for 0..calls-1 over m.callers goroutines, where the
// calls make m.n operations in all, and keeps the Redis CPU per operation of
// the commandstats lines commands.
func (m *costMeter) measureLines(path string, commands []string, calls int, op func(i int) error) {
	before := m.read()
	err := m.run(calls, op)
	after := m.read()
	require.NoError(m.t, err, path)
	var usec int64
	for _, c := range commands {
		usec += after.usec[c] - before.usec[c]
	}
	if m.samples == nil {
		m.samples = map[costSeries][]costSample{}
	}
	if !slices.Contains(m.names, path) {
		m.names = append(m.names, path)
	}
	ops := float64(m.n)
	k := costSeries{path, m.callers}
	m.samples[k] = append(m.samples[k], costSample{usec: float64(usec) / ops, process: (after.cpu - before.cpu) / ops})
}

// run runs op for 0..calls-1 over m.callers goroutines and returns the first
// error.
func (m *costMeter) run(calls int, op func(i int) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, m.callers)
	for g := range m.callers {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < calls; i = int(next.Add(1)) - 1 {
				if errs[g] = op(i); errs[g] != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// shares cuts 0..n-1 into the ranges of records each batch call holds.
func (m *costMeter) shares() [][2]int {
	var out [][2]int
	for from := 0; from < m.n; from += batchChunk {
		out = append(out, [2]int{from, min(from+batchChunk, m.n)})
	}
	return out
}

// costReading is one read of INFO: usec per command, and the process's CPU
// (user + system) in microseconds.
type costReading struct {
	usec map[string]int64
	cpu  float64
}

func (m *costMeter) read() costReading {
	info, err := m.c.Info(context.Background(), "commandstats", "cpu").Result()
	require.NoError(m.t, err)
	r := costReading{usec: map[string]int64{}}
	for _, line := range strings.Split(info, "\r\n") {
		name, fields, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		if cmd, ok := strings.CutPrefix(name, "cmdstat_"); ok {
			for _, f := range strings.Split(fields, ",") {
				if v, ok := strings.CutPrefix(f, "usec="); ok {
					r.usec[cmd], _ = strconv.ParseInt(v, 10, 64)
				}
			}
		}
		if name == "used_cpu_sys" || name == "used_cpu_user" {
			sec, _ := strconv.ParseFloat(fields, 64)
			r.cpu += sec * 1e6
		}
	}
	return r
}

func (m *costMeter) version() string {
	info, err := m.c.Info(context.Background(), "server").Result()
	require.NoError(m.t, err)
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "redis_version:"); ok {
			return v
		}
	}
	return "?"
}

// table formats the figures: per path, the commands' CPU by one and by 64
// callers, and the process's CPU by 64.
func (m *costMeter) table() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "  %-42s %15s %15s %15s\n", "path", "1 caller", "64 callers", "process, 64")
	for _, path := range m.names {
		one, many := m.samples[costSeries{path, 1}], m.samples[costSeries{path, 64}]
		fmt.Fprintf(&sb, "  %-42s %15s %15s %15s\n", path,
			medianMin(one, func(s costSample) float64 { return s.usec }),
			medianMin(many, func(s costSample) float64 { return s.usec }),
			medianMin(many, func(s costSample) float64 { return s.process }))
	}
	return sb.String()
}

// medianMin formats the median and the minimum of f over samples.
func medianMin(samples []costSample, f func(costSample) float64) string {
	if len(samples) == 0 {
		return "-"
	}
	xs := make([]float64, len(samples))
	for i, s := range samples {
		xs[i] = f(s)
	}
	slices.Sort(xs)
	return fmt.Sprintf("%.2f (%.2f)", xs[len(xs)/2], xs[0])
}

// TestRecordMemory holds a completed record with a 200-byte result to at most
// 350 bytes of Redis memory, as MEMORY USAGE counts it (value, key and the
// keyspace entry). It needs a real redis-server: miniredis has no MEMORY.
func TestRecordMemory(t *testing.T) {
	b := redistest.Real(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	body := bytes.Repeat([]byte("x"), 200)
	usage := func(key string) int64 {
		t.Helper()
		n, err := b.Client.MemoryUsage(ctx, DefaultPrefix+"{"+recordID("tenant-42", key)+"}").Result()
		require.NoError(t, err)
		t.Logf("%s: %d bytes", key, n)
		return n
	}
	fp := WithFingerprint([]byte(`{"amount":1000,"currency":"EUR"}`))

	_, err := Do(ctx, k, "tenant-42", "do-bytes", func(ctx context.Context) ([]byte, error) { return body, nil }, fp)
	require.NoError(t, err)
	assert.LessOrEqual(t, usage("do-bytes"), int64(350))

	out, err := k.Begin(ctx, "tenant-42", "complete", fp)
	require.NoError(t, err)
	require.NoError(t, out.Claim.Complete(ctx, body, 0))
	assert.LessOrEqual(t, usage("complete"), int64(350))
}
