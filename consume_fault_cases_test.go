package idem

// The failure modes of Consume and the batch calls one at a time, each on
// its own, deterministic where Redis's clock can be moved by hand: a
// marker older than the retention, every batch step sent twice, compact
// claims held longer than their index is kept, claims answered late, a
// checkpoint whose reply was lost, and every batch step on a full or
// read-only Redis.

import (
	"context"
	"errors"
	"fmt"
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

// TestConsumeReplaysAMarkerPastTheRetention: a message handled by Consume
// leaves a marker kept for the marker retention; its redelivery after the
// retention, and within the marker retention, is "done before": Consume
// answers MessageReplayed, acknowledged, and the handler does not run (the
// contract: "a redelivery within it is answered done before, as from a full
// record"; WithMarkerRetention: "for that long a redelivery is answered
// handled before (MessageReplayed)"). Begin answers ErrResultExpired then.
func TestConsumeReplaysAMarkerPastTheRetention(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		const retention = time.Second
		k := newKeeper(t, b, WithLease(retention), WithRetention(retention), WithMarkerRetention(time.Hour))
		ctx := context.Background()
		ran := 0
		handle := func(context.Context, msg) error { ran++; return nil }
		res, err := Consume(ctx, k, "s", msgs("m1"), msgID, handle)
		require.NoError(t, err)
		require.Equal(t, MessageHandled, res[0].Status)

		b.Advance(retention + retention/2)
		_, err = k.Begin(ctx, "s", "m1")
		require.ErrorIs(t, err, ErrResultExpired, "Begin past the retention, within the marker retention")

		res, err = Consume(ctx, k, "s", msgs("m1"), msgID, handle)
		require.NoError(t, err)
		assert.Equal(t, 1, ran, "the handler ran again")
		assert.Equal(t, MessageReplayed, res[0].Status,
			"a redelivery past the retention and within the marker retention must be answered done before; got %s (Ack %v, %v): the broker redelivers it until the marker retention ends, and then it runs again",
			res[0].Status, res[0].Ack, res[0].Err)
		assert.True(t, res[0].Ack, "not acknowledged")
	})
}

// resendClient returns a client of b whose script calls are each sent twice
// (see scriptFaults) while the returned hook is on.
func resendClient(t *testing.T, b *redistest.Backend) (*redis.Client, *scriptFaults) {
	c := redistest.NewClient(t, b.Client.Options().Addr)
	h := newScriptFaults(1, true, 0)
	c.AddHook(h)
	return c, h
}

// TestBatchStepsAnswerTheSameWhenSentTwice: go-redis sends a script again
// when its reply was lost, so every batch step may run twice for one call
// (the rules: "every script must be safe to run twice"). With every script
// sent twice, each step answers as on a clean line, and leaves what it would
// have left: BeginBatch (compact claims or records), ExtendBatch,
// CompleteBatch with an empty result (a marker) and with a value,
// ReleaseBatch, the steps of a single Claim of a batch, and Consume with a
// Final error (a value to keep).
func TestBatchStepsAnswerTheSameWhenSentTwice(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		markerModes(t, func(t *testing.T, opts ...Option) {
			client, twice := resendClient(t, b)
			opts = append(opts, WithPrefix(fmt.Sprintf("twice%d:", len(opts))))
			k, err := NewRedis(client, append(opts, WithLease(time.Minute))...)
			require.NoError(t, err)
			clean := newKeeper(t, b, opts...)
			ctx := context.Background()
			// The scripts are in Redis's cache, as they are once a store has
			// run a while: a batch step's calls go in one pipeline of EVALSHA.
			require.NoError(t, k.store.(*RedisStore).LoadScripts(ctx))
			twice.on.Store(true)
			keys := []string{"empty", "value", "release", "one-value", "one-extend", "one-release", "one-checkpoint", "extend"}
			res, err := k.BeginBatch(ctx, "s", keys, WithCompactClaims())
			require.NoError(t, err)
			cl := map[string]*Claim{}
			for i, r := range res {
				require.NoError(t, r.Err, keys[i])
				require.NotNil(t, r.Outcome.Claim, keys[i])
				assert.Equal(t, 1, r.Outcome.Claim.Attempt(), "%s: claimed twice by one call", keys[i])
				assert.False(t, r.Outcome.Claim.Recovered(), keys[i])
				cl[keys[i]] = r.Outcome.Claim
			}
			all := make([]*Claim, len(keys))
			for i, key := range keys {
				all[i] = cl[key]
			}
			for i, err := range k.ExtendBatch(ctx, all) {
				assert.NoError(t, err, "ExtendBatch of %s", keys[i])
			}
			errs := k.CompleteBatch(ctx, []Completion{{Claim: cl["empty"]}, {Claim: cl["value"], Value: []byte("v")}})
			assert.NoError(t, errs[0], "CompleteBatch with an empty result")
			assert.NoError(t, errs[1], "CompleteBatch with a value, sent twice: the value is stored (see below), and a step that stored it must not answer otherwise")
			assert.NoError(t, k.ReleaseBatch(ctx, []*Claim{cl["release"]})[0], "ReleaseBatch")
			assert.NoError(t, cl["one-value"].Complete(ctx, []byte("w"), 0), "Claim.Complete with a value, sent twice")
			assert.NoError(t, cl["one-extend"].Extend(ctx), "Claim.Extend")
			assert.NoError(t, cl["one-release"].Release(ctx), "Claim.Release")
			assert.NoError(t, cl["one-checkpoint"].Checkpoint(ctx, "step", []byte("1")), "Claim.Checkpoint")
			assert.NoError(t, cl["one-checkpoint"].Complete(ctx, nil, 0), "Claim.Complete after a checkpoint")
			assert.NoError(t, k.ExtendBatch(ctx, []*Claim{cl["extend"]})[0], "ExtendBatch of the last one held")

			var fails atomic.Int32
			out, err := Consume(ctx, k, "s", msgs("final"), msgID, func(context.Context, msg) error {
				fails.Add(1)
				return Final(errors.New("declined"))
			})
			require.NoError(t, err)
			assert.Equal(t, MessageHandled, out[0].Status, "Consume storing a Final error, sent twice: %v", out[0].Err)
			twice.on.Store(false)
			t.Logf("%d script calls sent twice", twice.resent.Load())

			// What was left is what a clean line leaves.
			want := map[string]string{"empty": "", "value": "v", "one-value": "w", "one-checkpoint": ""}
			for key, v := range want {
				o, err := clean.Begin(ctx, "s", key)
				if assert.NoError(t, err, key) && assert.True(t, o.Replayed, "%s: not completed", key) {
					assert.Equal(t, v, string(o.Value), key)
				}
			}
			for _, key := range []string{"release", "one-release"} {
				o, err := clean.Begin(ctx, "s", key)
				if assert.NoError(t, err, key) && assert.NotNil(t, o.Claim, key) {
					assert.Equal(t, 2, o.Claim.Attempt(), "%s: released once, claimed again", key)
				}
			}
			for _, key := range []string{"one-extend", "extend"} {
				_, err := clean.Begin(ctx, "s", key)
				assert.ErrorIs(t, err, ErrInProgress, key)
			}
			o, err := clean.Begin(ctx, "s", "final")
			if assert.NoError(t, err) && assert.True(t, o.Replayed) {
				assert.Equal(t, "declined", o.Err.Error())
			}
			assert.Equal(t, int32(1), fails.Load())
		})
	})
}

