package idemhttp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/http"

	"github.com/idemkit/idem"
)

// The stored response is the value the middleware gives Claim.Complete.
// Format 2 is a byte layout made to be small in Redis and to replay without
// reflection:
//
//	payload = 0x02 head count line* [ext] tail
//	head    = uvarint(status<<3 | ext<<2 | fate)
//	count   = uvarint: how many header lines follow
//	line    = uvarint(t), then, by t&3:
//	            0: formatPairs[t>>2]: a name and its one value
//	            1: name(t>>2), then one value
//	            2: name(t>>2), then uvarint(n), then n values
//	            3: reserved
//	name(i) = formatNames[i-1]; for i == 0, uvarint(len) then the name's bytes
//	value   = uvarint(v): formatValues[v>>1] if v&1 == 1; else v>>1 bytes follow
//	ext     = with the ext bit: uvarint(len), then len bytes that this
//	          reader skips, so that fields may be added without a new format
//	tail    = fate bodyKept: the body, every byte left (its size is its
//	          length); otherwise uvarint(size), the body bytes the handler
//	          wrote, and nothing after it
//
// The body has no length of its own: a record's value is stored and read
// whole, and the two bytes a length would take can move the record into a
// larger allocation in Redis.
//
// Lines come in the order of their names' bytes, each with every value of
// its header in order; names and values are kept as the handler wrote them
// (a table entry stands for exactly its own bytes). The tables below are
// part of the format: they never change, and a format that needs other
// entries takes a new number.
//
// Format 1, a msgpack array, was written only by development builds before
// 0.1.0 and is not read: its number is not used again.
const (
	responseFormat2 = 2
	// responseFormat is the format the middleware writes.
	responseFormat = responseFormat2
)

// Header names written as small numbers in format 2: formatNames[i] is
// written as i+1.
var formatNames = [...]string{
	"Content-Type", "Location", "Cache-Control", "Etag", "Last-Modified",
	"Content-Encoding", "Content-Language", "Content-Disposition", "Content-Location", "Vary",
	"Expires", "Link", "Retry-After", "X-Request-Id", "Access-Control-Allow-Origin",
	"Access-Control-Allow-Credentials", "Access-Control-Expose-Headers", "Strict-Transport-Security",
	"Content-Security-Policy", "X-Frame-Options", "Referrer-Policy", "X-Content-Type-Options",
	"Pragma", "Allow", "Content-Range", "Accept-Ranges", "Age", "Server", "Preference-Applied",
	"Content-Digest", "Repr-Digest",
}

// Header values written as small numbers in format 2, whatever their
// header's name.
var formatValues = [...]string{
	"application/json", "application/json; charset=utf-8", "text/plain; charset=utf-8",
	"text/html; charset=utf-8", "application/problem+json", "application/octet-stream", "text/plain",
	"application/xml", "nosniff", "no-store", "no-cache", "private", "no-cache, no-store, must-revalidate",
	"Accept-Encoding", "Origin", "gzip", "br", "bytes", "0", "*", "true", "DENY", "SAMEORIGIN",
	"no-referrer", "strict-origin-when-cross-origin", "max-age=31536000; includeSubDomains", "max-age=0",
	"public", "text/event-stream", "application/x-ndjson",
}

// headerPair is a header with exactly one value.
type headerPair struct{ name, value string }

// Headers with one value that format 2 writes as one small number.
var formatPairs = [...]headerPair{
	{"Content-Type", "application/json"},
	{"Content-Type", "application/json; charset=utf-8"},
	{"Content-Type", "text/plain; charset=utf-8"},
	{"Content-Type", "text/html; charset=utf-8"},
	{"Content-Type", "application/problem+json"},
	{"Content-Type", "application/octet-stream"},
	{"Content-Type", "text/plain"},
	{"Content-Type", "application/xml"},
	{"Content-Type", "text/event-stream"},
	{"Content-Type", "application/x-ndjson"},
	{"X-Content-Type-Options", "nosniff"},
	{"Cache-Control", "no-store"},
	{"Cache-Control", "no-cache"},
	{"Cache-Control", "private"},
	{"Cache-Control", "no-cache, no-store, must-revalidate"},
	{"Vary", "Accept-Encoding"},
	{"Vary", "Origin"},
	{"Content-Encoding", "gzip"},
	{"Content-Encoding", "br"},
	{"Accept-Ranges", "bytes"},
	{"Pragma", "no-cache"},
	{"Expires", "0"},
	{"X-Frame-Options", "DENY"},
	{"X-Frame-Options", "SAMEORIGIN"},
	{"Referrer-Policy", "no-referrer"},
	{"Referrer-Policy", "strict-origin-when-cross-origin"},
	{"Access-Control-Allow-Origin", "*"},
}

// The tables' entries by what they stand for, for the encoder.
var (
	nameCodes  = indexOf(formatNames[:])
	valueCodes = indexOf(formatValues[:])
	pairCodes  = indexOf(formatPairs[:])
)

