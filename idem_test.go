package idem

import (
	"context"
	"errors"
	"fmt"
	"slices"
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

type receipt struct {
	ID     string
	Amount int64
	Tags   []string
}

func TestDoRunsOnceAndReplays(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		var runs atomic.Int32
		charge := func(ctx context.Context) (receipt, error) {
			runs.Add(1)
			return receipt{ID: "ch_1", Amount: 4200, Tags: []string{"a", "b"}}, nil
		}
		first, err := Do(ctx, k, "tenant-1", "pay-1", charge)
		require.NoError(t, err)
		for i := 0; i < 3; i++ {
			again, err := Do(ctx, k, "tenant-1", "pay-1", charge)
			require.NoError(t, err)
			assert.Equal(t, first, again)
		}
		assert.EqualValues(t, 1, runs.Load())

		// The same key under another scope is another record.
		_, err = Do(ctx, k, "tenant-2", "pay-1", charge)
		require.NoError(t, err)
		assert.EqualValues(t, 2, runs.Load())
	})
}

func TestConcurrentDuplicatesRunOnce(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		var runs, inProgress, replays atomic.Int32
		release := make(chan struct{})
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := 0; i < 100; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				v, err := Do(ctx, k, "s", "one-key", func(ctx context.Context) (int, error) {
					runs.Add(1)
					<-release
					return 7, nil
				})
				switch {
				case errors.Is(err, ErrInProgress):
					inProgress.Add(1)
				case err == nil && v == 7:
					replays.Add(1)
				default:
					assert.Failf(t, "neither ErrInProgress nor the value 7", "unexpected answer %v, %v", v, err)
				}
			}()
		}
		close(start)
		// Let every racer reach Redis before the first one finishes.
		require.Eventually(t, func() bool { return inProgress.Load()+runs.Load() == 100 }, 10*time.Second, time.Millisecond)
		close(release)
		wg.Wait()
		assert.EqualValues(t, 1, runs.Load())
		assert.EqualValues(t, 99, inProgress.Load())
		assert.EqualValues(t, 1, replays.Load(), "the runner itself returns the value")

		v, err := Do(ctx, k, "s", "one-key", func(ctx context.Context) (int, error) { return 0, errors.New("must not run") })
		require.NoError(t, err)
		assert.Equal(t, 7, v)
	})
}

func TestManyKeysManyRacers(t *testing.T) {
	redistest.Long(t)
	b := redistest.Real(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	const keys, racers, workers = 10000, 8, 64
	var executions atomic.Int64
	perKey := make([]atomic.Int32, keys)
	jobs := make(chan int, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				key := fmt.Sprintf("k-%d", i/racers)
				_, err := Do(ctx, k, "load", key, func(ctx context.Context) (int, error) {
					executions.Add(1)
					perKey[i/racers].Add(1)
					return i / racers, nil
				})
				if !errors.Is(err, ErrInProgress) {
					assert.NoError(t, err, "key %s", key)
				}
			}
		}()
	}
	// Consecutive jobs are the racers of one key, so the workers that take
	// them race each other.
	for i := 0; i < keys*racers; i++ {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	assert.EqualValues(t, keys, executions.Load())
	for i := range perKey {
		require.Equal(t, int32(1), perKey[i].Load(), "times key %d executed", i)
	}
}

func TestLeaseExpiryTakeoverFencesTheOldHolder(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(200*time.Millisecond), WithRetention(time.Minute))
		ctx := context.Background()
		old, err := k.Begin(ctx, "s", "lease")
		require.NoError(t, err)
		require.NotNil(t, old.Claim)
		assert.Equal(t, 1, old.Claim.Attempt())
		assert.False(t, old.Claim.Recovered())

		_, err = k.Begin(ctx, "s", "lease")
		var ip *InProgressError
		require.ErrorAs(t, err, &ip)
		assert.Greater(t, ip.RetryAfter, time.Duration(0))
		assert.LessOrEqual(t, ip.RetryAfter, 200*time.Millisecond)

		b.Advance(300 * time.Millisecond)
		next, err := k.Begin(ctx, "s", "lease")
		require.NoError(t, err)
		require.NotNil(t, next.Claim)
		assert.Greater(t, next.Claim.Token(), old.Claim.Token())
		assert.True(t, next.Claim.Recovered())
		assert.Equal(t, 2, next.Claim.Attempt())

		require.ErrorIs(t, old.Claim.Complete(ctx, []byte("stale"), 0), ErrLeaseLost)
		require.ErrorIs(t, old.Claim.Extend(ctx), ErrLeaseLost)
		require.ErrorIs(t, old.Claim.Release(ctx), ErrLeaseLost)

		require.NoError(t, next.Claim.Complete(ctx, []byte("fresh"), 0))
		require.ErrorIs(t, old.Claim.Complete(ctx, []byte("stale"), 0), ErrLeaseLost)
		got, err := k.Begin(ctx, "s", "lease")
		require.NoError(t, err)
		assert.True(t, got.Replayed)
		assert.Equal(t, "fresh", string(got.Value))
		assert.Equal(t, next.Claim.Token(), got.Token)
	})
}

