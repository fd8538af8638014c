package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The equivalence of the batch API and the single-key API: the same sequence
// of operations on the same keys, once through Begin and the Claim methods
// (scope "single") and once through BeginBatch, CompleteBatch, ReleaseBatch
// and ExtendBatch (scope "batch"), must give the same answers, key by key.
// Leases run out by an operation that moves the lease end of the records of
// both scopes into the past, so that no answer depends on how fast the
// machine runs.

// twinPath is one of the two ways through the API, with the claims it holds.
type twinPath struct {
	scope string
	batch bool
	k     *Keeper
	held  map[string]*Claim // the current claim of each key
	stale map[string]*Claim // a claim of each key that was taken over
	token map[string]int64  // the last token seen for each key
}

// answer is an API answer reduced to what both paths must agree on: tokens
// differ (they come from Redis's clock), so only whether a token went up, or
// matched the holder's, is kept.
type answer struct {
	What        string // "claimed", "replayed", or the error's class
	Attempt     int
	Recovered   bool
	Value       string
	Checkpoints string
	TokenUp     bool // a claim's token is above every earlier one of the key
	TokenOwn    bool // a replay's token is that of the claim that completed
}

func errClass(err error) string {
	for _, c := range []struct {
		err  error
		name string
	}{
		{ErrInvalidKey, "invalid-key"}, {ErrInProgress, "in-progress"}, {ErrMismatch, "mismatch"},
		{ErrCorrupt, "corrupt"}, {ErrLeaseLost, "lease-lost"}, {ErrDuplicate, "duplicate"},
		{ErrInvalidCheckpoint, "invalid-checkpoint"}, {ErrInvalidConfig, "invalid-config"},
		{ErrUnavailable, "unavailable"},
	} {
		if errors.Is(err, c.err) {
			return c.name
		}
	}
	if err == nil {
		return "ok"
	}
	return err.Error()
}

func cpString(cps []recoveryPoint) string {
	var b strings.Builder
	for _, cp := range cps {
		fmt.Fprintf(&b, "%s=%s;", cp.Name, cp.Value)
	}
	return b.String()
}

func (p *twinPath) outcomeAnswer(key string, out Outcome, err error) answer {
	if err != nil {
		return answer{What: errClass(err)}
	}
	if out.Replayed {
		return answer{What: "replayed", Value: string(out.Value), TokenOwn: out.Token == p.token[key]}
	}
	c := out.Claim
	a := answer{What: "claimed", Attempt: c.Attempt(), Recovered: c.Recovered(), Checkpoints: cpString(c.allCheckpoints()), TokenUp: c.Token() > p.token[key]}
	p.token[key] = c.Token()
	if old := p.held[key]; old != nil {
		p.stale[key] = old
	}
	p.held[key] = c
	return a
}

func (p *twinPath) claim(t *testing.T, keys []string, fps [][]byte) []answer {
	ctx := context.Background()
	out := make([]answer, len(keys))
	if !p.batch {
		for i, key := range keys {
			o, err := p.k.Begin(ctx, p.scope, key, WithFingerprint(fps[i]))
			out[i] = p.outcomeAnswer(key, o, err)
		}
		return out
	}
	res, err := p.k.batchBegin(ctx, p.scope, keys, WithFingerprints(fps))
	require.NoError(t, err)
	for i, r := range res {
		assert.Equal(t, i, r.First)
		out[i] = p.outcomeAnswer(keys[i], r.Outcome, r.Err)
	}
	return out
}