// indexOf maps each of xs to its index.
func indexOf[T comparable](xs []T) map[T]uint64 {
	m := make(map[T]uint64, len(xs))
	for i, x := range xs {
		m[x] = uint64(i)
	}
	return m
}

// Line kinds: the low two bits of a line's first number.
const (
	linePair   = 0
	lineOne    = 1
	lineValues = 2
)

// maxStoredStatus is written in place of a larger status, which a reader
// refuses as it refuses this one.
const maxStoredStatus = 1000

// appendHead appends the start of a format-2 payload to dst: the format,
// status with fate bodyKept (finishResponse sets the fate), and the header
// lines of h's headers names. A kept body is appended after it.
func appendHead(dst []byte, status int, h http.Header, names []string) []byte {
	dst = append(dst, responseFormat2)
	dst = binary.AppendUvarint(dst, uint64(min(max(status, 0), maxStoredStatus))<<3)
	dst = binary.AppendUvarint(dst, uint64(len(names)))
	for _, name := range names {
		dst = appendLine(dst, name, h[name])
	}
	return dst
}

// headSize is at least the size of what appendHead appends for names of h.
func headSize(h http.Header, names []string) int {
	n := 1 + 2*binary.MaxVarintLen64
	for _, name := range names {
		n += len(name) + 2*binary.MaxVarintLen64
		for _, v := range h[name] {
			n += len(v) + binary.MaxVarintLen64
		}
	}
	return n
}

// finishResponse completes p, which appendHead began and a kept body
// follows: it writes fate into the head and, for a body not kept (p then
// ends with the header lines), the size the handler wrote.
func finishResponse(p []byte, fate bodyFate, size int64) []byte {
	p[1] |= byte(fate) // the head's first byte holds its low bits
	if fate != bodyKept {
		p = binary.AppendUvarint(p, uint64(max(size, 0)))
	}
	return p
}

// appendLine appends the line of header name with values vs.
func appendLine(dst []byte, name string, vs []string) []byte {
	if len(vs) == 1 {
		if i, ok := pairCodes[headerPair{name, vs[0]}]; ok {
			return binary.AppendUvarint(dst, i<<2|linePair)
		}
		return appendValue(appendName(dst, name, lineOne), vs[0])
	}
	dst = binary.AppendUvarint(appendName(dst, name, lineValues), uint64(len(vs)))
	for _, v := range vs {
		dst = appendValue(dst, v)
	}
	return dst
}

// appendName appends the first number of a line of kind, naming name.
func appendName(dst []byte, name string, kind uint64) []byte {
	if i, ok := nameCodes[name]; ok {
		return binary.AppendUvarint(dst, (i+1)<<2|kind)
	}
	dst = binary.AppendUvarint(dst, kind)
	dst = binary.AppendUvarint(dst, uint64(len(name)))
	return append(dst, name...)
}

// appendValue appends a header value.
func appendValue(dst []byte, v string) []byte {
	if i, ok := valueCodes[v]; ok {
		return binary.AppendUvarint(dst, i<<1|1)
	}
	dst = binary.AppendUvarint(dst, uint64(len(v))<<1)
	return append(dst, v...)
}

// encodedResponse is a stored response as read back for a replay: its
// parts, checked, in the payload's own bytes (Body and the header lines
// are slices of it).
type encodedResponse struct {
	Status int
	Fate   bodyFate
	Size   int64  // body bytes the handler wrote
	Body   []byte // the body when Fate is bodyKept; nil otherwise

	lines   []byte // the header lines, as written, checked by parse
	count   int    // lines in lines
	values  int    // header values in lines
	literal bool   // whether lines spell out a name or a value
}

// decodeResponse reads a stored response of format 2. Its errors wrap
// ErrCorrupt.
func decodeResponse(b []byte) (encodedResponse, error) {
	var s encodedResponse
	var err error
	switch {
	case len(b) == 0:
		err = errors.New("stored response is empty")
	case b[0] != responseFormat2:
		err = fmt.Errorf("stored response format %d unknown", b[0])
	default:
		err = s.parse(b)
	}
	if err != nil {
		return encodedResponse{}, fmt.Errorf("%w: decoding the stored response: %w", idem.ErrCorrupt, err)
	}
	return s, nil
}

// parse reads a format-2 payload, checking every part of it.
func (s *encodedResponse) parse(b []byte) error {
	r := lineReader{b: b, off: 1}
	head := r.uvarint()
	count := r.count()
	status, ext, fate := head>>3, head>>2&1, bodyFate(head&3)
	switch {
	case r.err != nil:
		return r.err
	case status < 100 || status > 999:
		return fmt.Errorf("stored status %d out of range", status)
	case fate > bodyStreamed:
		return fmt.Errorf("stored body fate %d unknown", fate)
	}
	s.Status, s.Fate, s.count = int(status), fate, int(count)
	start := r.off
	for range count {
		_, n, _, pair := r.lineStart()
		for i := uint64(0); i < n && !pair; i++ {
			r.value()
		}
		s.values += int(n)
	}
	s.lines, s.literal = b[start:r.off], r.literal
	if ext == 1 {
		r.skip(r.uvarint())
	}
	if r.err != nil {
		return r.err
	}
	return s.parseTail(&r)
}