// TestCompactClaimHeldPastTheIndexKeepStaysHeld: a compact claim lives in
// the index, which a claim keeps for the lease and the longer of the
// retention and the marker retention. A claim renewed for longer than that
// (a handler that runs long, its lease renewed on time) is still held: no
// other claim may take the key while its lease is alive ("never two live
// runs"); and its marker, once it completes, answers for the marker
// retention from then.
//
// On redis-server a check is made only when the clock proves the lease
// alive (the other claim came back before the holder's lease end by this
// process's clock, which is never later than Redis's), or the marker within
// its retention; an attempt the machine was too slow for is made again, up
// to five times.
func TestCompactClaimHeldPastTheIndexKeepStaysHeld(t *testing.T) {
	const lease = 300 * time.Millisecond
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		t.Run("in progress", func(t *testing.T) {
			for try := 0; ; try++ {
				require.Less(t, try, 5, "the machine never renewed on time")
				k := newKeeper(t, b, WithPrefix(fmt.Sprintf("held%d:", try)), WithLease(lease), WithRetention(lease), WithMarkerRetention(lease))
				ctx := context.Background()
				res, err := k.BeginBatch(ctx, "s", []string{"x"}, WithCompactClaims())
				require.NoError(t, err)
				c := res[0].Outcome.Claim
				require.NotNil(t, c)
				onTime := true
				// Held for 4 leases, well past the index's keep of 2.
				for i := 0; i < 12; i++ {
					b.Advance(lease / 3)
					if err := k.ExtendBatch(ctx, []*Claim{c})[0]; err != nil {
						onTime = false
						break
					}
				}
				other := newKeeper(t, b, WithPrefix(fmt.Sprintf("held%d:", try)), WithLease(lease), WithRetention(lease), WithMarkerRetention(lease))
				out, err := other.Begin(ctx, "s", "x")
				if !onTime || !time.Now().Before(c.localLeaseEnd()) {
					continue // the lease may have run out: no proof either way
				}
				if out.Claim != nil {
					assert.Fail(t, "two holders", "another Begin claimed the key (token %d, recovered %v) while the compact claim (token %d) is held and its lease, renewed %d times, is alive: its index entry was dropped when the index key expired",
						out.Claim.Token(), out.Claim.Recovered(), c.Token(), 12)
				} else {
					assert.ErrorIs(t, err, ErrInProgress)
				}
				return
			}
		})
		t.Run("marker", func(t *testing.T) {
			const markerRet = 2 * lease
			for try := 0; ; try++ {
				require.Less(t, try, 5, "the machine never renewed on time")
				prefix := fmt.Sprintf("heldm%d:", try)
				k := newKeeper(t, b, WithPrefix(prefix), WithLease(lease), WithRetention(lease), WithMarkerRetention(markerRet))
				ctx := context.Background()
				res, err := k.BeginBatch(ctx, "s", []string{"y"}, WithCompactClaims())
				require.NoError(t, err)
				c := res[0].Outcome.Claim
				require.NotNil(t, c)
				onTime := true
				// Held for 2 leases: completed after the index's keep of
				// lease + marker retention has mostly gone.
				for i := 0; i < 6; i++ {
					b.Advance(lease / 3)
					if err := k.ExtendBatch(ctx, []*Claim{c})[0]; err != nil {
						onTime = false
						break
					}
				}
				sent := time.Now()
				require.NoError(t, k.CompleteBatch(ctx, []Completion{{Claim: c}})[0])
				// Past the index's keep from the claim (lease + marker
				// retention), within the marker retention from the completion.
				b.Advance(markerRet * 3 / 4)
				out, err := k.Begin(ctx, "s", "y")
				if !onTime || !time.Now().Before(sent.Add(markerRet)) {
					continue
				}
				if out.Claim != nil {
					assert.Fail(t, "marker lost", "a Begin within the marker retention (%s) of the completion claimed the key again (token %d): the marker went with the index key, kept from the claim and not from the completion",
						markerRet, out.Claim.Token())
				} else if !out.Replayed {
					assert.ErrorIs(t, err, ErrResultExpired, "past the retention, within the marker retention")
				}
				return
			}
		})
	})
}

