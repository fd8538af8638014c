package idem

// Compact claims, kept in the index of compact.go rather than in records
// of their own, in the failure modes a consumer meets, one at a time and
// deterministic where Redis's clock can be moved by hand: claims held
// longer than their index is kept, a checkpoint whose reply was lost, and
// a claim completed twice.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

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
				res, err := k.batchBegin(ctx, "s", []string{"x"}, withCompactClaims())
				require.NoError(t, err)
				c := res[0].Outcome.Claim
				require.NotNil(t, c)
				onTime := true
				// Held for 4 leases, well past the index's keep of 2.
				for i := 0; i < 12; i++ {
					b.Advance(lease / 3)
					if err := k.extendClaims(ctx, []*Claim{c})[0]; err != nil {
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
				res, err := k.batchBegin(ctx, "s", []string{"y"}, withCompactClaims())
				require.NoError(t, err)
				c := res[0].Outcome.Claim
				require.NotNil(t, c)
				onTime := true
				// Held for 2 leases: completed after the index's keep of
				// lease + marker retention has mostly gone.
				for i := 0; i < 6; i++ {
					b.Advance(lease / 3)
					if err := k.extendClaims(ctx, []*Claim{c})[0]; err != nil {
						onTime = false
						break
					}
				}
				sent := time.Now()
				require.NoError(t, k.completeClaims(ctx, []completion{{Claim: c}})[0])
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
		select {
		case <-started:
		case res := <-done:
			// No handler ran: the claim's lease ran out before its work
			// would start (a machine too busy to answer within the lease).
			t.Logf("try %d: the first consumer ran nothing: %+v", try, res)
			continue
		}
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
		res, err := k.batchBegin(ctx, "s", []string{"a", "b"}, withCompactClaims())
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
		assert.NoError(t, k.extendClaims(ctx, []*Claim{a, bc})[0], "ExtendBatch of it")
		assert.NoError(t, k.completeClaims(ctx, []completion{{Claim: a}})[0], "completing it with an empty result (what Consume stores)")
		out, err := newKeeper(t, b).Begin(ctx, "s", "a")
		if assert.NoError(t, err, "the key answers its stored result") {
			assert.True(t, out.Replayed, "the key's result is stored")
		}
	})
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
					res, err := k.batchBegin(ctx, "s", []string{key}, withCompactClaims())
					require.NoError(t, err)
					c := res[0].Outcome.Claim
					require.NotNil(t, c)
					require.NoError(t, k.completeClaims(ctx, []completion{{Claim: c, Value: v1}})[0], key)
					assert.NoError(t, k.completeClaims(ctx, []completion{{Claim: c, Value: v2}})[0], "%s: completed again", key)
					out, err := k.Begin(ctx, "s", key)
					if assert.NoError(t, err, key) && assert.True(t, out.Replayed, key) {
						assert.Equal(t, string(v1), string(out.Value), "%s: the first result is kept", key)
					}
				}
			}
		})
	})
}

// TestCompactCompletionWithValueAfterScriptFlush: a completion with a value
// moves a compact claim to a record of its own and completes that record,
// the move first, in one pipeline. A Redis that lost its scripts (a
// restart, a failover to a replica that never ran them, SCRIPT FLUSH)
// refuses the move NOSCRIPT while a completion script it has again runs:
// the completion must wait for the move, not answer ErrLeaseLost and leave
// the claim held until its lease runs out and its handler runs again.
func TestCompactCompletionWithValueAfterScriptFlush(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithPrefix("flushed-move:"))
		ctx := context.Background()
		res, err := k.batchBegin(ctx, "s", []string{"a", "b"}, withCompactClaims())
		require.NoError(t, err)
		a, bc := res[0].Outcome.Claim, res[1].Outcome.Claim
		require.NotNil(t, a)
		require.NotNil(t, bc)
		require.NotZero(t, a.fence().Ref, "the claim is compact")

		require.NoError(t, b.Client.ScriptFlush(ctx).Err())
		require.NoError(t, b.Client.ScriptLoad(ctx, batchCompleteScript.src).Err())
		errs := k.completeClaims(ctx, []completion{{Claim: a, Value: []byte("va")}, {Claim: bc, Value: []byte("vb")}})
		for i, err := range errs {
			assert.NoError(t, err, "completion %d", i)
		}
		for key, want := range map[string]string{"a": "va", "b": "vb"} {
			out, err := k.Begin(ctx, "s", key)
			if assert.NoError(t, err, key) && assert.True(t, out.Replayed, "%s is completed", key) {
				assert.Equal(t, want, string(out.Value), key)
			}
		}
	})
}
