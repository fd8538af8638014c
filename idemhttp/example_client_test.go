package idemhttp_test

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/idemkit/idem/idemhttp"
)

// A client that retries a payment safely: the network loses the first
// response after the server charged the card; the Transport sends the
// request again with the same Idempotency-Key and gets the first response
// back, replayed. The card is charged once.
func ExampleTransport() {
	keeper, done := newKeeper()
	defer done()
	guard, err := idemhttp.New(keeper)
	if err != nil {
		panic(err)
	}
	var charges atomic.Int32
	srv := httptest.NewServer(guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := charges.Add(1) // charge the card
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":"ch_%d"}`, n)
	})))
	defer srv.Close()

	client := &http.Client{Transport: &idemhttp.Transport{Base: loseFirstResponse(http.DefaultTransport)}}
	resp, err := client.Post(srv.URL+"/payments", "application/json", strings.NewReader(`{"amount":1000}`))
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.StatusCode, string(body))
	fmt.Println("attempts:", idemhttp.Attempts(resp), "replayed:", idemhttp.Replayed(resp))
	fmt.Println("charges:", charges.Load())
	// Output:
	// 201 {"charge":"ch_1"}
	// attempts: 2 replayed: true
	// charges: 1
}

// loseFirstResponse is a network that loses the first response after the
// server sent it.
func loseFirstResponse(next http.RoundTripper) roundTripFunc {
	var lost atomic.Bool
	return func(r *http.Request) (*http.Response, error) {
		resp, err := next.RoundTrip(r)
		if err == nil && lost.CompareAndSwap(false, true) {
			resp.Body.Close()
			return nil, errors.New("connection reset by peer")
		}
		return resp, err
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