// TestConsumeHeldPastTheIndexKeepRunsOnce: the same through Consume: a
// handler that runs for four leases, its lease renewed by Consume, while a
// redelivery of its message comes to another consumer. The redelivery must
// not run beside it (the ledger of the fault suites checks it: a run that
// starts while another holder's lease is alive by its process's clock).
func TestConsumeHeldPastTheIndexKeepRunsOnce(t *testing.T) {
	const lease = 300 * time.Millisecond
	b := redistest.Real(t)
	for try := 0; ; try++ {
		require.Less(t, try, 5, "the machine never renewed on time")
		opts := []Option{WithPrefix(fmt.Sprintf("runonce%d:", try)), WithLease(lease), WithRetention(lease), WithMarkerRetention(lease)}
		first, second := newKeeper(t, b, opts...), newKeeper(t, b, opts...)
		led := newMsgLedger()
		started, release := make(chan struct{}), make(chan struct{})
		var firstRun *msgRun
		done := make(chan []MessageResult)
		go func() {
			res, _ := Consume(context.Background(), first, "s", msgs("long"), msgID, func(ctx context.Context, m msg) error {
				firstRun = led.begin(ctx, m.ID, false)
				close(started)
				select {
				case <-release:
				case <-ctx.Done():
				}
				led.end(firstRun, ctx.Err() == nil)
				return ctx.Err()
			})
			done <- res
		}()
		<-started
		time.Sleep(4 * lease) // past the index's keep of 2 leases
		var again []MessageResult
		for i := 0; i < 3; i++ {
			again, _ = Consume(context.Background(), second, "s", msgs("long"), msgID, func(ctx context.Context, m msg) error {
				run := led.begin(ctx, m.ID, false)
				led.end(run, true)
				return nil
			})
		}
		close(release)
		res := <-done
		if res[0].Status != MessageHandled {
			continue // the first lost its lease (the machine did not renew on time): no proof
		}
		led.check(t, "Consume held past the index keep")
		assert.Equal(t, MessageRetry, again[0].Status, "the redelivery while the message is held: %v", again[0].Err)
		return
	}
}

// lateOnClock is a RedisStore whose batch claim answers come back only after
// late has run: late moves the clock (miniredis's and the Keeper's), and may
// let another consumer take the key over.
type lateOnClock struct {
	*RedisStore
	late func()
}

func (s *lateOnClock) ClaimBatch(ctx context.Context, req BatchClaimRequest) []BatchClaimReply {
	r := s.RedisStore.ClaimBatch(ctx, req)
	s.late()
	return r
}