// settle completes (value non-nil), releases (release) or extends the claims
// of keys held in the given map, and answers each.
func (p *twinPath) settle(keys []string, from map[string]*Claim, step string, value []byte) []answer {
	ctx := context.Background()
	claims := make([]*Claim, len(keys))
	for i, key := range keys {
		claims[i] = from[key]
	}
	errs := make([]error, len(keys))
	switch {
	case !p.batch:
		for i, c := range claims {
			switch step {
			case "complete":
				errs[i] = c.Complete(ctx, value, 0)
			case "release":
				errs[i] = c.Release(ctx)
			case "extend":
				errs[i] = c.Extend(ctx)
			}
		}
	case step == "complete":
		items := make([]completion, len(claims))
		for i, c := range claims {
			items[i] = completion{Claim: c, Value: value}
		}
		errs = p.k.completeClaims(ctx, items)
	case step == "release":
		errs = p.k.releaseClaims(ctx, claims)
	case step == "extend":
		errs = p.k.extendClaims(ctx, claims)
	}
	out := make([]answer, len(keys))
	for i, err := range errs {
		out[i] = answer{What: errClass(err)}
		if err == nil && step != "extend" && from[keys[i]] == p.held[keys[i]] {
			delete(p.held, keys[i])
		}
	}
	return out
}

// expireSrc moves the lease end of a pending record into the past.
const expireSrc = `
local v = redis.call('GET', KEYS[1])
if type(v) ~= 'string' then return 0 end
local a, b = string.match(v, '^(i1P%d+:%d+:[01]:)%d+(:.*)$')
if not a then return 0 end
redis.call('SET', KEYS[1], a .. '1' .. b, 'KEEPTTL')
return 1`

var expireLua = redis.NewScript(expireSrc)

// twinRun runs a random sequence of operations on both paths with client and
// asserts that every answer matches.
// Every kind of answer the run gave is set in seen.
func twinRun(t *testing.T, client redis.Scripter, seed uint64, steps int, seen map[string]bool) {
	ctx := context.Background()
	store, err := openRedisStore(client)
	require.NoError(t, err)
	k, err := keeperOn(store, WithLease(time.Minute))
	require.NoError(t, err)
	newPath := func(scope string, batch bool) *twinPath {
		return &twinPath{scope: scope, batch: batch, k: k, held: map[string]*Claim{}, stale: map[string]*Claim{}, token: map[string]int64{}}
	}
	single, batch := newPath("single", false), newPath("batch", true)
	keys := []string{"k0", "k1", "k2", "key3", "key4", "key5", "k6", ""}
	rnd := rand.New(rand.NewPCG(seed, 1))
	pick := func(from []string) []string {
		s := slices.Clone(from)
		rnd.Shuffle(len(s), func(i, j int) { s[i], s[j] = s[j], s[i] })
		return s[:rnd.IntN(len(s)+1)]
	}
	heldKeys := func(m map[string]*Claim) []string {
		var s []string
		for _, key := range keys {
			if m[key] != nil {
				s = append(s, key)
			}
		}
		return s
	}
	// onBoth runs lua on the record of key in both scopes.
	onBoth := func(key, lua string) {
		for _, scope := range []string{single.scope, batch.scope} {
			require.NoError(t, client.Eval(ctx, lua, []string{store.key(k.RecordID(scope, key))}).Err())
		}
	}
	for step := 0; step < steps; step++ {
		var want, got []answer
		var what string
		switch op := rnd.IntN(100); {
		case op < 35:
			ks := pick(keys)
			fps := make([][]byte, len(ks))
			for i, key := range ks {
				// Mostly the key's own request, sometimes another.
				fps[i] = [][]byte{nil, []byte("a")}[len(key)%2]
				if rnd.IntN(10) == 0 {
					fps[i] = []byte("b")
				}
			}
			what = fmt.Sprintf("claim %q", ks)
			want, got = single.claim(t, ks, fps), batch.claim(t, ks, fps)
		case op < 50:
			ks, v := pick(heldKeys(single.held)), []byte(fmt.Sprint("v", step))
			what = fmt.Sprintf("complete %q", ks)
			want, got = single.settle(ks, single.held, "complete", v), batch.settle(ks, batch.held, "complete", v)
		case op < 58:
			ks := pick(heldKeys(single.held))
			what = fmt.Sprintf("release %q", ks)
			want, got = single.settle(ks, single.held, "release", nil), batch.settle(ks, batch.held, "release", nil)
		case op < 66:
			ks := pick(heldKeys(single.held))
			what = fmt.Sprintf("extend %q", ks)
			want, got = single.settle(ks, single.held, "extend", nil), batch.settle(ks, batch.held, "extend", nil)
		case op < 72:
			ks, v := pick(heldKeys(single.stale)), []byte("stale")
			step := []string{"complete", "release", "extend"}[rnd.IntN(3)]
			what = fmt.Sprintf("stale %s %q", step, ks)
			want, got = single.settle(ks, single.stale, step, v), batch.settle(ks, batch.stale, step, v)
		case op < 80:
			ks := heldKeys(single.held)
			if len(ks) == 0 {
				continue
			}
			key := ks[rnd.IntN(len(ks))]
			name, value := fmt.Sprint("step", rnd.IntN(3)), []byte(fmt.Sprint("x", step))
			what = fmt.Sprintf("checkpoint %q %s", key, name)
			want = []answer{{What: errClass(single.held[key].Checkpoint(ctx, name, value))}}
			got = []answer{{What: errClass(batch.held[key].Checkpoint(ctx, name, value))}}
		case op < 92:
			ks := pick(keys[:len(keys)-1])
			what = fmt.Sprintf("leases of %q run out", ks)
			for _, key := range ks {
				onBoth(key, expireSrc)
			}
		case op < 94:
			key := keys[rnd.IntN(len(keys)-1)]
			what = fmt.Sprintf("corrupt %q", key)
			onBoth(key, "return redis.call('SET', KEYS[1], 'junk')")
		default:
			ks := pick(keys[:len(keys)-1])
			what = fmt.Sprintf("delete %q", ks)
			for _, key := range ks {
				onBoth(key, "return redis.call('DEL', KEYS[1])")
			}
		}
		require.Equal(t, want, got, "step %d: %s", step, what)
		for _, a := range want {
			seen[twinKind(a)] = true
		}
	}
}