func TestExpiredLeaseNotTakenOverIsStillTheHolders(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(100*time.Millisecond), WithRetention(time.Minute))
		ctx := context.Background()
		out, err := k.Begin(ctx, "s", "late")
		require.NoError(t, err)
		b.Advance(200 * time.Millisecond)
		// Nobody took the key over, so the token is still current.
		require.NoError(t, out.Claim.Complete(ctx, []byte("late but only"), 0))
		got, err := k.Begin(ctx, "s", "late")
		require.NoError(t, err)
		assert.Equal(t, "late but only", string(got.Value))
	})
}

func TestTokensStrictlyIncrease(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		const lease = 100 * time.Millisecond
		k := newKeeper(t, b, WithLease(lease), WithRetention(300*time.Millisecond))
		ctx := context.Background()
		var tokens []int64
		claim := func(step string) *Claim {
			t.Helper()
			out, err := k.Begin(ctx, "s", "tokens")
			require.NoError(t, err, step)
			require.NotNil(t, out.Claim, step)
			tokens = append(tokens, out.Claim.Token())
			return out.Claim
		}
		claim("first claim")
		b.Advance(2 * lease)
		c := claim("takeover after the lease")
		require.NoError(t, c.Release(ctx))
		c = claim("claim after release")
		require.NoError(t, c.Release(ctx))
		b.Advance(2 * lease) // the released marker expires
		c = claim("claim after the marker expired")
		require.NoError(t, c.Complete(ctx, []byte("x"), 0))
		b.Advance(500 * time.Millisecond) // the completed record expires
		n, err := b.Client.Exists(ctx, k.store.(*redisStore).key(recordID("s", "tokens"))).Result()
		require.NoError(t, err)
		require.Zero(t, n, "the record should have expired")
		claim("claim after the record expired")
		for i := 1; i < len(tokens); i++ {
			assert.Greater(t, tokens[i], tokens[i-1], "token %d", i)
		}
	})
}

func TestRetriedCommandsAreIdempotent(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		s, err := openRedisStore(b.Client)
		require.NoError(t, err)
		ctx := context.Background()
		req := claimRequest{Attempt: "attempt-1", Lease: time.Minute, Keep: time.Hour}
		first, err := s.Claim(ctx, "rec", req)
		require.NoError(t, err)
		require.Equal(t, statusClaimed, first.Status)

		// go-redis resent the claim because its reply was lost.
		again, err := s.Claim(ctx, "rec", req)
		require.NoError(t, err)
		assert.Equal(t, first, again)

		other := req
		other.Attempt = "attempt-2"
		busy, err := s.Claim(ctx, "rec", other)
		require.NoError(t, err)
		assert.Equal(t, statusInProgress, busy.Status)

		require.NoError(t, s.Extend(ctx, "rec", first.Token, time.Minute, time.Hour))
		require.NoError(t, s.Extend(ctx, "rec", first.Token, time.Minute, time.Hour))
		require.NoError(t, errOf(s.Complete(ctx, "rec", first.Token, seal(kindBytes, []byte("v")), time.Hour)))
		require.NoError(t, errOf(s.Complete(ctx, "rec", first.Token, seal(kindBytes, []byte("v")), time.Hour)))
		require.ErrorIs(t, errOf(s.Complete(ctx, "rec", first.Token-1, seal(kindBytes, []byte("w")), time.Hour)), ErrLeaseLost)

		c2, err := s.Claim(ctx, "rec2", req)
		require.NoError(t, err)
		require.NoError(t, s.Release(ctx, "rec2", c2.Token, time.Minute))
		require.NoError(t, s.Release(ctx, "rec2", c2.Token, time.Minute))
		require.ErrorIs(t, errOf(s.Complete(ctx, "rec2", c2.Token, seal(kindBytes, nil), time.Hour)), ErrLeaseLost)
		require.ErrorIs(t, s.Extend(ctx, "rec2", c2.Token, time.Minute, time.Hour), ErrLeaseLost)
	})
}