// TestConsumeLateAnswersOnAMovedClock: the promises of "A holder knows its
// own lease" for a batch claim answered late, with markers on and off, on a
// clock moved by hand (Redis's and the Keeper's, so that the test decides
// when the answer comes): an answer after the lease ran out never starts the
// handler, whether another consumer took the key over meanwhile or not
// (MessageRetry); an answer with less than a third of the lease left is
// renewed before the handler starts; one whose renewal finds the key taken
// over never starts.
func TestConsumeLateAnswersOnAMovedClock(t *testing.T) {
	const lease = time.Second
	markerModes(t, func(t *testing.T, opts ...Option) {
		cases := []struct {
			name     string
			late     time.Duration
			takeOver bool
			// runs says whether the handler may run; renewedFirst, whether
			// it must find its lease renewed before it starts.
			runs, renewedFirst bool
		}{
			{name: "after the lease, taken over", late: lease + time.Millisecond, takeOver: true},
			{name: "after the lease, not taken over", late: lease + time.Millisecond},
			{name: "a quarter left", late: lease * 3 / 4, runs: true, renewedFirst: true},
			{name: "a quarter left, taken over", late: lease * 3 / 4, takeOver: true},
			{name: "half left", late: lease / 2, runs: true},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				b := redistest.Miniredis(t)
				redisNow, err := b.Client.Time(context.Background()).Result()
				require.NoError(t, err)
				clock := &testClock{now: redisNow} // the Keeper's clock, where Redis's is
				advance := func(d time.Duration) { clock.Advance(d); b.Advance(d) }
				rs, err := NewRedisStore(b.Client, opts...)
				require.NoError(t, err)
				other := newKeeper(t, b, append(opts, WithLease(time.Minute))...)
				var taken *Claim
				ls := &lateOnClock{RedisStore: rs, late: func() {
					advance(tc.late)
					if tc.takeOver {
						expireLease(t, rs, "s", "m1")
						out, err := other.Begin(context.Background(), "s", "m1")
						require.NoError(t, err)
						require.NotNil(t, out.Claim, "the other consumer takes the key over")
						taken = out.Claim
					}
				}}
				log := &lateRenewals{lateOnClock: ls, renewed: map[int64]int{}}
				k, err := New(log, append(opts, WithLease(lease), WithRetention(time.Minute), WithClock(clock.Now))...)
				require.NoError(t, err)
				var ran atomic.Bool
				var renewedBefore int
				res, err := Consume(context.Background(), k, "s", msgs("m1"), msgID, func(ctx context.Context, m msg) error {
					ran.Store(true)
					c, _ := ClaimFromContext(ctx)
					renewedBefore = log.renewals(c.Token())
					if left := c.localLeaseEnd().Sub(clock.Now()); left < lease/3 {
						return fmt.Errorf("started with %s of its lease left", left)
					}
					return nil
				})
				require.NoError(t, err)
				assert.Equal(t, tc.runs, ran.Load(), "the handler ran: %v (answer %s late; taken over %v)", ran.Load(), tc.late, tc.takeOver)
				if tc.runs {
					assert.Equal(t, MessageHandled, res[0].Status, "%v", res[0].Err)
				} else {
					assert.Equal(t, MessageRetry, res[0].Status)
					assert.ErrorIs(t, res[0].Err, ErrLeaseLost)
				}
				if tc.renewedFirst {
					assert.Positive(t, renewedBefore, "the claim was not renewed before its handler started")
				}
				if taken != nil {
					assert.NoError(t, taken.Complete(context.Background(), []byte("other"), 0), "the other consumer's claim is its own")
				}
			})
		}
	})
}

// lateRenewals is a lateOnClock that counts the renewals the store took, by
// token.
type lateRenewals struct {
	*lateOnClock
	mu      sync.Mutex
	renewed map[int64]int
}

func (s *lateRenewals) ExtendBatch(ctx context.Context, claims []Fence, lease, keep time.Duration) []error {
	errs := s.lateOnClock.ExtendBatch(ctx, claims, lease, keep)
	s.mu.Lock()
	defer s.mu.Unlock()
	for j, err := range errs {
		if err == nil {
			s.renewed[claims[j].Token]++
		}
	}
	return errs
}

func (s *lateRenewals) renewals(token int64) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.renewed[token]
}

// TestCompactCheckpointWithLostReplyKeepsTheClaim: a compact claim's first
// checkpoint moves it to a record of its own. When every reply of that
// checkpoint is lost (go-redis gives up: ErrUnavailable, the outcome
// unknown) and the checkpoint did take effect, the claim is still held by
// its token: completing it stores its result, and renewing it renews it. A
// lost reply is never a lost lease (the contract: a lost-reply retry answers
// the same; ErrLeaseLost says the claim is no longer the holder).
func TestCompactCheckpointWithLostReplyKeepsTheClaim(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		c := redistest.NewClient(t, b.Client.Options().Addr)
		lost := newScriptFaults(1, false, 1)
		c.AddHook(lost)
		k, err := NewRedis(c, WithLease(time.Minute))
		require.NoError(t, err)
		ctx := context.Background()
		res, err := k.BeginBatch(ctx, "s", []string{"a", "b"}, WithCompactClaims())
		require.NoError(t, err)
		a, bc := res[0].Outcome.Claim, res[1].Outcome.Claim
		require.NotNil(t, a)
		require.NotNil(t, bc)
		lost.on.Store(true)
		err = a.Checkpoint(ctx, "step", []byte("1"))
		lost.on.Store(false)
		require.ErrorIs(t, err, ErrUnavailable, "the checkpoint's reply was lost")
		require.Equal(t, int64(1), lost.dropped.Load())

		assert.NoError(t, a.Extend(ctx), "renewing the claim after a checkpoint whose reply was lost: the claim is still held")
		assert.NoError(t, k.ExtendBatch(ctx, []*Claim{a, bc})[0], "ExtendBatch of it")
		assert.NoError(t, k.CompleteBatch(ctx, []Completion{{Claim: a}})[0], "completing it with an empty result (what Consume stores)")
		out, err := newKeeper(t, b).Begin(ctx, "s", "a")
		if assert.NoError(t, err, "the key answers its stored result") {
			assert.True(t, out.Replayed, "the key's result is stored")
		}
	})
}