// twinKind names the kind of an answer, to check that a run saw every kind.
func twinKind(a answer) string {
	switch {
	case a.What == "claimed" && a.Recovered && a.Checkpoints != "":
		return "recovered with checkpoints"
	case a.What == "claimed" && a.Checkpoints != "":
		return "claimed after a release, with checkpoints"
	case a.What == "claimed" && a.Recovered:
		return "recovered"
	}
	return a.What
}

func TestBatchMatchesSingleKey(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		seen := map[string]bool{}
		for seed := uint64(1); seed <= 4; seed++ {
			t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
				require.NoError(t, b.Client.FlushAll(context.Background()).Err())
				twinRun(t, b.Client, seed, 300, seen)
			})
		}
		assertSawEveryAnswer(t, seen)
	})
}

func assertSawEveryAnswer(t *testing.T, seen map[string]bool) {
	for _, kind := range []string{"claimed", "recovered", "recovered with checkpoints", "claimed after a release, with checkpoints",
		"replayed", "in-progress", "mismatch", "corrupt", "invalid-key", "lease-lost", "ok"} {
		assert.True(t, seen[kind], "no answer %q in the run", kind)
	}
}

func TestBatchDuplicatesAreAnsweredInProcess(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var cnt redistest.Counter
		b.Client.AddHook(&cnt)
		k := newKeeper(t, b)
		ctx := context.Background()
		require.NoError(t, k.store.(*redisStore).LoadScripts(ctx))
		keys := []string{"m1", "m2", "m1", "", "m2", "m1", "m3"}
		var res []batchResult
		assert.EqualValues(t, 1, cnt.Count(func() {
			var err error
			res, err = k.batchBegin(ctx, "s", keys)
			require.NoError(t, err)
		}), "one script call for the distinct keys")
		for i, want := range []struct {
			first int
			class string
		}{{0, "claimed"}, {1, "claimed"}, {0, "duplicate"}, {3, "invalid-key"}, {1, "duplicate"}, {0, "duplicate"}, {6, "claimed"}} {
			r := res[i]
			assert.Equal(t, want.first, r.First, "place %d", i)
			if want.class == "claimed" {
				require.NoError(t, r.Err, "place %d", i)
				assert.Equal(t, 1, r.Outcome.Claim.Attempt())
			} else {
				assert.Equal(t, want.class, errClass(r.Err), "place %d", i)
				assert.Nil(t, r.Outcome.Claim)
			}
		}
		// The store refuses a repeated id itself.
		s := k.store.(*redisStore)
		replies := s.ClaimBatch(ctx, batchClaimRequest{IDs: []string{"x", "x"}, Attempt: "a", Lease: time.Minute, Keep: time.Hour})
		require.NoError(t, replies[0].Err)
		assert.ErrorIs(t, replies[1].Err, ErrInvalidConfig)
	})
}

