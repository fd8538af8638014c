package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

// requestBody is the body of every request: small, as a payment's would be.
const requestBody = `{"amount":1000,"currency":"eur"}`

// opPath is the path of the operation on every HTTP peer's server.
const opPath = "/op"

// httpCaller is the client side of every HTTP peer: net/http with
// keep-alive, one POST to url with the key in header per call.
type httpCaller struct {
	url       string
	header    string
	transport *http.Transport
	client    *http.Client
}

// newHTTPCaller returns a caller of the server at addr, keeping up to pool
// connections alive.
func newHTTPCaller(addr, header string, pool int) *httpCaller {
	t := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        pool,
		MaxIdleConnsPerHost: pool,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	return &httpCaller{
		url:       "http://" + addr + opPath,
		header:    header,
		transport: t,
		client:    &http.Client{Transport: t},
	}
}

// call posts one request with key and returns the body of its 200; any
// other status is an error that quotes the body.
func (c *httpCaller) call(ctx context.Context, key string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, strings.NewReader(requestBody))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(c.header, key)
	resp, err := c.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(body[:min(len(body), 300)]))
	}
	return body, nil
}

func (c *httpCaller) close() { c.transport.CloseIdleConnections() }
