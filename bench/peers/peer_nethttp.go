package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"
)

// netHTTPPeer is an HTTP server on net/http in the process, on a loopback
// port, serving the operation behind an optional middleware, and its caller.
type netHTTPPeer struct {
	*httpCaller
	srv *http.Server
}

// barePeerHeader is the key header of the bare peer: it only tells the
// handler which key the operation is for.
const barePeerHeader = "Idempotency-Key"

// openNetHTTP opens the operation on bare net/http: no idempotency.
func openNetHTTP(_ context.Context, e *env) (peer, error) {
	return startNetHTTP(e, barePeerHeader, nil)
}

// startNetHTTP serves the operation, wrapped in guard unless it is nil,
// reading the key from header.
func startNetHTTP(e *env, header string, guard func(http.Handler) http.Handler) (*netHTTPPeer, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("listening on loopback: %w", err)
	}
	var h http.Handler = &opHandler{op: e.op, header: header}
	if guard != nil {
		h = guard(h)
	}
	mux := http.NewServeMux()
	mux.Handle("POST "+opPath, h)
	p := &netHTTPPeer{
		httpCaller: newHTTPCaller(ln.Addr().String(), header, e.pool),
		srv:        &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second},
	}
	go func() { _ = p.srv.Serve(ln) }()
	return p, nil
}

func (p *netHTTPPeer) close() {
	p.httpCaller.close()
	_ = p.srv.Close()
}

// opHandler is the operation on net/http: it reads the request, runs the
// operation for the key in header, and answers 200 with the result.
type opHandler struct {
	op     *operation
	header string
}

var resultLength = strconv.Itoa(resultSize)

func (h *opHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	res := h.op.run(r.Header.Get(h.header))
	hd := w.Header()
	hd.Set("Content-Type", "application/json")
	hd.Set("Content-Length", resultLength)
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(res)
}