// TestBatchStepsOnAFullOrReadOnlyRedisAreUnavailable: every batch step (and
// the steps of a Claim of a batch), on compact claims and on records, on a
// Redis that refuses writes (OOM under noeviction, or a read-only replica),
// answers ErrUnavailable, never ErrCorrupt nor ErrLeaseLost, and changes
// nothing: once Redis takes writes again, the claims are still held, and
// settle as on a healthy Redis.
func TestBatchStepsOnAFullOrReadOnlyRedisAreUnavailable(t *testing.T) {
	for _, mode := range []string{"OOM", "READONLY"} {
		t.Run(mode, func(t *testing.T) {
			markerModes(t, func(t *testing.T, opts ...Option) {
				srv := redistest.Start(t, "--maxmemory-policy", "noeviction")
				admin := srv.Client(t)
				ctx := context.Background()
				master, err := NewRedisStore(admin, opts...)
				require.NoError(t, err)
				var replica *RedisStore
				if mode == "READONLY" {
					r := redistest.StartReplica(t, srv.Addr)
					replica, err = NewRedisStore(r.Client(t), opts...)
					require.NoError(t, err)
				}
				sw := &switchStore{master: master, replica: master}
				if replica != nil {
					sw.replica = replica
				}
				k, err := New(sw, append(opts, WithLease(time.Minute))...)
				require.NoError(t, err)
				keys := []string{"c1", "c2", "c3", "c4", "c5", "r1", "r2", "r3"}
				claims := map[string]*Claim{}
				for _, compact := range []bool{true, false} {
					ks := keys[:5]
					var o []Option
					if compact {
						o = append(o, WithCompactClaims())
					} else {
						ks = keys[5:]
					}
					res, err := k.BeginBatch(ctx, "s", ks, o...)
					require.NoError(t, err)
					for i, r := range res {
						require.NoError(t, r.Err)
						claims[ks[i]] = r.Outcome.Claim
					}
				}
				if mode == "OOM" {
					filler := strings.Repeat("x", 4096)
					for i := 0; i < 300; i++ {
						require.NoError(t, admin.Set(ctx, fmt.Sprintf("filler-%d", i), filler, 0).Err())
					}
					require.NoError(t, admin.ConfigSet(ctx, "maxmemory", "1mb").Err())
				} else {
					// The replica has every claim before it is asked.
					n, err := admin.Do(ctx, "wait", 1, 2000).Int()
					require.NoError(t, err)
					require.Equal(t, 1, n, "the replica acknowledged the claims")
					sw.toReplica.Store(true)
				}
				unavailable := func(what string, err error) {
					t.Helper()
					assert.ErrorIs(t, err, ErrUnavailable, "%s on a Redis that refuses writes", what)
					assert.NotErrorIs(t, err, ErrCorrupt, what)
					assert.NotErrorIs(t, err, ErrLeaseLost, what)
				}
				res, err := k.BeginBatch(ctx, "s", []string{"new1", "new2"}, WithCompactClaims())
				require.NoError(t, err)
				for _, r := range res {
					unavailable("BeginBatch", r.Err)
				}
				all := []*Claim{claims["c1"], claims["c2"], claims["r1"], claims["r2"]}
				for _, err := range k.ExtendBatch(ctx, all) {
					unavailable("ExtendBatch", err)
				}
				for _, err := range k.CompleteBatch(ctx, []Completion{{Claim: claims["c1"]}, {Claim: claims["c2"], Value: []byte("v")}, {Claim: claims["r1"]}}) {
					unavailable("CompleteBatch", err)
				}
				for _, err := range k.ReleaseBatch(ctx, []*Claim{claims["c3"], claims["r2"]}) {
					unavailable("ReleaseBatch", err)
				}
				unavailable("Claim.Checkpoint of a compact claim", claims["c4"].Checkpoint(ctx, "step", []byte("1")))
				unavailable("Claim.Complete of a compact claim", claims["c5"].Complete(ctx, []byte("w"), 0))
				unavailable("Claim.Checkpoint of a record", claims["r3"].Checkpoint(ctx, "step", []byte("1")))

				if mode == "OOM" {
					require.NoError(t, admin.ConfigSet(ctx, "maxmemory", "0").Err())
				} else {
					sw.toReplica.Store(false)
				}
				for _, key := range keys {
					assert.NoError(t, k.ExtendBatch(ctx, []*Claim{claims[key]})[0], "%s is still held once Redis takes writes again", key)
				}
				errs := k.CompleteBatch(ctx, []Completion{{Claim: claims["c1"]}, {Claim: claims["c2"], Value: []byte("v")}, {Claim: claims["r1"]}})
				assert.Equal(t, []error{nil, nil, nil}, errs)
				assert.Equal(t, []error{nil, nil}, k.ReleaseBatch(ctx, []*Claim{claims["c3"], claims["r2"]}))
				assert.NoError(t, claims["c4"].Checkpoint(ctx, "step", []byte("1")))
				assert.NoError(t, claims["c5"].Complete(ctx, []byte("w"), 0))
			})
		})
	}
}

