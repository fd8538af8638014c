package idemgrpc_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// link cuts connections: each of the first ones gets a random budget of
// bytes, both directions counted, and is closed once it is spent, in the
// middle of whatever it carries: a request before the server read it, or a
// response after the handler ran. Then the link heals, so a test always
// ends.
type link struct {
	mu       sync.Mutex
	rng      *rand.Rand
	min, max int
	flaky    int // connections still to cut
	cuts     atomic.Int64
}

func newLink(seed uint64, min, max, flaky int) *link {
	return &link{rng: rand.New(rand.NewPCG(seed, seed)), min: min, max: max, flaky: flaky}
}

func (l *link) wrap(c net.Conn) net.Conn {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.flaky == 0 {
		return c
	}
	l.flaky--
	return &flakyConn{Conn: c, link: l, left: l.min + l.rng.IntN(l.max-l.min)}
}

// flakyConn is one connection over a link.
type flakyConn struct {
	net.Conn
	link *link
	once sync.Once
	mu   sync.Mutex
	left int // bytes it may still carry
}

// take spends up to n bytes of the budget and returns how many it may
// carry.
func (c *flakyConn) take(n int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := min(n, c.left)
	c.left -= k
	return k
}

func (c *flakyConn) cut() {
	c.once.Do(func() {
		c.link.cuts.Add(1)
		c.Conn.Close()
	})
}

func (c *flakyConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	keep := c.take(n)
	if keep == n {
		return n, err
	}
	c.cut()
	if keep == 0 {
		return 0, net.ErrClosed
	}
	return keep, nil
}

func (c *flakyConn) Write(p []byte) (int, error) {
	keep := c.take(len(p))
	if keep == len(p) {
		return c.Conn.Write(p)
	}
	n, _ := c.Conn.Write(p[:keep])
	c.cut()
	return n, net.ErrClosed
}

// Concurrent copies of each call, through the client interceptor, over a
// link that cuts connections mid-request and mid-response: each operation
// runs once, and every copy gets the same answer.
func TestPairOverAFlakyLink(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		const operations, copies = 24, 4
		var (
			mu    sync.Mutex
			execs = map[string]int{}
			total int
		)
		h := func(ctx context.Context, _ string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			time.Sleep(time.Millisecond) // some work, during which the link may cut
			if ctx.Err() != nil {
				return nil, status.FromContextError(ctx.Err()).Err() // gave up before acting
			}
			mu.Lock()
			defer mu.Unlock()
			execs[req.GetValue()]++
			total++
			return wrapperspb.String(fmt.Sprintf("%s: execution %d", req.GetValue(), total)), nil
		}
		lis := serve(t, newKeeper(t, b.Client), h, idemgrpc.WithRetryHint(5*time.Millisecond))
		// 96 calls carry more than 3000 bytes: the first connection is cut,
		// and so are most of the next eleven.
		cutter := newLink(7, 300, 3000, 12)
		var codesSeen sync.Map // codes.Code -> *atomic.Int64, of every attempt
		perAttempt := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoke grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			err := invoke(ctx, method, req, reply, cc, opts...)
			n, _ := codesSeen.LoadOrStore(status.Code(err), new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			return err
		}
		conn := dial(t, lis, cutter.wrap, []idemgrpc.Option{
			idemgrpc.WithMaxAttempts(200), idemgrpc.WithBackoff(time.Millisecond, 20*time.Millisecond),
		}, grpc.WithChainUnaryInterceptor(perAttempt))

		answers := make([][copies]answer, operations)
		infos := make([][copies]idemgrpc.CallInfo, operations)
		var wg sync.WaitGroup
		for op := range operations {
			for c := range copies {
				wg.Go(func() {
					ctx := idemgrpc.ContextWithKey(t.Context(), fmt.Sprintf("op-%d", op))
					answers[op][c] = call(ctx, conn, chargeMethod, fmt.Sprintf("payment %d", op), idemgrpc.Info(&infos[op][c]))
				})
			}
		}
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()

		attempts, most, replays := 0, 0, 0
		for op := range operations {
			assert.Equal(t, 1, execs[fmt.Sprintf("payment %d", op)], "operation %d runs once", op)
			for c := range copies {
				a := answers[op][c]
				if !assert.NoError(t, a.err, "operation %d, copy %d", op, c) {
					continue
				}
				assert.True(t, proto.Equal(answers[op][0].resp, a.resp), "operation %d: %v != %v", op, answers[op][0].resp, a.resp)
				attempts += infos[op][c].Attempts
				most = max(most, infos[op][c].Attempts)
				if infos[op][c].Replayed {
					replays++
				}
			}
		}
		require.Positive(t, cutter.cuts.Load(), "the link cut connections")
		assert.Equal(t, operations, total, "executions")
		var byCode []string
		codesSeen.Range(func(c, n any) bool {
			byCode = append(byCode, fmt.Sprintf("%s %d", c, n.(*atomic.Int64).Load()))
			return true
		})
		slices.Sort(byCode)
		t.Logf("%s: %d operations × %d copies: %d executions, %d answers (%d replayed), %d attempts (at most %d for one call; %s), %d connections cut",
			b.Name, operations, copies, total, operations*copies, replays, attempts, most, strings.Join(byCode, ", "), cutter.cuts.Load())
	})
}
