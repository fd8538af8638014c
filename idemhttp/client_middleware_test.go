package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lossyNetwork is an http.RoundTripper that loses requests before they reach
// the server, and responses after the server handled them (read whole, then
// dropped), at random from a fixed seed.
type lossyNetwork struct {
	next                 http.RoundTripper
	loseRequest, dropped float64

	mu  sync.Mutex
	rnd *rand.Rand

	lostRequests, droppedResponses atomic.Int64
}

func newLossyNetwork(next http.RoundTripper, loseRequest, dropped float64) *lossyNetwork {
	return &lossyNetwork{next: next, loseRequest: loseRequest, dropped: dropped, rnd: rand.New(rand.NewPCG(13, 2))}
}

func (n *lossyNetwork) RoundTrip(r *http.Request) (*http.Response, error) {
	n.mu.Lock()
	fate := n.rnd.Float64()
	n.mu.Unlock()
	if fate < n.loseRequest {
		closeBody(r)
		n.lostRequests.Add(1)
		return nil, errors.New("lossy network: request lost")
	}
	resp, err := n.next.RoundTrip(r)
	if err != nil || fate >= n.loseRequest+n.dropped {
		return resp, err
	}
	_, _ = io.Copy(io.Discard, resp.Body) // the server has answered in full
	resp.Body.Close()
	n.droppedResponses.Add(1)
	return nil, errors.New("lossy network: response lost")
}

// payments is a server whose POST /payments charges once per key behind the
// middleware, and counts the charges of each key.
type payments struct {
	srv     *httptest.Server
	mu      sync.Mutex
	charges map[string]int
	total   atomic.Int64
}

// chargesOf returns how many times the payment with key was charged.
func (p *payments) chargesOf(key string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.charges[key]
}

func newPayments(t *testing.T, b *redistest.Backend, opts ...Option) *payments {
	t.Helper()
	k, err := idem.NewRedis(b.Client)
	require.NoError(t, err)
	guard, err := New(k, opts...)
	require.NoError(t, err)
	p := &payments{charges: map[string]int{}}
	p.srv = httptest.NewServer(guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get(DefaultKeyHeader)
		p.mu.Lock()
		p.charges[key]++
		p.mu.Unlock()
		n := p.total.Add(1)
		time.Sleep(20 * time.Millisecond) // the charge takes a while: copies overlap it
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":"ch_%d","request":%q}`, n, body)
	})))
	t.Cleanup(p.srv.Close)
	return p
}

// copyAnswer is what a client got for one copy of a request.
type copyAnswer struct {
	status      int
	contentType string
	body        string
	attempts    int
	replayed    bool
	err         error
}

// sendCopies sends n concurrent copies of one logical request, with key,
// through client, and returns their answers.
func sendCopies(client *http.Client, url, key, body string, n int) []copyAnswer {
	answers := make([]copyAnswer, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(ContextWithKey(context.Background(), key), time.Minute)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
			if err != nil {
				answers[i].err = err
				return
			}
			resp, err := client.Do(req)
			if err != nil {
				answers[i].err = err
				return
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			answers[i] = copyAnswer{status: resp.StatusCode, contentType: resp.Header.Get("Content-Type"), body: string(b),
				attempts: Attempts(resp), replayed: Replayed(resp), err: err}
		}()
	}
	wg.Wait()
	return answers
}

// checkOneAnswer asserts that every copy got the same 201.
func checkOneAnswer(t *testing.T, answers []copyAnswer) {
	t.Helper()
	for i, a := range answers {
		require.NoError(t, a.err, "copy %d", i)
		assert.Equal(t, http.StatusCreated, a.status, "copy %d: %s", i, a.body)
		assert.Equal(t, answers[0].body, a.body, "copy %d", i)
		assert.Equal(t, answers[0].contentType, a.contentType, "copy %d", i)
	}
}

// N concurrent copies of one request, through a network that loses requests
// and responses: one execution, N identical answers.
func TestTransportAgainstMiddleware(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		const n = 8
		p := newPayments(t, b)
		network := newLossyNetwork(p.srv.Client().Transport, 0.15, 0.3)
		client := &http.Client{Transport: &Transport{Base: network, MaxAttempts: 30, Backoff: 5 * time.Millisecond}}

		answers := sendCopies(client, p.srv.URL+"/payments", "order-42", `{"amount":100}`, n)
		checkOneAnswer(t, answers)
		assert.Equal(t, int64(1), p.total.Load(), "one execution")
		attempts, replayed := 0, 0
		for _, a := range answers {
			attempts += a.attempts
			if a.replayed {
				replayed++
			}
		}
		assert.GreaterOrEqual(t, replayed, n-1, "every copy but the one that ran gets a replay")
		t.Logf("%d copies: 1 execution, %d identical answers (%d replayed), %d attempts; network lost %d requests, dropped %d responses",
			n, len(answers), replayed, attempts, network.lostRequests.Load(), network.droppedResponses.Load())
	})
}

// Many payments, each sent as concurrent copies, through a TCP proxy that
// cuts requests and drops replies after the server wrote them: every payment
// is charged once, and all copies of a payment get the same answer. The log
// reports the figures.
func TestTransportThroughLossyProxy(t *testing.T) {
	for _, mode := range []struct {
		name string
		opts []Option
	}{
		{"409 and Retry-After", nil},
		{"WithWait", []Option{WithWait(5 * time.Second)}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
				const payments, copies = 16, 3
				p := newPayments(t, b, mode.opts...)
				proxy, err := faultproxy.New(strings.TrimPrefix(p.srv.URL, "http://"), 13)
				require.NoError(t, err)
				t.Cleanup(func() { proxy.Close() })
				proxy.Set(faultproxy.Faults{Cut: 0.05, DropReply: 0.2})
				base := &http.Transport{}
				t.Cleanup(base.CloseIdleConnections)
				client := &http.Client{Transport: &Transport{Base: base, MaxAttempts: 30, Backoff: 5 * time.Millisecond}}

				all := make([][]copyAnswer, payments)
				var wg sync.WaitGroup
				for i := range payments {
					wg.Add(1)
					go func() {
						defer wg.Done()
						all[i] = sendCopies(client, "http://"+proxy.Addr()+"/payments", fmt.Sprintf("pay-%d", i), fmt.Sprintf(`{"n":%d}`, i), copies)
					}()
				}
				wg.Wait()

				attempts, maxAttempts, replayed := 0, 0, 0
				for i, answers := range all {
					checkOneAnswer(t, answers)
					assert.Equal(t, 1, p.chargesOf(fmt.Sprintf("pay-%d", i)), "payment %d is charged once", i)
					for _, a := range answers {
						attempts += a.attempts
						maxAttempts = max(maxAttempts, a.attempts)
						if a.replayed {
							replayed++
						}
					}
				}
				assert.Equal(t, int64(payments), p.total.Load())
				st := proxy.Stats()
				t.Logf("%d payments x %d copies: %d executions, %d answers all 201 and equal per payment (%d replayed); attempts %d (max %d for one copy); proxy: %d connections, %d requests cut, %d replies dropped",
					payments, copies, p.total.Load(), payments*copies, replayed, attempts, maxAttempts, st.Conns, st.Cuts, st.DroppedReplies)
			})
		})
	}
}