// TestBatchPartialFailures: keys in progress, completed, corrupt, of another
// fingerprint and invalid are each answered as Begin answers them, while the
// others are claimed.
func TestBatchPartialFailures(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		s := k.store.(*redisStore)
		busy, err := k.Begin(ctx, "s", "busy")
		require.NoError(t, err)
		done, err := k.Begin(ctx, "s", "done")
		require.NoError(t, err)
		require.NoError(t, done.Claim.Complete(ctx, []byte("result"), 0))
		fp, err := k.Begin(ctx, "s", "fp", WithFingerprint([]byte("a")))
		require.NoError(t, err)
		require.NoError(t, fp.Claim.Release(ctx))
		_, err = k.Begin(ctx, "s", "fp", WithFingerprint([]byte("a")))
		require.NoError(t, err)
		require.NoError(t, b.Client.Set(ctx, s.RecordKey("s", "junk"), "not ours", time.Hour).Err())
		require.NoError(t, b.Client.LPush(ctx, s.RecordKey("s", "list"), "x").Err())

		keys := []string{"new1", "busy", "done", "fp", "junk", "list", "bad\x00key", "new2"}
		fps := [][]byte{nil, nil, nil, []byte("b"), nil, nil, nil, nil}
		res, err := k.batchBegin(ctx, "s", keys, WithFingerprints(fps))
		require.NoError(t, err)
		assert.NotNil(t, res[0].Outcome.Claim)
		var ip *InProgressError
		require.ErrorAs(t, res[1].Err, &ip)
		assert.Greater(t, ip.RetryAfter, time.Duration(0))
		assert.True(t, res[2].Outcome.Replayed)
		assert.Equal(t, "result", string(res[2].Outcome.Value))
		assert.Equal(t, done.Claim.Token(), res[2].Outcome.Token)
		assert.ErrorIs(t, res[3].Err, ErrMismatch)
		assert.ErrorIs(t, res[4].Err, ErrCorrupt)
		assert.ErrorIs(t, res[5].Err, ErrCorrupt)
		assert.ErrorIs(t, res[6].Err, ErrInvalidKey)
		assert.NotNil(t, res[7].Outcome.Claim)
		v, err := b.Client.Get(ctx, s.RecordKey("s", "junk")).Result()
		require.NoError(t, err)
		assert.Equal(t, "not ours", v, "nothing overwritten")
		require.NoError(t, busy.Claim.Release(ctx))
	})
}

