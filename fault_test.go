package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// faultLedger follows the executions of fn per key under faults.
type faultLedger struct {
	mu         sync.Mutex
	runs       map[string]int
	active     map[string]bool
	ackedAt    map[string]bool // a Do call for the key returned its result
	overlaps   int             // fn started while another fn for the key ran
	afterAck   int             // fn started after a result for the key was acknowledged
	notRecov   int             // a second run whose claim was not marked recovered
	recovered  int             // second runs after a takeover, as the contract allows
	errsByKind map[string]int
	untyped    []error
}

func newFaultLedger() *faultLedger {
	return &faultLedger{runs: map[string]int{}, active: map[string]bool{}, ackedAt: map[string]bool{}, errsByKind: map[string]int{}}
}

// fn returns the operation for key: it notes its run and checks the
// invariants before it does anything.
func (l *faultLedger) fn(key string) func(ctx context.Context) (string, error) {
	return func(ctx context.Context) (string, error) {
		c, _ := ClaimFromContext(ctx)
		l.mu.Lock()
		if l.active[key] {
			l.overlaps++
		}
		if l.ackedAt[key] {
			l.afterAck++
		}
		if l.runs[key] > 0 {
			if c == nil || !c.Recovered() {
				l.notRecov++
			} else {
				l.recovered++
			}
		}
		l.runs[key]++
		l.active[key] = true
		l.mu.Unlock()
		time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
		l.mu.Lock()
		l.active[key] = false
		l.mu.Unlock()
		return "v:" + key, nil
	}
}

// outcome records what a Do call answered.
func (l *faultLedger) outcome(key, v string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case err == nil:
		if v != "v:"+key {
			l.untyped = append(l.untyped, fmt.Errorf("%s answered %q", key, v))
		}
		l.ackedAt[key] = true
	case errors.Is(err, ErrInProgress):
		l.errsByKind["in progress"]++
	case errors.Is(err, ErrLeaseLost):
		l.errsByKind["lease lost"]++
	case errors.Is(err, ErrUnavailable):
		l.errsByKind["unavailable"]++
	default:
		l.untyped = append(l.untyped, err)
	}
}

