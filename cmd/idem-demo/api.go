package main

import (
	"context"
	"encoding/json"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

// paymentRequest is the body of POST /payments.
type paymentRequest struct {
	Payment  string `json:"payment"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

// receipt is the answer of POST /payments.
type receipt struct {
	Charge   string `json:"charge"`
	Payment  string `json:"payment"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Token    int64  `json:"fencing_token"`
}

// charge is one execution of a payment, as the ledger saw it.
type charge struct {
	ID       string `json:"charge"`
	Payment  string `json:"payment"`
	Amount   int64  `json:"amount"`
	Response []byte `json:"-"` // the body answered to the request that charged
	Location string `json:"location"`
}

// ledger is the in-memory card network: it records every charge, by the
// payment the request named (whatever Idempotency-Key it carried, or none).
type ledger struct {
	mu      sync.Mutex
	charges map[string][]charge
	n       int
}

func newLedger() *ledger { return &ledger{charges: map[string][]charge{}} }

// charge books a charge of payment and returns its charge id.
func (l *ledger) charge(payment string, amount int64) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.n++
	id := "ch_" + strconv.Itoa(l.n)
	l.charges[payment] = append(l.charges[payment], charge{ID: id, Payment: payment, Amount: amount})
	return id
}

// answered records the answer to the charge id of payment.
func (l *ledger) answered(payment, id string, body []byte, location string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	cs := l.charges[payment]
	for i := range cs {
		if cs[i].ID == id {
			cs[i].Response, cs[i].Location = body, location
		}
	}
}

// snapshot returns the charges by payment.
func (l *ledger) snapshot() map[string][]charge {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string][]charge, len(l.charges))
	for k, cs := range l.charges {
		out[k] = append([]charge(nil), cs...)
	}
	return out
}

// newAPI is the payments API: POST /payments guarded by the middleware, GET
// /payments listing the ledger.
func newAPI(k *idem.Keeper, l *ledger, work time.Duration) (http.Handler, error) {
	guard, err := idemhttp.New(k)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", guard(pay(l, work)))
	mux.HandleFunc("GET /payments", func(w http.ResponseWriter, r *http.Request) {
		var all []charge
		for _, cs := range l.snapshot() {
			all = append(all, cs...)
		}
		sort.Slice(all, func(i, j int) bool { return all[i].Payment < all[j].Payment })
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(all)
	})
	return mux, nil
}

// unguardedAPI is the API without the middleware: what the storm does to it
// is what idem prevents.
func unguardedAPI(l *ledger, work time.Duration) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("POST /payments", pay(l, work))
	return mux
}

// pay charges the payment the body names: a request that names one twice
// is charged twice, with or without a key, unless the middleware stops it.
// It spends work/2 talking to the card network
// before charging (a client that goes away meanwhile aborts it: nothing is
// charged and the middleware releases the key), then work/2 writing the
// receipt, which it finishes even if the client went away: the charge
// happened, so the middleware stores the answer.
func pay(l *ledger, work time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req paymentRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Amount <= 0 || req.Payment == "" {
			http.Error(w, `{"error":"want {\"payment\":\"...\",\"amount\":N,\"currency\":\"...\"}"}`, http.StatusBadRequest)
			return
		}
		claim, _ := idem.ClaimFromContext(r.Context())
		t := time.NewTimer(work / 2)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return
		}
		rc := receipt{Charge: l.charge(req.Payment, req.Amount), Payment: req.Payment, Amount: req.Amount, Currency: req.Currency}
		if claim != nil {
			rc.Token = claim.Token()
		}
		time.Sleep(work / 2)
		body, _ := json.Marshal(rc)
		body = append(body, '\n')
		location := "/payments/" + rc.Charge
		l.answered(req.Payment, rc.Charge, body, location)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", location)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(body)
	})
}

// eventCounts is an Observer that counts the middleware's requests by
// outcome (the idem.StepRequest events).
type eventCounts struct {
	n [32]atomic.Int64
}

// Observe implements idem.Observer.
func (c *eventCounts) Observe(_ context.Context, ev idem.Event) {
	if ev.Step == idem.StepRequest && int(ev.Result) < len(c.n) {
		c.n[ev.Result].Add(1)
	}
}

func (c *eventCounts) get(r idem.Result) int64 { return c.n[r].Load() }
