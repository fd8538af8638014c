package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/idemkit/idem/idemhttp"
)

// stormConfig sizes a retry storm.
type stormConfig struct {
	Payments   int           // distinct payments, one key each
	Copies     int           // copies of each payment sent at once, same key
	Resends    int           // copies sent again, one after another, once one was answered
	Clients    int           // clients, each sending one payment (its copies at once) at a time
	Work       time.Duration // the API's time per charge; cut-offs fall within it
	CutRate    float64       // share of sends cut off by a client timeout
	ChangeRate float64       // share of payments sent once more with another amount
	NoKeyRate  float64       // share of payments sent once more without a key
	Seed       uint64        // seed of every random choice
}

// defaultStorm finishes in a few seconds on a laptop, on miniredis.
func defaultStorm() stormConfig {
	return stormConfig{
		Payments: 400, Copies: 3, Resends: 1, Clients: 16, Work: 20 * time.Millisecond,
		CutRate: 0.1, ChangeRate: 0.1, NoKeyRate: 0.05, Seed: 1,
	}
}

func (c stormConfig) validate() error {
	switch {
	case c.Payments < 1 || c.Copies < 1 || c.Clients < 1 || c.Resends < 0:
		return errors.New("-payments, -copies and -clients must be at least 1, -resends at least 0")
	case c.Work < 2*time.Millisecond:
		return errors.New("-work must be at least 2ms")
	case !(c.CutRate >= 0 && c.CutRate < 1) || !(c.ChangeRate >= 0 && c.ChangeRate <= 1) || !(c.NoKeyRate >= 0 && c.NoKeyRate <= 1):
		return errors.New("-cut must be in [0, 1), -change and -nokey in [0, 1]")
	}
	return nil
}

// answer is a 201 a client received.
type answer struct {
	Body     []byte
	Location string
	Replayed bool
}

// stormReport is what the clients of a storm saw.
type stormReport struct {
	Payments    int
	Sent        int // requests sent
	Fresh       int // 201 answered by the handler
	Replays     int // 201 replayed by the middleware
	Conflicts   int // 409, retried
	Mismatches  int // 422 to a changed amount
	MissingKey  int // 400 to a request without a key
	Unavailable int // 503, retried
	Timeouts    int // cut off by the client's timeout, retried
	Errors      int // other transport errors, retried
	// Unexpected lists answers that should not happen, such as a 201 to a
	// changed amount.
	Unexpected []string
	// Unanswered counts payments that got no 201 in maxSends tries.
	Unanswered int
	Latencies  []time.Duration     // of every request answered
	Answers    map[string][]answer // the 201s to a request with a key, by payment
}

// maxSends bounds the tries of one copy of a payment.
const maxSends = 200

// stormer runs one storm.
type stormer struct {
	base string
	cfg  stormConfig
	hc   *http.Client

	mu  sync.Mutex
	rep stormReport
}

// storm sends cfg.Payments payments to base+"/payments" from cfg.Clients
// clients. A client sends each payment as Copies concurrent requests with one
// key, some cut off by client timeouts, every one retried until it gets a
// 201; then Resends more copies; then, for some payments, one copy with
// another amount (422 expected) and one without a key (400 expected).
func storm(ctx context.Context, base string, cfg stormConfig) (*stormReport, error) {
	tr := &http.Transport{MaxIdleConnsPerHost: cfg.Clients * cfg.Copies, DisableCompression: true}
	defer tr.CloseIdleConnections()
	s := &stormer{
		base: base, cfg: cfg,
		hc:  &http.Client{Transport: tr},
		rep: stormReport{Payments: cfg.Payments, Answers: map[string][]answer{}},
	}
	todo := make(chan int)
	var wg sync.WaitGroup
	for range cfg.Clients {
		wg.Go(func() {
			for i := range todo {
				s.payment(ctx, i)
			}
		})
	}
	for i := range cfg.Payments {
		todo <- i
	}
	close(todo)
	wg.Wait()
	if ctx.Err() != nil {
		return &s.rep, errDeadline
	}
	return &s.rep, nil
}

func (s *stormer) payment(ctx context.Context, i int) {
	rng := rand.New(rand.NewPCG(s.cfg.Seed, uint64(i)))
	key := fmt.Sprintf("order-%05d", i)
	req := paymentRequest{Payment: key, Amount: 100 + rng.Int64N(100_000), Currency: "EUR"}
	body, _ := json.Marshal(req)

	var wg sync.WaitGroup
	for c := range s.cfg.Copies {
		crng := rand.New(rand.NewPCG(s.cfg.Seed, uint64(i)<<16|uint64(c+1)))
		wg.Go(func() { s.deliver(ctx, key, body, crng) })
	}
	wg.Wait()
	for range s.cfg.Resends {
		s.deliver(ctx, key, body, rng)
	}
	if rng.Float64() < s.cfg.ChangeRate {
		changed := req
		changed.Amount++
		b, _ := json.Marshal(changed)
		if st, _ := s.send(ctx, key, key, b, 0); st != 0 && st != http.StatusUnprocessableEntity {
			s.unexpected("%s: %d to a changed amount, want 422", key, st)
		}
	}
	if rng.Float64() < s.cfg.NoKeyRate {
		if st, _ := s.send(ctx, key, "", body, 0); st != 0 && st != http.StatusBadRequest {
			s.unexpected("%s: %d to a request without a key, want 400", key, st)
		}
	}
}