// TestBatchLeaseLostMidBatch: claims of a batch that were taken over while
// the batch ran are refused, each on its own, and the new holders' records
// are untouched; the rest of the batch completes.
func TestBatchLeaseLostMidBatch(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(time.Minute))
		ctx := context.Background()
		keys := []string{"a", "b", "c", "d"}
		res, err := k.batchBegin(ctx, "s", keys)
		require.NoError(t, err)
		claims := make([]*Claim, len(keys))
		for i, r := range res {
			require.NoError(t, r.Err)
			claims[i] = r.Outcome.Claim
		}
		// b and d: the batch's process paused past its lease, and another
		// attempt took them over.
		s := k.store.(*redisStore)
		taken := map[int]*Claim{}
		for _, i := range []int{1, 3} {
			require.NoError(t, expireLua.Run(ctx, b.Client, []string{s.RecordKey("s", keys[i])}).Err())
			out, err := k.Begin(ctx, "s", keys[i])
			require.NoError(t, err)
			require.True(t, out.Claim.Recovered())
			require.Greater(t, out.Claim.Token(), claims[i].Token())
			taken[i] = out.Claim
		}
		errs := k.extendClaims(ctx, claims)
		assert.Equal(t, []string{"ok", "lease-lost", "ok", "lease-lost"}, classes(errs))
		items := make([]completion, len(claims))
		for i, c := range claims {
			items[i] = completion{Claim: c, Value: []byte("stale holder " + keys[i])}
		}
		errs = k.completeClaims(ctx, items)
		assert.Equal(t, []string{"ok", "lease-lost", "ok", "lease-lost"}, classes(errs))
		for i, c := range taken {
			require.NoError(t, c.Complete(ctx, []byte("new holder"), 0))
			out, err := k.Begin(ctx, "s", keys[i])
			require.NoError(t, err)
			assert.Equal(t, "new holder", string(out.Value))
		}
		assert.Equal(t, []string{"lease-lost", "lease-lost", "lease-lost", "lease-lost"}, classes(k.releaseClaims(ctx, claims)))
	})
}

func classes(errs []error) []string {
	out := make([]string, len(errs))
	for i, err := range errs {
		out[i] = errClass(err)
	}
	return out
}

// TestBatchRetriedCallsAreIdempotent: go-redis sends a batch script again
// when its reply was lost; the second run answers the same.
func TestBatchRetriedCallsAreIdempotent(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		s, err := openRedisStore(b.Client)
		require.NoError(t, err)
		ctx := context.Background()
		req := batchClaimRequest{IDs: []string{"r1", "r2", "r3"}, Fingerprints: []string{"", "Zm9v", ""}, Attempt: "attempt-1", Lease: time.Minute, Keep: time.Hour}
		first := s.ClaimBatch(ctx, req)
		again := s.ClaimBatch(ctx, req)
		assert.Equal(t, first, again)
		for _, r := range first {
			require.NoError(t, r.Err)
			assert.Equal(t, statusClaimed, r.Reply.Status)
		}
		fences := []claimFence{{ID: "r1", Token: first[0].Reply.Token}, {ID: "r2", Token: first[1].Reply.Token}, {ID: "r3", Token: first[2].Reply.Token}}
		for range 2 {
			assert.Equal(t, []error{nil, nil, nil}, s.ExtendBatch(ctx, fences, time.Minute, time.Hour))
		}
		done := []batchCompletion{{claimFence: fences[0], Value: seal(kindBytes, []byte("v")), Keep: time.Hour}}
		for range 2 {
			assert.Equal(t, []error{nil}, s.CompleteBatch(ctx, done))
		}
		for range 2 {
			assert.Equal(t, []error{nil, nil}, s.ReleaseBatch(ctx, fences[1:], time.Minute))
		}
		after := s.ClaimBatch(ctx, batchClaimRequest{IDs: []string{"r1", "r2"}, Attempt: "attempt-2", Lease: time.Minute, Keep: time.Hour})
		assert.Equal(t, statusCompleted, after[0].Reply.Status)
		assert.Equal(t, statusClaimed, after[1].Reply.Status)
		assert.Equal(t, 2, after[1].Reply.Attempt)
	})
}