func TestMismatchedFingerprint(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		out, err := k.Begin(ctx, "s", "fp", WithFingerprint([]byte("amount=10")))
		require.NoError(t, err)
		_, err = k.Begin(ctx, "s", "fp", WithFingerprint([]byte("amount=11")))
		require.ErrorIs(t, err, ErrMismatch, "pending record")
		require.NoError(t, out.Claim.Complete(ctx, []byte("ok"), 0))
		_, err = k.Begin(ctx, "s", "fp", WithFingerprint([]byte("amount=11")))
		require.ErrorIs(t, err, ErrMismatch, "completed record")
		_, err = k.Begin(ctx, "s", "fp")
		require.ErrorIs(t, err, ErrMismatch, "no fingerprint")
		got, err := k.Begin(ctx, "s", "fp", WithFingerprint([]byte("amount=10")))
		require.NoError(t, err)
		assert.Equal(t, "ok", string(got.Value))

		// After a release the key is free for any request.
		out, err = k.Begin(ctx, "s", "fp2", WithFingerprint([]byte("a")))
		require.NoError(t, err)
		require.NoError(t, out.Claim.Release(ctx))
		out, err = k.Begin(ctx, "s", "fp2", WithFingerprint([]byte("b")))
		require.NoError(t, err)
		assert.NotNil(t, out.Claim)
	})
}

func TestScriptFlushFallsBackToEval(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithLease(time.Minute))
		ctx := context.Background()
		flush := func() { require.NoError(t, b.Client.ScriptFlush(ctx).Err()) }
		flush()
		out, err := k.Begin(ctx, "s", "flush")
		require.NoError(t, err)
		flush()
		require.NoError(t, out.Claim.Extend(ctx))
		flush()
		require.NoError(t, out.Claim.Release(ctx))
		flush()
		v, err := Do(ctx, k, "s", "flush", func(ctx context.Context) (string, error) { return "done", nil })
		require.NoError(t, err)
		flush()
		again, err := Do(ctx, k, "s", "flush", func(ctx context.Context) (string, error) { return "twice", nil })
		require.NoError(t, err)
		assert.Equal(t, v, again)
	})
}

func TestRoundTrips(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var cnt redistest.Counter
		b.Client.AddHook(&cnt)
		k := newKeeper(t, b)
		ctx := context.Background()
		require.NoError(t, k.store.(*redisStore).LoadScripts(ctx))
		fp := WithFingerprint([]byte("body"))
		ok := func(ctx context.Context) (string, error) { return "ok", nil }

		assert.EqualValues(t, 2, cnt.Count(func() {
			_, err := Do(ctx, k, "s", "rt", ok, fp)
			require.NoError(t, err)
		}), "first execution: claim and complete")
		assert.EqualValues(t, 1, cnt.Count(func() {
			_, err := Do(ctx, k, "s", "rt", ok, fp)
			require.NoError(t, err)
		}), "replay")
		assert.EqualValues(t, 1, cnt.Count(func() {
			_, err := Do(ctx, k, "s", "rt", ok, WithFingerprint([]byte("other")))
			require.ErrorIs(t, err, ErrMismatch)
		}), "mismatch")
		held, err := k.Begin(ctx, "s", "busy")
		require.NoError(t, err)
		assert.EqualValues(t, 1, cnt.Count(func() {
			_, err := Do(ctx, k, "s", "busy", ok)
			require.ErrorIs(t, err, ErrInProgress)
		}), "in progress")
		assert.EqualValues(t, 0, cnt.Count(func() {
			_, err := Do(ctx, k, "s", "", ok)
			require.ErrorIs(t, err, ErrInvalidKey)
		}), "invalid key")
		require.NoError(t, held.Claim.Release(ctx))
	})
}

