package idemhttp

import (
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
)

// bodyFate says whether the body of a stored response was kept.
type bodyFate uint8

const (
	bodyKept     bodyFate = iota // the whole body is kept
	bodyTooLarge                 // the body was larger than the response limit
	bodyStreamed                 // the handler flushed the response while writing it
)

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

// keptNames appends to dst the names of h's headers that are stored, in
// the order of their bytes: every header but unkeptHeaders, those the
// Connection header names as hop-by-hop, trailers, headers without a value,
// and those that were in outer, with the same values, before the handler
// ran: those were set by middleware outside this one, which sets them
// afresh on a replay (a request id, CORS headers).
func keptNames(dst []string, h, outer http.Header) []string {
	hop := hopHeaders(h)
	for name, vs := range h {
		canon := http.CanonicalHeaderKey(name)
		if unkeptHeaders[canon] || hop[canon] || strings.HasPrefix(name, http.TrailerPrefix) || len(vs) == 0 {
			continue
		}
		if ov, ok := outer[name]; ok && slices.Equal(ov, vs) {
			continue
		}
		dst = append(dst, name)
	}
	slices.Sort(dst)
	return dst
}

// hopHeaders returns the canonical names that h's Connection header lists
// as hop-by-hop; nil when it has none.
func hopHeaders(h http.Header) map[string]bool {
	conn := h.Values("Connection")
	if len(conn) == 0 {
		return nil
	}
	hop := map[string]bool{}
	for _, v := range conn {
		for _, name := range strings.Split(v, ",") {
			if name = strings.TrimSpace(name); name != "" {
				hop[http.CanonicalHeaderKey(name)] = true
			}
		}
	}
	return hop
}

// cloneHeader returns a deep copy of h, or nil when h is empty.
func cloneHeader(h http.Header) http.Header {
	if len(h) == 0 {
		return nil
	}
	return h.Clone()
}

// bodyAllowed reports whether a response with status may have a body.
func bodyAllowed(status int) bool {
	return !(status >= 100 && status < 200) && status != http.StatusNoContent && status != http.StatusNotModified
}

// capture is the http.ResponseWriter the middleware gives the handler. It
// writes through to the client as the handler writes, and keeps a copy of
// the status, the headers as they were when the status was written, and the
// body up to a limit, already in their stored form. A flush sends what was
// written at once, so the body of a flushed response is not kept.
type capture struct {
	w     http.ResponseWriter
	limit int64
	outer http.Header // the headers set before the handler ran; nil if none

	status int    // final status written; 0 before
	rec    []byte // the stored response: its head (appendHead) once status is written, then the body so far while fate is bodyKept
	bodyAt int    // where the body starts in rec
	size   int64  // body bytes written
	fate   bodyFate

	ctx beganContext // the handler's context, which ExecutionBegan marks
}

// initialBodyRoom is how many body bytes the stored response has room for
// before it grows, when the handler did not set a Content-Length; a
// Content-Length makes room for at most maxInitialBodyRoom, whatever it
// says.
const (
	initialBodyRoom    = 512
	maxInitialBodyRoom = 64 << 10
)

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
		c.head(code)
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

// head starts the stored response with status and the headers to keep, as
// they are now, with room for the body: as much as the handler's
// Content-Length says, within the limit, or initialBodyRoom.
func (c *capture) head(status int) {
	h := c.w.Header()
	var stack [16]string
	names := keptNames(stack[:0], h, c.outer)
	room := int64(initialBodyRoom)
	if cl := h.Get("Content-Length"); cl != "" {
		if n, err := strconv.ParseInt(cl, 10, 64); err == nil && n >= 0 {
			room = min(n, c.limit, maxInitialBodyRoom)
		}
	}
	c.rec = appendHead(make([]byte, 0, int64(headSize(h, names))+room), status, h, names)
	c.bodyAt = len(c.rec)
}

// keep copies p into the kept body, while it fits.
func (c *capture) keep(p []byte) {
	if c.room(len(p)) {
		c.rec = append(c.rec, p...)
	}
}

// keepString copies s into the kept body, while it fits.
func (c *capture) keepString(s string) {
	if c.room(len(s)) {
		c.rec = append(c.rec, s...)
	}
}

// drop stops keeping the body, for fate.
func (c *capture) drop(fate bodyFate) {
	c.fate = fate
	c.rec = slices.Clone(c.rec[:c.bodyAt]) // and lets the body's memory go
}

// room counts n more bytes written and reports whether they are to be kept:
// no longer once the body is over the limit (or was flushed).
func (c *capture) room(n int) bool {
	c.size += int64(n)
	if c.fate != bodyKept {
		return false
	}
	if c.size > c.limit {
		c.drop(bodyTooLarge)
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
		c.drop(bodyStreamed)
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

// response returns the status the handler answered and its stored form
// (see response_format.go): the status, the headers as they were when it
// was written, and the body, or its size when it was not kept. A handler
// that wrote nothing answered 200 with no body, as net/http does.
func (c *capture) response() (status int, stored []byte) {
	status = c.status
	if status == 0 {
		status = http.StatusOK
		c.head(status)
	}
	return status, finishResponse(c.rec, c.fate, c.size)
}