// TestBatchUnderLostReplies: through a proxy that drops replies after Redis
// ran the command, go-redis sends batch scripts again; every key a batch
// call answers is answered as on a clean line: claimed once, attempt 1, and
// completed, never in progress against its own earlier run.
func TestBatchUnderLostReplies(t *testing.T) {
	srv := redistest.Start(t)
	p, err := faultproxy.New(srv.Addr, 11)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	client := redis.NewClient(&redis.Options{
		Addr: p.Addr(), ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond,
		MaxRetries: 5, MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 4 * time.Millisecond,
	})
	t.Cleanup(func() { client.Close() })
	k, err := NewRedis(client, WithLease(time.Minute))
	require.NoError(t, err)
	ctx := context.Background()
	p.Set(faultproxy.Faults{DropReply: 0.3})
	answered := 0
	for call := range 40 {
		keys := make([]string, 300)
		for i := range keys {
			keys[i] = fmt.Sprintf("lost-%d-%d", call, i)
		}
		res, err := k.batchBegin(ctx, "s", keys)
		require.NoError(t, err)
		var items []completion
		for i, r := range res {
			if errors.Is(r.Err, ErrUnavailable) {
				continue // every try lost: the outcome is unknown, as for Begin
			}
			require.NoError(t, r.Err, "%s", keys[i])
			c := r.Outcome.Claim
			require.NotNil(t, c, "%s", keys[i])
			assert.Equal(t, 1, c.Attempt(), "%s", keys[i])
			assert.False(t, c.Recovered(), "%s", keys[i])
			items = append(items, completion{Claim: c, Value: []byte(keys[i])})
			answered++
		}
		for i, err := range k.completeClaims(ctx, items) {
			if !errors.Is(err, ErrUnavailable) {
				require.NoError(t, err, "%s", items[i].Claim.id)
			}
		}
	}
	stats := p.Stats()
	t.Logf("%d keys answered; %d replies dropped", answered, stats.DroppedReplies)
	assert.Positive(t, stats.DroppedReplies)
	assert.Positive(t, answered)
}

// FuzzBatchMatchesSingleKey puts arbitrary bytes at two keys and takes each
// step on one through the single-record scripts and on the other through the
// batch scripts, with Redis's clock standing still: the answers and the
// values left are the same, every error is typed, and a value that is not a
// record is never overwritten. Checkpoint, on a third copy, holds to the same
// rules.
//
// Fuzz it with -fuzztime as a count (-fuzztime 2000x): without a bound it
// never ends, and the miniredis under it keeps growing.
func FuzzBatchMatchesSingleKey(f *testing.F) {
	for _, v := range []string{
		"i1C1:1:0:0:::\x01bok", "i1P5:1:0:99999999999999999:att:fp:", "i1P5:1:0:0:att:fp:", "i1R5:2:0:0:::",
		"i1P5:1:0:0:att:fp:4:step1:v", "i1P5:1:0:0:att:fp:trailing", "i1R5:2:0:0::fp:4:step0:", "i1R5:2:0:0::zz:1:a1:b",
		"i1P5:1:0:0:att2:fp:", "i1C1:1:0:0::", "plain string", "", "i1P:::::::", "i1P5:1:0:0:att:fp:9:x",
		"i1P5:1:0:0:att:fp:+1:a1:b", "i1P5:1:0:0:att:fp:1:a", "i1P99999999999999999999:1:0:0:att:fp:",
	} {
		f.Add([]byte(v), int64(5))
	}
	m := miniredis.RunT(f)
	m.SetTime(time.Unix(1_800_000_000, 0))
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	f.Cleanup(func() { c.Close() })
	s, err := openRedisStore(c, WithPrefix("fuzz:"))
	require.NoError(f, err)
	ctx := context.Background()
	var n atomic.Int64
	f.Fuzz(func(t *testing.T, value []byte, token int64) {
		ids := [3]string{}
		for i := range ids {
			ids[i] = recordID("fuzz", fmt.Sprint(n.Add(1)))
		}
		reset := func() {
			for _, id := range ids {
				require.NoError(t, c.Set(ctx, s.key(id), value, time.Minute).Err())
			}
		}
		same := func(step string, single, batch error) {
			require.Equal(t, errClass(single), errClass(batch), "%s on %q", step, value)
			got := [2][]byte{}
			for i := range got {
				got[i], _ = c.Get(ctx, s.key(ids[i])).Bytes()
			}
			require.Equal(t, got[0], got[1], "%s on %q left different values", step, value)
			if errors.Is(single, ErrCorrupt) {
				require.Equal(t, value, got[0], "%s on %q overwrote it", step, value)
			}
			require.True(t, single == nil || errors.Is(single, ErrCorrupt) || errors.Is(single, ErrLeaseLost), "%s on %q: untyped %v", step, value, single)
		}
		fence := []claimFence{{ID: ids[1], Token: token}}
		reset()
		same("complete", errOf(s.Complete(ctx, ids[0], token, []byte("x"), time.Minute)),
			s.CompleteBatch(ctx, []batchCompletion{{claimFence: fence[0], Value: []byte("x"), Keep: time.Minute}})[0])
		reset()
		same("release", s.Release(ctx, ids[0], token, time.Minute), s.ReleaseBatch(ctx, fence, time.Minute)[0])
		reset()
		same("extend", s.Extend(ctx, ids[0], token, time.Minute, time.Minute), s.ExtendBatch(ctx, fence, time.Minute, time.Minute)[0])
		reset()
		r1, err1 := s.Claim(ctx, ids[0], claimRequest{Fingerprint: "fp", Attempt: "att2", Lease: time.Minute, Keep: time.Minute})
		rb := s.ClaimBatch(ctx, batchClaimRequest{IDs: ids[1:2], Fingerprints: []string{"fp"}, Attempt: "att2", Lease: time.Minute, Keep: time.Minute})[0]
		require.Equal(t, r1, rb.Reply, "claim on %q", value)
		same("claim", err1, rb.Err)

		err = s.Checkpoint(ctx, claimFence{ID: ids[2], Token: token}, "step", []byte("v"), 0)
		got, _ := c.Get(ctx, s.key(ids[2])).Bytes()
		switch {
		case err == nil:
			r, err := s.Claim(ctx, ids[2], claimRequest{Attempt: "other", Lease: time.Minute, Keep: time.Minute})
			if err == nil && r.Status == statusClaimed {
				assert.Equal(t, recoveryPoint{"step", []byte("v")}, r.Checkpoints[len(r.Checkpoints)-1], "checkpoint on %q", value)
			}
		case errors.Is(err, ErrCorrupt):
			require.Equal(t, value, got, "checkpoint on %q overwrote it", value)
		default:
			require.True(t, errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrInvalidCheckpoint), "checkpoint on %q: untyped %v", value, err)
			require.Equal(t, value, got, "a refused checkpoint on %q wrote", value)
		}
	})
}

