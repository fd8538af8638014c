package idemhttp

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"

	"github.com/idemkit/idem"

	"github.com/vmihailenco/msgpack/v5"
)

// bodyFate says whether the body of a stored response was kept.
type bodyFate uint8

const (
	bodyKept     bodyFate = iota // Body holds the whole body
	bodyTooLarge                 // the body was larger than the response limit
	bodyStreamed                 // the handler flushed the response while writing it
)

// storedResponse is the HTTP response the middleware keeps with
// Claim.Complete and replays.
//
// It is encoded as a msgpack array, by hand so that replays decode without
// reflection: [version, status, headers, body, fate, size], where headers is a
// map from name to an array of values (every value, in order), body is nil
// unless fate is bodyKept, and size is how many body bytes the handler wrote.
// A reader skips elements after size, so fields may be added without a new
// version.
type storedResponse struct {
	Status int
	Header http.Header
	Body   []byte
	Fate   bodyFate
	Size   int64
}

// responseFormat is the version element of an encoded storedResponse.
const responseFormat = 1

var (
	_ msgpack.CustomEncoder = (*storedResponse)(nil)
	_ msgpack.CustomDecoder = (*storedResponse)(nil)
)

// EncodeMsgpack implements msgpack.CustomEncoder.
func (s *storedResponse) EncodeMsgpack(e *msgpack.Encoder) error {
	if err := e.EncodeArrayLen(6); err != nil {
		return err
	}
	if err := e.EncodeUint(responseFormat); err != nil {
		return err
	}
	if err := e.EncodeInt(int64(s.Status)); err != nil {
		return err
	}
	names := make([]string, 0, len(s.Header))
	for name := range s.Header {
		names = append(names, name)
	}
	slices.Sort(names) // the same response always encodes to the same bytes
	if err := e.EncodeMapLen(len(names)); err != nil {
		return err
	}
	for _, name := range names {
		if err := e.EncodeString(name); err != nil {
			return err
		}
		vs := s.Header[name]
		if err := e.EncodeArrayLen(len(vs)); err != nil {
			return err
		}
		for _, v := range vs {
			if err := e.EncodeString(v); err != nil {
				return err
			}
		}
	}
	if err := e.EncodeBytes(s.Body); err != nil {
		return err
	}
	if err := e.EncodeUint(uint64(s.Fate)); err != nil {
		return err
	}
	return e.EncodeInt(s.Size)
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (s *storedResponse) DecodeMsgpack(d *msgpack.Decoder) error {
	n, err := d.DecodeArrayLen()
	if err != nil {
		return err
	}
	if n < 6 {
		return fmt.Errorf("stored response has %d fields, want 6", n)
	}
	version, err := d.DecodeUint()
	if err != nil {
		return err
	}
	if version != responseFormat {
		return fmt.Errorf("stored response format %d unknown", version)
	}
	if s.Status, err = d.DecodeInt(); err != nil {
		return err
	}
	if s.Status < 100 || s.Status > 999 {
		return fmt.Errorf("stored status %d out of range", s.Status)
	}
	nh, err := d.DecodeMapLen()
	if err != nil {
		return err
	}
	s.Header = make(http.Header, min(max(nh, 0), 64))
	for range nh {
		name, err := d.DecodeString()
		if err != nil {
			return err
		}
		nv, err := d.DecodeArrayLen()
		if err != nil {
			return err
		}
		vs := make([]string, 0, min(max(nv, 0), 16))
		for range nv {
			v, err := d.DecodeString()
			if err != nil {
				return err
			}
			vs = append(vs, v)
		}
		s.Header[name] = vs
	}
	if s.Body, err = d.DecodeBytes(); err != nil {
		return err
	}
	fate, err := d.DecodeUint()
	if err != nil {
		return err
	}
	if fate > uint(bodyStreamed) {
		return fmt.Errorf("stored body fate %d unknown", fate)
	}
	s.Fate = bodyFate(fate)
	if s.Size, err = d.DecodeInt64(); err != nil {
		return err
	}
	for range n - 6 {
		if err := d.Skip(); err != nil {
			return err
		}
	}
	return nil
}

// marshal encodes s for Claim.Complete.
func (s *storedResponse) marshal() ([]byte, error) {
	var buf bytes.Buffer
	buf.Grow(64 + len(s.Body))
	e := msgpack.GetEncoder()
	defer msgpack.PutEncoder(e)
	e.Reset(&buf)
	if err := s.EncodeMsgpack(e); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// unmarshal decodes what marshal made. Errors wrap ErrCorrupt.
func (s *storedResponse) unmarshal(b []byte) error {
	r := bytes.NewReader(b)
	d := msgpack.GetDecoder()
	defer msgpack.PutDecoder(d)
	d.Reset(r)
	if err := s.DecodeMsgpack(d); err != nil {
		return fmt.Errorf("%w: decoding the stored response: %w", idem.ErrCorrupt, err)
	}
	return nil
}

// unkeptHeaders are never stored nor replayed: credentials and cookies
// belong to one exchange, hop-by-hop headers to one connection, Date is made
// fresh on replay, and Content-Length is set again from the replayed body.
var unkeptHeaders = map[string]bool{
	"Set-Cookie":          true,
	"Authorization":       true,
	"Www-Authenticate":    true,
	"Proxy-Authenticate":  true,
	"Proxy-Authorization": true,
	"Connection":          true,
	"Keep-Alive":          true,
	"Proxy-Connection":    true,
	"Te":                  true,
	"Trailer":             true,
	"Transfer-Encoding":   true,
	"Upgrade":             true,
	"Date":                true,
	"Content-Length":      true,
	ReplayedHeader:        true,
}

// keptHeader returns the headers of h that may be stored: a deep copy without
// unkeptHeaders, without headers the Connection header names as hop-by-hop,
// without trailers, and without the headers that were in outer, with the same
// values, before the handler ran: those were set by middleware outside this
// one, which sets them afresh on a replay (a request id, CORS headers).
func keptHeader(h, outer http.Header) http.Header {
	hop := map[string]bool{}
	for _, v := range h.Values("Connection") {
		for _, name := range strings.Split(v, ",") {
			if name = strings.TrimSpace(name); name != "" {
				hop[http.CanonicalHeaderKey(name)] = true
			}
		}
	}
	out := make(http.Header, len(h))
	for name, vs := range h {
		canon := http.CanonicalHeaderKey(name)
		if unkeptHeaders[canon] || hop[canon] || strings.HasPrefix(name, http.TrailerPrefix) || len(vs) == 0 {
			continue
		}
		if ov, ok := outer[name]; ok && slices.Equal(ov, vs) {
			continue
		}
		out[name] = slices.Clone(vs)
	}
	return out
}

// bodyAllowed reports whether a response with status may have a body.
func bodyAllowed(status int) bool {
	return !(status >= 100 && status < 200) && status != http.StatusNoContent && status != http.StatusNotModified
}

// capture is the http.ResponseWriter the middleware gives the handler. It
// writes through to the client as the handler writes, and keeps a copy of
// the status, the headers as they were when the status was written, and the
// body up to a limit. A flush sends what was written at once, so the body of
// a flushed response is not kept.
type capture struct {
	w     http.ResponseWriter
	limit int64
	outer http.Header // the headers set before the handler ran

	status int         // final status written; 0 before
	header http.Header // snapshot of the headers when status was written
	body   []byte      // the body so far, while fate is bodyKept
	size   int64       // body bytes written
	fate   bodyFate
}

var (
	_ http.ResponseWriter = (*capture)(nil)
	_ http.Flusher        = (*capture)(nil)
	_ io.ReaderFrom       = (*capture)(nil)
)

// Header implements http.ResponseWriter: it is the client's header map.
func (c *capture) Header() http.Header { return c.w.Header() }

// WriteHeader implements http.ResponseWriter. Informational statuses (1xx
// other than 101) pass through without being kept.
func (c *capture) WriteHeader(code int) {
	if c.status == 0 && (code >= 200 || code == http.StatusSwitchingProtocols) {
		c.status = code
		c.header = keptHeader(c.w.Header(), c.outer)
	}
	c.w.WriteHeader(code)
}

// Write implements http.ResponseWriter.
func (c *capture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	n, err := c.w.Write(p)
	c.keep(p[:n])
	return n, err
}

// WriteString lets io.WriteString write without a copy when the client's
// writer can.
func (c *capture) WriteString(s string) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	n, err := io.WriteString(c.w, s)
	c.keepString(s[:n])
	return n, err
}

// keep copies p into the kept body, while it fits.
func (c *capture) keep(p []byte) {
	if c.room(len(p)) {
		c.body = append(c.body, p...)
	}
}

// keepString copies s into the kept body, while it fits.
func (c *capture) keepString(s string) {
	if c.room(len(s)) {
		c.body = append(c.body, s...)
	}
}

// room counts n more bytes written and reports whether they are to be kept:
// no longer once the body is over the limit (or was flushed).
func (c *capture) room(n int) bool {
	c.size += int64(n)
	if c.fate != bodyKept {
		return false
	}
	if c.size > c.limit {
		c.fate, c.body = bodyTooLarge, nil
		return false
	}
	return true
}

// FlushError sends what was written to the client at once; it is what
// http.ResponseController.Flush calls. The body is not kept from then on.
func (c *capture) FlushError() error {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if c.fate == bodyKept {
		c.fate, c.body = bodyStreamed, nil
	}
	return http.NewResponseController(c.w).Flush()
}

// Flush implements http.Flusher; see FlushError.
func (c *capture) Flush() { _ = c.FlushError() }

// ReadFrom implements io.ReaderFrom, so that io.Copy into the response keeps
// the copy it needs; once the body is no longer kept, it hands src to the
// client's writer (which may use sendfile).
func (c *capture) ReadFrom(src io.Reader) (int64, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if rf, ok := c.w.(io.ReaderFrom); ok && c.fate != bodyKept {
		n, err := rf.ReadFrom(src)
		c.size += n
		return n, err
	}
	return io.Copy(writerOnly{c}, src)
}

// Unwrap returns the client's ResponseWriter, for http.ResponseController
// (deadlines, hijacking, full duplex).
func (c *capture) Unwrap() http.ResponseWriter { return c.w }

// writerOnly hides every method of a writer but Write, so that io.Copy does
// not call ReadFrom again.
type writerOnly struct{ io.Writer }

// response returns what the handler answered, as it is to be stored. A
// handler that wrote nothing answered 200 with no body, as net/http does.
func (c *capture) response() *storedResponse {
	s := &storedResponse{Status: c.status, Header: c.header, Body: c.body, Fate: c.fate, Size: c.size}
	if s.Status == 0 {
		s.Status = http.StatusOK
		s.Header = keptHeader(c.w.Header(), c.outer)
	}
	if s.Fate != bodyKept {
		s.Body = nil
	}
	return s
}