// TestFaults runs Do from several workers on a few keys through a fault
// proxy that cuts connections, drops replies after the server executed the
// command, delays replies past the client's read timeout, or closes every
// connection at once; go-redis retries as it does by default. Under each:
// fn never runs twice for a key at once, never after a result for the key was
// acknowledged, and a second run is always a marked takeover (Recovered) of a
// claim whose result was never stored; every failure the caller sees is
// typed; and once the faults stop, no key is stuck beyond its lease.
func TestFaults(t *testing.T) {
	srv := redistest.Start(t)
	scenarios := []struct {
		name   string
		faults faultproxy.Faults
		cutAll bool
	}{
		{name: "cut connections", faults: faultproxy.Faults{Cut: 0.2}},
		{name: "drop replies after execution", faults: faultproxy.Faults{DropReply: 0.2}},
		{name: "delay replies past the read timeout", faults: faultproxy.Faults{Delay: 150 * time.Millisecond, Slow: 0.2}},
		{name: "close every connection", cutAll: true},
	}
	for i, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			p, err := faultproxy.New(srv.Addr, uint64(i+1))
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			c := redis.NewClient(&redis.Options{
				Addr: p.Addr(), ReadTimeout: 100 * time.Millisecond, WriteTimeout: 100 * time.Millisecond,
				DialTimeout: time.Second, PoolSize: 16,
			})
			defer c.Close()
			const lease = 300 * time.Millisecond
			prefix := "fault" + strconv.Itoa(i) + ":"
			k := clusterKeeper(t, c, []Option{WithPrefix(prefix)}, WithLease(lease), WithRetention(time.Minute))
			l := newFaultLedger()
			p.Set(sc.faults)
			stopCuts := make(chan struct{})
			var cuts sync.WaitGroup
			if sc.cutAll {
				cuts.Add(1)
				go func() {
					defer cuts.Done()
					for {
						select {
						case <-stopCuts:
							return
						case <-time.After(15 * time.Millisecond):
							p.CutAll()
						}
					}
				}()
			}
			ctx := context.Background()
			const keys, workers, calls = 100, 8, 50
			var wg sync.WaitGroup
			var ops atomic.Int64
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(w), uint64(i)))
					for j := 0; j < calls; j++ {
						key := "k" + strconv.Itoa(r.IntN(keys))
						v, err := Do(ctx, k, "faults", key, l.fn(key))
						ops.Add(1)
						l.outcome(key, v, err)
					}
				}()
			}
			wg.Wait()
			close(stopCuts)
			cuts.Wait()
			p.Set(faultproxy.Faults{})

			// No key is stuck: once the lease has run out, every key answers,
			// here to a client without faults or short timeouts.
			time.Sleep(lease + 50*time.Millisecond)
			direct := clusterKeeper(t, srv.Client(t), []Option{WithPrefix(prefix)}, WithLease(lease), WithRetention(time.Minute))
			stuck := 0
			for n := 0; n < keys; n++ {
				key := "k" + strconv.Itoa(n)
				v, err := Do(ctx, direct, "faults", key, l.fn(key))
				if err != nil {
					stuck++
					t.Errorf("%s after the faults stopped and the lease ran out: %v", key, err)
				}
				l.outcome(key, v, err)
			}

			l.mu.Lock()
			defer l.mu.Unlock()
			runs := 0
			for _, n := range l.runs {
				runs += n
			}
			t.Logf("%s: %d calls, %d runs of fn on %d keys, %d recovered re-runs; duplicates: %d overlapping, %d after an acknowledged result, %d unmarked; failures %v; proxy %+v; stuck %d",
				sc.name, ops.Load(), runs, len(l.runs), l.recovered, l.overlaps, l.afterAck, l.notRecov, l.errsByKind, p.Stats(), stuck)
			if l.overlaps != 0 || l.afterAck != 0 || l.notRecov != 0 {
				t.Errorf("duplicate executions: %d overlapping, %d after an acknowledged result, %d unmarked re-runs", l.overlaps, l.afterAck, l.notRecov)
			}
			for _, err := range l.untyped {
				t.Errorf("untyped failure: %v", err)
			}
			if st := p.Stats(); st.Cuts+st.DroppedReplies+st.DelayedReplies == 0 {
				t.Errorf("the proxy put in no fault: %+v", st)
			}
		})
	}
}

