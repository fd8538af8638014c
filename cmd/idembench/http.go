package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/redis/go-redis/v9"
)

// The middleware's names this file uses, in one place.
const (
	keyHeader      = idemhttp.DefaultKeyHeader
	replayedHeader = idemhttp.ReplayedHeader
)

// newGuard returns idemhttp's middleware on k, keeping its records under
// the run's scope.
func newGuard(k *idem.Keeper, scope string) (func(http.Handler) http.Handler, error) {
	return idemhttp.New(k, idemhttp.WithScope(func(*http.Request) (string, error) { return scope, nil }))
}

// The paths of the server of -mode http.
const (
	guardedPath = "/idem"
	barePath    = "/bare"
	bareGetPath = "/bare-get"
	// getHeader names the Redis key the bare-get handler reads.
	getHeader = "X-Idembench-Get"
)

// requestBody is the body of every request: small, as a payment's would be.
const requestBody = `{"amount":1000,"currency":"eur"}`

// httpBench is -mode http: a server in the process on a loopback port,
// serving the handler behind idemhttp's middleware and bare, and the one client
// (one keep-alive transport) that both sides of the run use.
type httpBench struct {
	srv                             *http.Server
	transport                       *http.Transport
	client                          *http.Client
	guardedURL, bareURL, bareGetURL string
	// bodyLen is the length of the handler's body, which every 200 must
	// carry, replays included.
	bodyLen int
}

// startHTTP starts the server of -mode http. The handler marks the keys it
// runs for in ran behind the middleware, in bareRan without it, and answers
// 200 with a JSON body of -body bytes; the bare-get handler answers the value
// it GETs from c.
func startHTTP(o *options, k *idem.Keeper, c redis.Cmdable, scope string, ran, bareRan *bitset) (*httpBench, error) {
	guard, err := newGuard(k, scope)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("-mode http: %w", err)
	}
	body := jsonBody(o.body)
	mux := http.NewServeMux()
	mux.Handle("POST "+guardedPath, guard(newHandler(ran, body)))
	mux.Handle("POST "+barePath, newHandler(bareRan, body))
	mux.Handle("POST "+bareGetPath, getHandler{c})
	h := &httpBench{
		srv:     &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second},
		bodyLen: len(body),
	}
	go func() { _ = h.srv.Serve(ln) }()
	h.transport = &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        2 * o.concurrency,
		MaxIdleConnsPerHost: 2 * o.concurrency,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	h.client = &http.Client{Transport: h.transport}
	base := "http://" + ln.Addr().String()
	h.guardedURL, h.bareURL, h.bareGetURL = base+guardedPath, base+barePath, base+bareGetPath
	return h, nil
}

func (h *httpBench) close() {
	h.srv.Close()
	h.transport.CloseIdleConnections()
}

// post sends one request with key, reads the whole response, and returns its
// status and whether the middleware replayed it. A 200 whose body is not the
// handler's length is an error; so is a status other than 200 and 409, whose
// body the error quotes.
func (h *httpBench) post(ctx context.Context, url, key string) (status int, replayed bool, err error) {
	return h.postGet(ctx, url, key, "")
}

// postGet is post, asking the bare-get handler to GET get when it is not
// empty.
func (h *httpBench) postGet(ctx context.Context, url, key, get string) (status int, replayed bool, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(requestBody))
	if err != nil {
		return 0, false, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(keyHeader, key)
	if get != "" {
		req.Header.Set(getHeader, get)
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return 0, false, err
	}
	defer resp.Body.Close()
	status, replayed = resp.StatusCode, resp.Header.Get(replayedHeader) == "true"
	switch status {
	case http.StatusOK:
		n, err := io.Copy(io.Discard, resp.Body)
		if err == nil && n != int64(h.bodyLen) {
			err = fmt.Errorf("HTTP 200 with a %d-byte body, want %d", n, h.bodyLen)
		}
		return status, replayed, err
	case http.StatusConflict:
		_, err := io.Copy(io.Discard, resp.Body)
		return status, replayed, err
	default:
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
		_, _ = io.Copy(io.Discard, resp.Body)
		return status, replayed, fmt.Errorf("HTTP %d: %s", status, bytes.TrimSpace(b))
	}
}

// httpOp runs one operation as a request through the middleware.
func (w *workload) httpOp(ctx context.Context, wk *worker) {
	wk.id = wk.nextID()
	start := time.Now()
	status, replayed, err := w.http.post(ctx, w.http.guardedURL, wk.key(wk.id))
	lat := time.Since(start)
	switch {
	case err != nil:
		wk.stats.fail(err)
		return
	case status == http.StatusConflict:
		wk.stats.inProgress++
	case replayed:
		wk.stats.replayed++
	default:
		wk.stats.executed++
	}
	wk.stats.record(lat)
}

// httpSeed completes key id through the middleware, for a replay run.
func (w *workload) httpSeed(ctx context.Context, wk *worker, id uint64) error {
	status, replayed, err := w.http.post(ctx, w.http.guardedURL, wk.key(id))
	switch {
	case err != nil:
		return err
	case status != http.StatusOK || replayed:
		return fmt.Errorf("key %d: HTTP %d (replayed: %v), want a first 200", id, status, replayed)
	}
	return nil
}

// handler is the endpoint of -mode http: it reads the request, marks its
// key as run, and answers 200 with a JSON body.
type handler struct {
	ran    *bitset
	body   []byte
	length string
}

func newHandler(ran *bitset, body []byte) *handler {
	return &handler{ran: ran, body: body, length: strconv.Itoa(len(body))}
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if id, err := keyID(r.Header.Get(keyHeader)); err == nil {
		h.ran.mark(id)
	}
	hd := w.Header()
	hd.Set("Content-Type", "application/json")
	hd.Set("Content-Length", h.length)
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(h.body)
}

// getHandler is the bare-get baseline's endpoint: it reads the request,
// GETs the Redis key the request names, and answers the value: the least a
// handler that keeps its results in Redis does for a replay.
type getHandler struct{ c redis.Cmdable }

func (h getHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	v, err := h.c.Get(r.Context(), r.Header.Get(getHeader)).Bytes()
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	hd := w.Header()
	hd.Set("Content-Type", "application/json")
	hd.Set("Content-Length", strconv.Itoa(len(v)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(v)
}

// keyID returns the id of a key "k<id>".
func keyID(key string) (uint64, error) {
	digits, ok := strings.CutPrefix(key, "k")
	if !ok {
		return 0, errors.New("not a key of the tool")
	}
	return strconv.ParseUint(digits, 10, 64)
}

// jsonBody returns a JSON object of n bytes ({"data":"abc..."}), or for n
// below 11 "{}" padded with spaces (as much of it as fits).
func jsonBody(n int) []byte {
	const open, end = `{"data":"`, `"}`
	if n < len(open)+len(end) {
		return []byte(("{}" + strings.Repeat(" ", n))[:n])
	}
	b := make([]byte, 0, n)
	b = append(b, open...)
	for i := 0; len(b) < n-len(end); i++ {
		b = append(b, 'a'+byte(i%26))
	}
	return append(b, end...)
}