// deliver sends one copy of a payment until it gets a 201.
func (s *stormer) deliver(ctx context.Context, key string, body []byte, rng *rand.Rand) {
	for range maxSends {
		var cut time.Duration
		if rng.Float64() < s.cfg.CutRate {
			cut = time.Millisecond + time.Duration(rng.Int64N(int64(s.cfg.Work)))
		}
		status, err := s.send(ctx, key, key, body, cut)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil, status == http.StatusConflict, status == http.StatusServiceUnavailable:
			sleep(ctx, time.Duration(2+rng.IntN(10))*time.Millisecond)
		case status == http.StatusCreated:
			return
		default:
			s.unexpected("%s: %d to a copy of the payment", key, status)
			return
		}
	}
	s.mu.Lock()
	s.rep.Unanswered++
	s.mu.Unlock()
}

// send sends one request for payment with key (none if ""), cut off after
// cut if it is not zero, and records the answer under payment. It returns
// the status, or 0 and the error.
func (s *stormer) send(ctx context.Context, payment, key string, body []byte, cut time.Duration) (int, error) {
	rctx := ctx
	if cut > 0 {
		var cancel context.CancelFunc
		rctx, cancel = context.WithTimeout(ctx, cut)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, s.base+"/payments", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set(idemhttp.DefaultKeyHeader, key)
	}
	started := time.Now()
	resp, err := s.hc.Do(req)
	var b []byte
	if err == nil {
		b, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	took := time.Since(started)

	s.mu.Lock()
	defer s.mu.Unlock()
	r := &s.rep
	if ctx.Err() != nil {
		return 0, ctx.Err()
	}
	r.Sent++
	if err != nil {
		if rctx.Err() != nil {
			r.Timeouts++
		} else {
			r.Errors++
		}
		return 0, err
	}
	r.Latencies = append(r.Latencies, took)
	switch resp.StatusCode {
	case http.StatusCreated:
		a := answer{Body: b, Location: resp.Header.Get("Location"), Replayed: resp.Header.Get(idemhttp.ReplayedHeader) == "true"}
		if a.Replayed {
			r.Replays++
		} else {
			r.Fresh++
		}
		if key != "" { // one without is no copy of the first request: the ledger shows its charge
			r.Answers[payment] = append(r.Answers[payment], a)
		}
	case http.StatusConflict:
		r.Conflicts++
	case http.StatusUnprocessableEntity:
		r.Mismatches++
	case http.StatusBadRequest:
		r.MissingKey++
	case http.StatusServiceUnavailable:
		r.Unavailable++
	}
	return resp.StatusCode, nil
}

func (s *stormer) unexpected(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rep.Unexpected = append(s.rep.Unexpected, fmt.Sprintf(format, args...))
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// verdict is the ledger checked against what the clients saw.
type verdict struct {
	Charges int      // charges executed
	Charged int      // distinct payments charged
	Double  []string // payments charged more than once
	Differ  []string // payments with a 201 unlike the answer to the request that charged
	Answers int      // 201s checked
}

// ok reports whether every payment was charged exactly once, and every
// answer was the first one.
func (v verdict) ok(rep *stormReport) bool {
	return len(v.Double) == 0 && len(v.Differ) == 0 && rep.Unanswered == 0 &&
		len(rep.Unexpected) == 0 && v.Charged == rep.Payments
}

// check compares the ledger with the answers of a storm.
func check(rep *stormReport, l *ledger) verdict {
	var v verdict
	charges := l.snapshot()
	for key, cs := range charges {
		v.Charges += len(cs)
		v.Charged++
		if len(cs) > 1 {
			v.Double = append(v.Double, fmt.Sprintf("%s charged %d times", key, len(cs)))
		}
	}
	for key, as := range rep.Answers {
		cs := charges[key]
		v.Answers += len(as)
		for _, a := range as {
			if len(cs) == 0 {
				v.Differ = append(v.Differ, key+": a 201 without a charge")
				break
			}
			if !bytes.Equal(a.Body, cs[0].Response) || a.Location != cs[0].Location {
				v.Differ = append(v.Differ, fmt.Sprintf("%s: answered %q (Location %q), first response %q (Location %q)",
					key, a.Body, a.Location, cs[0].Response, cs[0].Location))
				break
			}
		}
	}
	slices.Sort(v.Double)
	slices.Sort(v.Differ)
	return v
}

// percentile returns the p-th percentile (0 < p <= 100) of ds, sorted.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p/100+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func round(d time.Duration) string {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond).String()
	case d >= time.Millisecond:
		return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 1, 64) + "ms"
	}
	return d.Round(time.Microsecond).String()
}