// TestLeaseExpiryChaos: handlers that pause past their lease at random, on
// keys that several workers claim at once. A completion by a holder whose key
// was taken over must be refused (stale completions accepted: must be 0), and
// the stored result of every key must be the one of its last holder, whose
// token is the highest ever handed out for the key.
func TestLeaseExpiryChaos(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	const lease = 40 * time.Millisecond
	k := clusterKeeper(t, c, []Option{WithPrefix("chaos:")}, WithLease(lease), WithRetention(time.Minute))
	ctx := context.Background()
	start := time.Now()

	type grant struct {
		token int64
		at    time.Duration // when Begin returned the claim
	}
	var (
		mu            sync.Mutex
		grants        = map[string][]grant{}
		staleAccepted int
		staleRefused  int
		paused        int
		completed     int
		untyped       []error
	)
	const keys, workers = 60, 6
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 7))
			for n := 0; n < keys; n++ {
				key := "k" + strconv.Itoa(n)
				for try := 0; try < 50; try++ {
					out, err := k.Begin(ctx, "chaos", key)
					if errors.Is(err, ErrInProgress) {
						time.Sleep(time.Duration(5+r.IntN(20)) * time.Millisecond)
						continue
					}
					if err != nil {
						mu.Lock()
						untyped = append(untyped, err)
						mu.Unlock()
						break
					}
					if out.Replayed {
						break
					}
					cl := out.Claim
					mu.Lock()
					grants[key] = append(grants[key], grant{cl.Token(), time.Since(start)})
					mu.Unlock()
					// Pause past the lease now and then, as a GC pause or a
					// stalled disk would.
					if r.IntN(3) == 0 {
						mu.Lock()
						paused++
						mu.Unlock()
						time.Sleep(lease + time.Duration(10+r.IntN(40))*time.Millisecond)
					}
					called := time.Since(start)
					err = cl.Complete(ctx, []byte(strconv.FormatInt(cl.Token(), 10)), 0)
					mu.Lock()
					overtaken := false
					for _, g := range grants[key] {
						if g.token > cl.Token() && g.at < called {
							overtaken = true
						}
					}
					switch {
					case err == nil && overtaken:
						staleAccepted++
					case err == nil:
						completed++
					case errors.Is(err, ErrLeaseLost):
						staleRefused++
					default:
						untyped = append(untyped, err)
					}
					mu.Unlock()
					break
				}
			}
		}()
	}
	wg.Wait()
	for _, err := range untyped {
		t.Errorf("failure: %v", err)
	}
	for n := 0; n < keys; n++ {
		key := "k" + strconv.Itoa(n)
		out, err := k.Begin(ctx, "chaos", key)
		if err != nil || !out.Replayed {
			t.Fatalf("%s at the end: %+v, %v; want its stored result", key, out, err)
		}
		var last int64
		for _, g := range grants[key] {
			last = max(last, g.token)
		}
		if string(out.Value) != strconv.FormatInt(out.Token, 10) || out.Token != last {
			t.Errorf("%s stores %q by token %d; the last holder's token is %d", key, out.Value, out.Token, last)
		}
	}
	t.Logf("lease chaos: %d pauses past the lease, %d completions accepted, %d stale completions refused, %d stale completions accepted",
		paused, completed, staleRefused, staleAccepted)
	if staleAccepted != 0 {
		t.Fatalf("%d stale completions accepted", staleAccepted)
	}
	if staleRefused == 0 {
		t.Fatal("no completion was ever stale: the chaos did not happen")
	}
}

// TestRestartWithAOF: with appendonly yes and appendfsync always, records
// survive a restart of Redis: completed ones replay without running the
// operation again, a pending one is still in progress, a released one is
// claimed again with a higher token.
func TestRestartWithAOF(t *testing.T) {
	srv := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	c := srv.Client(t)
	k := clusterKeeper(t, c, []Option{WithPrefix("aof:")}, WithLease(time.Minute), WithRetention(time.Hour))
	ctx := context.Background()
	var runs atomic.Int32
	fn := func(i int) func(context.Context) (int, error) {
		return func(context.Context) (int, error) { runs.Add(1); return i * i, nil }
	}
	const n = 50
	for i := 0; i < n; i++ {
		if _, err := Do(ctx, k, "aof", strconv.Itoa(i), fn(i)); err != nil {
			t.Fatal(err)
		}
	}
	pending, err := k.Begin(ctx, "aof", "pending")
	if err != nil || pending.Claim == nil {
		t.Fatalf("Begin = %+v, %v", pending, err)
	}
	released, err := k.Begin(ctx, "aof", "released")
	if err != nil || released.Claim == nil {
		t.Fatalf("Begin = %+v, %v", released, err)
	}
	if err := released.Claim.Release(ctx); err != nil {
		t.Fatal(err)
	}

	srv.Restart(t)

	for i := 0; i < n; i++ {
		v, err := Do(ctx, k, "aof", strconv.Itoa(i), fn(i))
		if err != nil || v != i*i {
			t.Fatalf("Do %d after the restart = %d, %v", i, v, err)
		}
	}
	if runs.Load() != n {
		t.Fatalf("operations ran %d times for %d keys: the restart lost results", runs.Load(), n)
	}
	if _, err := k.Begin(ctx, "aof", "pending"); !errors.Is(err, ErrInProgress) {
		t.Fatalf("pending record after the restart: %v, want ErrInProgress", err)
	}
	if err := pending.Claim.Complete(ctx, []byte("done"), 0); err != nil {
		t.Fatalf("the holder completes after the restart: %v", err)
	}
	again, err := k.Begin(ctx, "aof", "released")
	if err != nil || again.Claim == nil || again.Token <= released.Token || again.Claim.Attempt() != 2 {
		t.Fatalf("released record after the restart: %+v, %v", again, err)
	}
}