// TestBatchOnOtherClients: on a Ring and through an AutoPipeliner, where a
// script call holds one record, the batch API answers as on a plain client.
func TestBatchOnOtherClients(t *testing.T) {
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{
		"a": miniredis.RunT(t).Addr(), "b": miniredis.RunT(t).Addr(),
	}})
	t.Cleanup(func() { ring.Close() })
	srv := redistest.Real(t)
	ap, err := srv.Client.AutoPipelineWithOptions(unorderedAutoPipeline())
	require.NoError(t, err)
	t.Cleanup(func() { ap.Close() })
	for name, client := range map[string]redis.Scripter{"ring": ring, "autopipeliner": ap} {
		t.Run(name, func(t *testing.T) {
			k, err := NewRedis(client)
			require.NoError(t, err)
			ctx := context.Background()
			keys := make([]string, 300)
			for i := range keys {
				keys[i] = fmt.Sprint(name, "-", i)
			}
			res, err := k.batchBegin(ctx, "s", keys)
			require.NoError(t, err)
			items := make([]completion, len(res))
			for i, r := range res {
				require.NoError(t, r.Err, keys[i])
				items[i] = completion{Claim: r.Outcome.Claim, Value: []byte(keys[i])}
			}
			for _, err := range k.completeClaims(ctx, items) {
				require.NoError(t, err)
			}
			res, err = k.batchBegin(ctx, "s", keys)
			require.NoError(t, err)
			for i, r := range res {
				require.NoError(t, r.Err, keys[i])
				assert.Equal(t, keys[i], string(r.Outcome.Value))
			}
		})
	}
}