// parseTail reads what follows the header lines: the body, or the size.
func (s *encodedResponse) parseTail(r *lineReader) error {
	if s.Fate == bodyKept {
		s.Body = r.b[r.off:]
		s.Size = int64(len(s.Body))
		return nil
	}
	size := r.uvarint()
	switch {
	case r.err != nil:
		return r.err
	case size > math.MaxInt64:
		return fmt.Errorf("stored body size %d out of range", size)
	case r.off != len(r.b):
		return fmt.Errorf("%d bytes after the stored response", len(r.b)-r.off)
	}
	s.Size = int64(size)
	return nil
}

// copyHeader sets every stored header in h, replacing a header of the same
// name. Every value slice shares one backing array, each slice capped at
// its length, so that appending to one never writes into another; extra
// more places in it are handed back for the caller's own headers.
func (s *encodedResponse) copyHeader(h http.Header, extra int) valueSlab {
	slab := make(valueSlab, s.values+extra)
	r := lineReader{b: s.lines}
	if s.literal {
		r.text = string(s.lines) // one string for every name and value spelled out
	}
	for range s.count {
		name, n, v, pair := r.lineStart()
		vs := slab.take(int(n))
		if pair {
			vs[0] = v
		} else {
			for i := range vs {
				vs[i] = r.value()
			}
		}
		h[name] = vs
	}
	return slab
}

// valueSlab hands out header value slices from one backing array.
type valueSlab []string

// take returns the next n places, capped at n.
func (s *valueSlab) take(n int) []string {
	vs := (*s)[:n:n]
	*s = (*s)[n:]
	return vs
}

// one returns the next place, holding v.
func (s *valueSlab) one(v string) []string {
	vs := s.take(1)
	vs[0] = v
	return vs
}

var errTruncated = errors.New("stored response truncated")

// lineReader reads a format-2 payload from b at off. Its first error
// sticks: later reads return zero values. With text set (b as a string),
// the names and values that b spells out are substrings of it; without,
// they are "" and only checked.
type lineReader struct {
	b       []byte
	off     int
	text    string
	literal bool // a name or a value was spelled out
	err     error
}

func (r *lineReader) fail(err error) {
	if r.err == nil {
		r.err = err
	}
}

func (r *lineReader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b[r.off:])
	if n <= 0 {
		r.fail(errTruncated)
		return 0
	}
	r.off += n
	return v
}

// count reads how many items follow, each at least a byte long: never
// more than the bytes left.
func (r *lineReader) count() uint64 {
	n := r.uvarint()
	if n > uint64(len(r.b)-r.off) {
		r.fail(errTruncated)
		return 0
	}
	return n
}

// skip steps over n bytes and returns where they start.
func (r *lineReader) skip(n uint64) int {
	if r.err != nil {
		return r.off
	}
	if n > uint64(len(r.b)-r.off) {
		r.fail(errTruncated)
		return r.off
	}
	at := r.off
	r.off += int(n)
	return at
}

// spelled reads a name or value of n bytes spelled out.
func (r *lineReader) spelled(n uint64) string {
	at := r.skip(n)
	r.literal = true
	if r.err != nil || r.text == "" {
		return ""
	}
	return r.text[at : at+int(n)]
}

// lineStart reads the start of a header line: its name and how many
// values follow it, or, for a pair, its one value (pair true).
func (r *lineReader) lineStart() (name string, n uint64, value string, pair bool) {
	t := r.uvarint()
	switch t & 3 {
	case linePair:
		if t>>2 >= uint64(len(formatPairs)) {
			r.fail(fmt.Errorf("stored header pair %d unknown", t>>2))
			return "", 0, "", true
		}
		p := formatPairs[t>>2]
		return p.name, 1, p.value, true
	case lineOne:
		return r.name(t >> 2), 1, "", false
	case lineValues:
		name = r.name(t >> 2)
		return name, r.count(), "", false
	}
	r.fail(fmt.Errorf("stored header line kind %d unknown", t&3))
	return "", 0, "", false
}

// name reads the name of a line whose first number names i.
func (r *lineReader) name(i uint64) string {
	if i == 0 {
		return r.spelled(r.uvarint())
	}
	if i > uint64(len(formatNames)) {
		r.fail(fmt.Errorf("stored header name %d unknown", i))
		return ""
	}
	return formatNames[i-1]
}

// value reads a header value.
func (r *lineReader) value() string {
	v := r.uvarint()
	if v&1 == 0 {
		return r.spelled(v >> 1)
	}
	if v>>1 >= uint64(len(formatValues)) {
		r.fail(fmt.Errorf("stored header value %d unknown", v>>1))
		return ""
	}
	return formatValues[v>>1]
}
