package idem

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// newKeeper returns a Keeper on b's client.
func newKeeper(t testing.TB, b *redistest.Backend, opts ...Option) *Keeper {
	t.Helper()
	k, err := NewRedis(b.Client, opts...)
	require.NoError(t, err, "NewRedis")
	return k
}

// quietLogger drops go-redis's own log lines (dial failures in the
// unavailability tests), which the tests assert on as errors instead.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

func init() { redis.SetLogger(quietLogger{}) }

// layouts returns the layout the package's stores write, as their prefix
// records say, and the one before it, which they refuse.
func layouts() (ours, other string) { return prefixLayout, "v2" }

// expireRecordLeaseLua makes the lease of the claim kept in the record
// KEYS[1] run out; it answers 0 when the record is not a pending one.
var expireRecordLeaseLua = makeLuaScript(`
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local a, b = string.match(v, '^(i1P%d+:%d+:[01]:)%d+(:.*)$')
if not a then return 0 end
redis.call('SET', KEYS[1], a .. '1' .. b, 'KEEPTTL')
return 1`)

// expireLease makes the lease of the claim of (scope, key) in s run out, by
// Redis's clock, whether the claim is kept in a record or compactly.
func expireLease(t testing.TB, s *redisStore, scope, key string) {
	t.Helper()
	expireLeaseOf(t, s, recordID(scope, key))
}

// expireLeaseOf is expireLease for the record id.
func expireLeaseOf(t testing.TB, s *redisStore, id string) {
	t.Helper()
	ctx := context.Background()
	if n, err := s.client.(redis.Cmdable).Exists(ctx, s.key(id)).Result(); err == nil && n == 1 {
		require.NoError(t, expireRecordLeaseLua.Run(ctx, s.client, []string{s.key(id)}).Err())
		return
	}
	d8, index, calls := s.compactIndexArgs(id)
	n, err := expireV3LeaseLua.Run(ctx, s.client, []string{s.key(id)}, d8, index, calls).Int()
	require.NoError(t, err)
	require.Positive(t, n, "no entry for %x", d8)
}

// expireV3LeaseLua makes the lease of the v3 claim whose entry starts with
// ARGV[1], in index ARGV[2], its call records under ARGV[3], run out: the
// lease end of the call record of each of its entries (an id's older
// entries wait to be swept) becomes 0, and so that of every claim of those
// calls, which share one lease. KEYS[1], the record's key, sends it where
// the record is (a Ring). It answers how many entries it found.
var expireV3LeaseLua = makeLuaScript(`
local d8, ikey, base = ARGV[1], ARGV[2], ARGV[3]
local h, n = redis.call('HGETALL', ikey), 0
for i = 1, #h, 2 do
  local blk = h[i + 1]
  for p = 1, h[i] ~= '' and #blk - v3EntrySize + 1 or 0, v3EntrySize do
    if string.sub(blk, p, p + 7) == d8 then
      local tok6 = string.sub(blk, p + v3EntryTokenAt - 1, p + v3EntryTokenAt + 4)
      redis.call('SETRANGE', base .. tok6, v3CallUntilAt - 1, string.rep('\0', v3TimeSize))
      n = n + 1
    end
  end
end
return n`)

// errOf is the error of a store's Complete, for a test that asserts on it
// alone.
func errOf(_ bool, err error) error { return err }

// redeliveringBroker delivers messages to consumers that run Consume on a
// Keeper, in scope "s", as a broker that delivers at least once does: a
// message not acknowledged comes again, and until stop an acknowledged one
// comes again too, so that the markers of handled messages keep being
// asked. It counts the handler runs and acknowledgements of each message.
type redeliveringBroker struct {
	t     *testing.T
	k     *Keeper
	msgs  []string
	batch int
	// work is how long a handler takes.
	work time.Duration

	mu        sync.Mutex
	runs      map[string]int
	acked     map[string]int
	why       map[string]int // the errors of deliveries not acknowledged
	queue     []string
	redeliver bool
	retried   int // deliveries not acknowledged
	refused   int // Consume calls answered ErrUnavailable
	started   atomic.Int64
	done      chan struct{}
	wg        sync.WaitGroup
}

func newRedeliveringBroker(t *testing.T, k *Keeper, msgs []string, batch int, work time.Duration) *redeliveringBroker {
	return &redeliveringBroker{t: t, k: k, msgs: msgs, batch: batch, work: work, runs: map[string]int{},
		acked: map[string]int{}, why: map[string]int{}, redeliver: true, done: make(chan struct{})}
}

// add queues ms after what is queued; first, before it.
func (b *redeliveringBroker) add(first bool, ms ...string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if first {
		b.queue = append(slices.Clone(ms), b.queue...)
	} else {
		b.queue = append(b.queue, ms...)
	}
}

func (b *redeliveringBroker) handle(_ context.Context, m string) error {
	b.mu.Lock()
	b.runs[m]++
	b.mu.Unlock()
	b.started.Add(1)
	time.Sleep(b.work)
	return nil
}