// TestConsumeRemembersARetriedMessageForTheMarkerRetention: a message that
// took more than one delivery to handle (its first handler failed and
// released it, or its first consumer died holding it and a redelivery took
// it over) is remembered as long as one handled at the first try: for the
// marker retention, past the result retention (WithMarkerRetention: "a
// message handled by Consume ... is remembered: for that long a redelivery
// is answered handled before"). Begin past the retention answers
// ErrResultExpired, never a claim; Consume never runs it again.
func TestConsumeRemembersARetriedMessageForTheMarkerRetention(t *testing.T) {
	const retention = time.Second
	cases := map[string]func(t *testing.T, b *redistest.Backend, k *Keeper){
		"failed first": func(t *testing.T, b *redistest.Backend, k *Keeper) {
			res, err := Consume(context.Background(), k, "s", msgs("m1"), msgID, func(context.Context, msg) error { return errFlaky })
			require.NoError(t, err)
			require.Equal(t, MessageRetry, res[0].Status)
		},
		"its consumer died": func(t *testing.T, b *redistest.Backend, k *Keeper) {
			res, err := k.BeginBatch(context.Background(), "s", []string{"m1"}, WithCompactClaims())
			require.NoError(t, err)
			require.NotNil(t, res[0].Outcome.Claim) // and never settled
			b.Advance(retention + 10*time.Millisecond)
		},
		"first try": func(t *testing.T, b *redistest.Backend, k *Keeper) {},
	}
	for name, before := range cases {
		t.Run(name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				k := newKeeper(t, b, WithLease(retention), WithRetention(retention), WithMarkerRetention(time.Hour))
				ctx := context.Background()
				before(t, b, k)
				ran := 0
				handle := func(context.Context, msg) error { ran++; return nil }
				res, err := Consume(ctx, k, "s", msgs("m1"), msgID, handle)
				require.NoError(t, err)
				require.Equal(t, MessageHandled, res[0].Status, "%v", res[0].Err)

				b.Advance(retention + retention/2)
				out, err := k.Begin(ctx, "s", "m1")
				if out.Claim != nil {
					assert.Fail(t, "forgotten", "Begin past the retention, within the marker retention, claimed a message Consume handled (attempt %d, token %d): it is no longer remembered, and its redelivery runs again",
						out.Claim.Attempt(), out.Claim.Token())
					require.NoError(t, out.Claim.Release(ctx))
				} else {
					assert.ErrorIs(t, err, ErrResultExpired)
				}
				_, err = Consume(ctx, k, "s", msgs("m1"), msgID, handle)
				require.NoError(t, err)
				assert.Equal(t, 1, ran, "the handler ran again within the marker retention")
			})
		})
	}
}

// TestCompactClaimCompletedTwiceKeepsItsFirstResult: "a claim completed
// twice keeps its first result" (CompleteBatch): completing a compact claim
// again, with an empty result or a value, after a first completion with
// either, answers nil and leaves the first result, as for a claim kept in a
// record.
func TestCompactClaimCompletedTwiceKeepsItsFirstResult(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		markerModes(t, func(t *testing.T, opts ...Option) {
			k := newKeeper(t, b, append(opts, WithPrefix(fmt.Sprintf("twice-done%d:", len(opts))))...)
			ctx := context.Background()
			values := map[string][]byte{"empty": nil, "value": []byte("v")}
			for first, v1 := range values {
				for second, v2 := range values {
					key := first + "-then-" + second
					res, err := k.BeginBatch(ctx, "s", []string{key}, WithCompactClaims())
					require.NoError(t, err)
					c := res[0].Outcome.Claim
					require.NotNil(t, c)
					require.NoError(t, k.CompleteBatch(ctx, []Completion{{Claim: c, Value: v1}})[0], key)
					assert.NoError(t, k.CompleteBatch(ctx, []Completion{{Claim: c, Value: v2}})[0], "%s: completed again", key)
					out, err := k.Begin(ctx, "s", key)
					if assert.NoError(t, err, key) && assert.True(t, out.Replayed, key) {
						assert.Equal(t, string(v1), string(out.Value), "%s: the first result is kept", key)
					}
				}
			}
		})
	})
}

// Consume and the batch calls keep every per-key promise in the failure
// modes a consumer meets: a claim answered after its lease ran out, a key
// repeated in a batch with another body, a Redis that refuses writes, a
// renewal that never returns.

// lateClaims is a RedisStore whose claim answers come back only after late
// has run: a reply held up (a slow network, a resend after a lost reply, a
// paused process) while the lease goes on running in Redis.
type lateClaims struct {
	*RedisStore
	late func()
}

func (s *lateClaims) Claim(ctx context.Context, id string, req ClaimRequest) (ClaimReply, error) {
	r, err := s.RedisStore.Claim(ctx, id, req)
	s.late()
	return r, err
}

func (s *lateClaims) ClaimBatch(ctx context.Context, req BatchClaimRequest) []BatchClaimReply {
	r := s.RedisStore.ClaimBatch(ctx, req)
	s.late()
	return r
}

func lateKeeper(t *testing.T, b *redistest.Backend, key string) (*Keeper, **Claim) {
	rs, err := NewRedisStore(b.Client)
	require.NoError(t, err)
	var other *Claim
	s := &lateClaims{RedisStore: rs, late: func() { other = takeOver(t, b, "s", key) }}
	k, err := New(s, WithLease(300*time.Millisecond), WithRetention(time.Minute))
	require.NoError(t, err)
	return k, &other
}