func TestStoredKeyLayout(t *testing.T) {
	b := redistest.Miniredis(t)
	s, err := openRedisStore(b.Client, WithPrefix("app1:"))
	require.NoError(t, err)
	k, err := keeperOn(s)
	require.NoError(t, err)
	ctx := context.Background()
	keys := []string{"k", "payment/2024-01-01/very-secret-client-key", strings.Repeat("x", MaxKeyLen)}
	for _, key := range keys {
		_, err := Do(ctx, k, "tenant", key, func(ctx context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
	}
	stored, err := b.Client.Keys(ctx, "*").Result()
	require.NoError(t, err)
	// The prefix's record (how its keys are written) beside the records.
	require.Contains(t, stored, "app1:layout")
	stored = slices.DeleteFunc(stored, func(sk string) bool { return sk == "app1:layout" })
	require.Len(t, stored, len(keys))
	for _, sk := range stored {
		assert.Len(t, sk, len("app1:{}")+idLen, sk)
		assert.True(t, strings.HasPrefix(sk, "app1:{") && strings.HasSuffix(sk, "}"), sk)
		for _, key := range keys {
			assert.NotContains(t, sk, key)
		}
	}
	assert.NotEqual(t, recordID("ab", "c"), recordID("a", "bc"))
}

func TestErrorsReleaseFinalErrorsReplay(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		var runs atomic.Int32
		boom := errors.New("card network timeout")
		_, err := Do(ctx, k, "s", "retryable", func(ctx context.Context) (int, error) {
			runs.Add(1)
			return 0, boom
		})
		require.ErrorIs(t, err, boom)
		v, err := Do(ctx, k, "s", "retryable", func(ctx context.Context) (int, error) {
			runs.Add(1)
			return 5, nil
		})
		require.NoError(t, err)
		assert.Equal(t, 5, v)
		assert.EqualValues(t, 2, runs.Load(), "an ordinary error releases the key")

		declined := errors.New("card declined")
		_, err = Do(ctx, k, "s", "final", func(ctx context.Context) (int, error) {
			return 0, Final(declined)
		})
		require.ErrorIs(t, err, declined)
		var fe *FinalError
		require.ErrorAs(t, err, &fe)
		assert.False(t, fe.Replayed)
		_, err = Do(ctx, k, "s", "final", func(ctx context.Context) (int, error) {
			assert.Fail(t, "a final error must be replayed, not run again")
			return 0, nil
		})
		require.ErrorAs(t, err, &fe)
		assert.True(t, fe.Replayed)
		assert.Equal(t, "card declined", err.Error())
	})
}

func TestPanicReleasesAndRepanics(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	func() {
		defer func() {
			assert.Equal(t, "kaboom", recover())
		}()
		_, _ = Do(ctx, k, "s", "panic", func(ctx context.Context) (int, error) { panic("kaboom") })
		assert.Fail(t, "Do returned after a panic")
	}()
	v, err := Do(ctx, k, "s", "panic", func(ctx context.Context) (int, error) { return 3, nil })
	require.NoError(t, err, "the claim was released, so the retry runs")
	assert.Equal(t, 3, v)
}

func TestLeaseLostCancelsTheOperation(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		const lease = 300 * time.Millisecond
		k := newKeeper(t, b, WithLease(lease), WithRetention(time.Minute))
		ctx := context.Background()
		started := make(chan struct{})
		taken := make(chan struct{})
		var cause error
		var token int64
		errc := make(chan error, 1)
		go func() {
			_, err := Do(ctx, k, "s", "lost", func(ctx context.Context) (string, error) {
				if c, ok := ClaimFromContext(ctx); ok {
					token = c.Token()
				}
				close(started)
				<-taken
				<-ctx.Done()
				cause = context.Cause(ctx)
				return "stale result", nil
			})
			errc <- err
		}()
		<-started
		// Simulate a pause: the lease runs out and another process takes over.
		var next Outcome
		if b.Real {
			// Redis's clock cannot be moved, and the background renewals keep
			// the lease alive: end the lease in Redis's view by rewriting the
			// record's lease end to the past, then take over. A renewal may
			// land in between; then try again.
			key := k.store.(*redisStore).key(recordID("s", "lost"))
			for i := 0; next.Claim == nil && i < 50; i++ {
				rec, err := b.Client.Get(ctx, key).Result()
				require.NoError(t, err)
				parts := strings.SplitN(rec, ":", 5)
				parts[3] = "1"
				require.NoError(t, b.Client.Set(ctx, key, strings.Join(parts, ":"), time.Minute).Err())
				next, err = k.Begin(ctx, "s", "lost")
				if !errors.Is(err, ErrInProgress) {
					require.NoError(t, err)
				}
			}
		} else {
			b.Advance(2 * lease)
			var err error
			next, err = k.Begin(ctx, "s", "lost")
			require.NoError(t, err)
		}
		require.NotNil(t, next.Claim)
		assert.True(t, next.Claim.Recovered())
		assert.Greater(t, next.Claim.Token(), token)
		close(taken)
		err := <-errc
		require.ErrorIs(t, err, ErrLeaseLost)
		require.ErrorIs(t, cause, ErrLeaseLost)
		require.NoError(t, next.Claim.Complete(ctx, []byte("current"), 0))
		got, err := k.Begin(ctx, "s", "lost")
		require.NoError(t, err)
		assert.Equal(t, "current", string(got.Value), "the stale holder's result is not stored")
	})
}