func (b *redeliveringBroker) take() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := min(b.batch, len(b.queue))
	out := slices.Clone(b.queue[:n])
	b.queue = b.queue[n:]
	return out
}

// settle acknowledges what Consume handled or replayed and queues the
// rest again; res is nil for a call refused whole.
func (b *redeliveringBroker) settle(ms []string, res []MessageResult) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, m := range ms {
		if res != nil && (res[i].Status == MessageHandled || res[i].Status == MessageReplayed) {
			b.acked[m]++
			if b.redeliver {
				b.queue = append(b.queue, m)
			}
			continue
		}
		b.retried++
		if res != nil {
			b.why[fmt.Sprint(res[i].Status, ": ", res[i].Err)]++
		}
		b.queue = append(b.queue, m)
	}
}

// ackedAll reports whether every message was acknowledged at least once.
func (b *redeliveringBroker) ackedAll() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.acked) == len(b.msgs)
}

// drained reports whether every message was acknowledged and none waits.
func (b *redeliveringBroker) drained() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.acked) == len(b.msgs) && len(b.queue) == 0
}

// start runs n consumers, each until stop and the queue is drained, or 90
// seconds (a bound, not a margin).
func (b *redeliveringBroker) start(n int) {
	for range n {
		b.wg.Add(1)
		go func() {
			defer b.wg.Done()
			for deadline := time.Now().Add(90 * time.Second); time.Now().Before(deadline); {
				ms := b.take()
				if len(ms) == 0 {
					select {
					case <-b.done:
						if b.drained() {
							return
						}
					default:
					}
					time.Sleep(2 * time.Millisecond)
					continue
				}
				res, err := Consume(context.Background(), b.k, "s", ms, func(m string) string { return m }, b.handle, WithConcurrency(4))
				if err != nil {
					assert.ErrorIs(b.t, err, ErrUnavailable)
					b.mu.Lock()
					b.refused++
					b.mu.Unlock()
					res = nil
					time.Sleep(5 * time.Millisecond)
				}
				b.settle(ms, res)
			}
		}()
	}
}

// stop ends the redelivery of acknowledged messages and waits for the
// consumers to drain the queue.
func (b *redeliveringBroker) stop() {
	b.mu.Lock()
	b.redeliver = false
	b.mu.Unlock()
	close(b.done)
	b.wg.Wait()
}

// check logs what happened, after what, and asserts that every message ran
// once, was acknowledged, and cannot be claimed again.
func (b *redeliveringBroker) check(what string) {
	t := b.t
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	t.Logf("%s; %d messages, %d acknowledgements; %d deliveries not acknowledged, %d Consume calls refused",
		what, len(b.msgs), sumValues(b.acked), b.retried, b.refused)
	for w, n := range b.why {
		t.Logf("%d× %s", n, w)
	}
	for _, m := range b.msgs {
		assert.Equal(t, 1, b.runs[m], "handler runs of %s", m)
		assert.GreaterOrEqual(t, b.acked[m], 1, "%s acknowledged", m)
	}
	for _, m := range b.msgs {
		o, err := b.k.Begin(context.Background(), "s", m)
		require.NoError(t, err, m)
		require.Nil(t, o.Claim, "%s claimed after it was handled", m)
	}
}

// sumValues is the sum of m's values.
func sumValues(m map[string]int) (n int) {
	for _, v := range m {
		n += v
	}
	return n
}

// markerModes runs f with markers on (the default) and WithoutMarkers: the
// batch scripts of both.
func markerModes(t *testing.T, f func(t *testing.T, opts ...Option)) {
	t.Run("markers", func(t *testing.T) { f(t) })
	t.Run("records", func(t *testing.T) { f(t, WithoutMarkers()) })
}

// badInputBackends returns a client of a fresh miniredis, and of a fresh
// redis-server when one is installed.
func badInputBackends(t *testing.T) map[string]*redis.Client {
	m := miniredis.RunT(t)
	mc := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { mc.Close() })
	backends := map[string]*redis.Client{"miniredis": mc}
	if _, err := exec.LookPath("redis-server"); err == nil || redistest.Required() {
		backends["redis"] = redistest.Start(t).Client(t)
	}
	return backends
}

// contextWithClaim returns a copy of ctx that carries c, for
// ClaimFromContext: a claim of the test's making.
func contextWithClaim(ctx context.Context, c *Claim) context.Context {
	return context.WithValue(ctx, claimKey{}, c)
}

// consumeRefused asserts that Consume of msgs on k runs no handler and
// answers every message with an error that wraps ErrInvalidConfig,
// unacknowledged: what a Keeper on a prefix or index of another layout or
// placement gets.
func consumeRefused(t *testing.T, k *Keeper, msgs []string) {
	t.Helper()
	res, err := Consume(context.Background(), k, "s", msgs, func(m string) string { return m }, func(context.Context, string) error {
		t.Error("a handler ran on a prefix or index of another layout")
		return nil
	})
	require.NoError(t, err)
	for _, r := range res {
		assert.ErrorIs(t, r.Err, ErrInvalidConfig)
		assert.False(t, r.Ack)
	}
}