// TestDoDoesNotRunALateClaimTakenOver: the reference, single key.
func TestDoDoesNotRunALateClaimTakenOver(t *testing.T) {
	b := redistest.Real(t)
	k, other := lateKeeper(t, b, "single")
	var ran atomic.Bool
	_, err := Do(context.Background(), k, "s", "single", func(ctx context.Context) (int, error) { ran.Store(true); return 1, nil })
	assert.ErrorIs(t, err, ErrLeaseLost)
	assert.False(t, ran.Load(), "Do ran a function whose claim was taken over before its answer came")
	require.NotNil(t, *other)
}

// TestConsumeDoesNotRunALateClaimTakenOver: a batch claim answered after its
// lease ran out, whose key another consumer took over meanwhile, is answered
// MessageRetry and its handler never starts.
func TestConsumeDoesNotRunALateClaimTakenOver(t *testing.T) {
	b := redistest.Real(t)
	k, other := lateKeeper(t, b, "m1")
	var ran atomic.Bool
	res, err := Consume(context.Background(), k, "s", msgs("m1"), msgID, func(ctx context.Context, m msg) error {
		ran.Store(true)
		return nil
	})
	require.NoError(t, err)
	require.NotNil(t, *other, "another consumer holds the key")
	assert.False(t, ran.Load(), "Consume ran a handler while another consumer held its key (token %d)", (*other).Token())
	assert.Equal(t, MessageRetry, res[0].Status)
}

// TestConsumeRepeatedKeyWithOtherFingerprintIsRejected: two messages with
// one key and different bodies (fingerprints) in one batch. The first is
// handled; the second is another request under a used key, which the README
// answers MessageRejected ("used with another fingerprint (WithFingerprints)
// ... MessageRejected, false") and which Consume does answer so when it comes
// in the next batch. In the same batch it is acknowledged as a duplicate:
// its content is dropped without running and without being dead-lettered.
func TestConsumeRepeatedKeyWithOtherFingerprintIsRejected(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		var mu sync.Mutex
		handled := map[string]int{}
		handle := func(ctx context.Context, m msg) error {
			mu.Lock()
			handled[m.Body]++
			mu.Unlock()
			return nil
		}
		batch := []msg{{ID: "order-1", Body: "charge 10"}, {ID: "order-1", Body: "charge 99"}}
		fps := [][]byte{[]byte(batch[0].Body), []byte(batch[1].Body)}
		res, err := Consume(ctx, k, "orders", batch, msgID, handle, WithFingerprints(fps))
		require.NoError(t, err)
		require.Equal(t, MessageHandled, res[0].Status)
		assert.Equal(t, 1, handled["charge 10"])
		assert.Equal(t, 0, handled["charge 99"], "the other body never ran")

		// The same second message, in the next batch: rejected.
		again, err := Consume(ctx, k, "orders", batch[1:], msgID, handle, WithFingerprints(fps[1:]))
		require.NoError(t, err)
		require.Equal(t, MessageRejected, again[0].Status, "next batch: another fingerprint is rejected")
		assert.ErrorIs(t, again[0].Err, ErrMismatch)
		assert.False(t, again[0].Ack)

		// In the first batch it must not be acknowledged either.
		assert.False(t, res[1].Ack, "a message with another fingerprint was acknowledged without running (status %s, err %v)", res[1].Status, res[1].Err)
		assert.NotEqual(t, MessageDuplicate, res[1].Status, "another fingerprint is no duplicate")
	})
}

// markerModes runs f with markers on (the default) and WithoutMarkers: the
// batch scripts of both.
func markerModes(t *testing.T, f func(t *testing.T, opts ...Option)) {
	t.Run("markers", func(t *testing.T) { f(t) })
	t.Run("records", func(t *testing.T) { f(t, WithoutMarkers()) })
}

// TestBatchClaimOnReadOnlyReplicaIsUnavailable: a Redis that is READONLY
// answers ErrUnavailable, never anything else, for a batch as for one key
// (TestReadOnlyReplicaIsUnavailable): BeginBatch answers each key
// ErrUnavailable, Consume MessageRetry.
func TestBatchClaimOnReadOnlyReplicaIsUnavailable(t *testing.T) {
	markerModes(t, batchClaimOnReadOnlyReplica)
}

func batchClaimOnReadOnlyReplica(t *testing.T, opts ...Option) {
	master := redistest.Real(t)
	replica := redistest.Real(t)
	ctx := context.Background()
	addr := strings.Split(master.Client.Options().Addr, ":")
	require.NoError(t, replica.Client.SlaveOf(ctx, addr[0], addr[1]).Err())
	k := newKeeper(t, replica, opts...)

	_, err := k.Begin(ctx, "s", "single")
	require.ErrorIs(t, err, ErrUnavailable, "a single claim on the replica: unavailable")

	res, err := k.BeginBatch(ctx, "s", []string{"b1", "b2"})
	require.NoError(t, err)
	for i, r := range res {
		assert.ErrorIs(t, r.Err, ErrUnavailable, "key %d: a batch claim on the replica must be unavailable, got %v", i, r.Err)
		assert.NotErrorIs(t, r.Err, ErrCorrupt, "key %d: nothing is corrupt", i)
	}

	ran := 0
	out, err := Consume(ctx, k, "s", msgs("m1"), msgID, func(context.Context, msg) error { ran++; return nil })
	require.ErrorIs(t, err, ErrUnavailable, "no claim of the batch was taken: the loop backs off")
	assert.Equal(t, 0, ran)
	assert.Equal(t, MessageRetry, out[0].Status, "a read-only replica is a retry, not a poison message: %v", out[0].Err)
}