func TestWaitGetsTheResult(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		out, err := k.Begin(ctx, "s", "wait")
		require.NoError(t, err)
		go func() {
			time.Sleep(50 * time.Millisecond)
			assert.NoError(t, out.Claim.Complete(ctx, seal(kindValue, []byte{0x2a})[2:], 0))
		}()
		got, err := k.Begin(ctx, "s", "wait", WithWait(10*time.Second))
		require.NoError(t, err)
		assert.True(t, got.Replayed)

		// A bounded wait ends with the in-progress error.
		held, err := k.Begin(ctx, "s", "wait-bounded")
		require.NoError(t, err)
		_, err = k.Begin(ctx, "s", "wait-bounded", WithWait(30*time.Millisecond))
		require.ErrorIs(t, err, ErrInProgress)
		// A context that ends first ends the wait with the caller's own
		// error, whether it ended during the wait or during a claim (a
		// loaded machine may take 30ms to answer).
		cctx, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
		defer cancel()
		_, err = k.Begin(cctx, "s", "wait-bounded", WithWait(time.Minute))
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NotErrorIs(t, err, ErrUnavailable)
		require.NoError(t, held.Claim.Release(ctx))

		// A waiter whose runner releases runs the operation itself.
		held, err = k.Begin(ctx, "s", "wait-release")
		require.NoError(t, err)
		go func() {
			time.Sleep(50 * time.Millisecond)
			assert.NoError(t, held.Claim.Release(ctx))
		}()
		v, err := Do(ctx, k, "s", "wait-release", func(ctx context.Context) (int, error) { return 9, nil }, WithWait(10*time.Second))
		require.NoError(t, err)
		assert.Equal(t, 9, v)
	})
}

func TestUnavailableIsTyped(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		b.Stop()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := Do(ctx, k, "s", "down", func(ctx context.Context) (int, error) {
			assert.Fail(t, "must not run when the store is down")
			return 0, nil
		})
		require.ErrorIs(t, err, ErrUnavailable)
		require.NotErrorIs(t, err, ErrInProgress)
		require.NoError(t, ctx.Err(), "answered within the deadline")
	})
}

func TestReadOnlyReplicaIsUnavailable(t *testing.T) {
	master := redistest.Real(t)
	replica := redistest.Real(t)
	ctx := context.Background()
	addr := strings.Split(master.Client.Options().Addr, ":")
	require.NoError(t, replica.Client.SlaveOf(ctx, addr[0], addr[1]).Err())
	k := newKeeper(t, replica)
	_, err := Do(ctx, k, "s", "ro", func(ctx context.Context) (int, error) {
		assert.Fail(t, "must not run on a read-only replica")
		return 0, nil
	})
	require.ErrorIs(t, err, ErrUnavailable)
	var rerr redis.Error
	require.ErrorAs(t, err, &rerr)
	assert.Contains(t, rerr.Error(), "READONLY")
}

func TestEncodingFailureIsStoredAsFinal(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	var runs int
	fn := func(ctx context.Context) (func(), error) { runs++; return func() {}, nil }
	_, err := Do(ctx, k, "s", "enc", fn)
	var fe *FinalError
	require.ErrorAs(t, err, &fe)
	_, err = Do(ctx, k, "s", "enc", fn)
	require.ErrorAs(t, err, &fe)
	assert.True(t, fe.Replayed)
	assert.Equal(t, 1, runs, "the operation ran once; its outcome is replayed")
}