// TestBatchClaimUnderOOMIsUnavailable: under maxmemory-policy noeviction a
// full Redis refuses writes: a claim then fails with ErrUnavailable (wrapping
// OOM) and completed keys are still replayed, in a batch as for one key.
func TestBatchClaimUnderOOMIsUnavailable(t *testing.T) {
	markerModes(t, batchClaimUnderOOM)
}

func batchClaimUnderOOM(t *testing.T, opts ...Option) {
	srv := redistest.Start(t, "--maxmemory", "16mb", "--maxmemory-policy", "noeviction")
	client := redistest.NewClient(t, srv.Addr)
	k, err := NewRedis(client, append(opts, WithLease(time.Hour))...)
	require.NoError(t, err)
	ctx := context.Background()

	// A completed key, before Redis is full.
	out, err := k.Begin(ctx, "s", "done")
	require.NoError(t, err)
	require.NoError(t, out.Claim.Complete(ctx, []byte("result"), 0))

	// Fill Redis, then lower maxmemory below what it uses: every write is
	// refused from then on (OOM), reads are not.
	filler := strings.Repeat("x", 4096)
	for i := 0; i < 300; i++ {
		require.NoError(t, client.Set(ctx, fmt.Sprintf("filler-%d", i), filler, 0).Err())
	}
	require.NoError(t, client.ConfigSet(ctx, "maxmemory", "1mb").Err())
	require.ErrorContains(t, client.Set(ctx, "probe", "x", 0).Err(), "OOM")

	_, err = k.Begin(ctx, "s", "new-single")
	require.ErrorIs(t, err, ErrUnavailable, "a single claim: unavailable (OOM)")
	single, err := k.Begin(ctx, "s", "done")
	require.NoError(t, err, "a single claim of a completed key is still replayed")
	require.True(t, single.Replayed)

	res, err := k.BeginBatch(ctx, "s", []string{"new-batch", "done"})
	require.NoError(t, err)
	assert.ErrorIs(t, res[0].Err, ErrUnavailable, "new key in a batch under OOM: want unavailable, got %v", res[0].Err)
	assert.NotErrorIs(t, res[0].Err, ErrCorrupt)
	if assert.NoError(t, res[1].Err, "completed key in a batch under OOM: still replayed") {
		assert.True(t, res[1].Outcome.Replayed)
	}

	ran := 0
	cons, err := Consume(ctx, k, "s", msgs("new-msg", "done"), msgID, func(context.Context, msg) error { ran++; return nil })
	require.NoError(t, err)
	assert.Equal(t, 0, ran)
	assert.Equal(t, MessageRetry, cons[0].Status, "a full Redis is a retry, not a poison message: %v", cons[0].Err)
	assert.Equal(t, MessageReplayed, cons[1].Status, "a completed key is replayed: %v", cons[1].Err)
}

// TestConsumeCancelsWhenTheLeaseRunsOutDuringAHungRenewal: the same for
// Consume, whose handlers' contexts are cancelled "if the renewals find its
// lease lost": a hung ExtendBatch finds nothing, and the redelivery runs the
// message beside the live handler.
func TestConsumeCancelsWhenTheLeaseRunsOutDuringAHungRenewal(t *testing.T) {
	b := redistest.Real(t)
	h := newHangingStore(t, b)
	const lease = 600 * time.Millisecond
	k, err := New(h, WithLease(lease), WithRetention(time.Minute))
	require.NoError(t, err)
	h.setHang(true)

	started := make(chan context.Context, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		_, _ = Consume(context.Background(), k, "s", msgs("m1"), msgID, func(ctx context.Context, m msg) error {
			started <- ctx
			select {
			case <-ctx.Done():
			case <-time.After(30 * time.Second):
			}
			return nil
		})
	}()
	opCtx := <-started
	<-h.entered

	second := takeOver(t, b, "s", "m1")
	t.Logf("redelivery took the message over with token %d while the first handler runs", second.Token())
	select {
	case <-opCtx.Done():
		assert.ErrorIs(t, context.Cause(opCtx), ErrLeaseLost)
	case <-time.After(3 * time.Second):
		assert.Fail(t, "the first handler's context is still live after its lease ran out and a redelivery took the message over")
	}
	h.unblock()
	<-finished
}

// unreachableAnswer reports whether Consume's error err is its answer to a
// batch none of whose claims reached the store: wrapping ErrUnavailable,
// every message answered, none acknowledged.
func unreachableAnswer(res []MessageResult, err error) bool {
	if !errors.Is(err, ErrUnavailable) || res == nil {
		return false
	}
	for _, r := range res {
		if r.Ack || r.Ran {
			return false
		}
	}
	return true
}
