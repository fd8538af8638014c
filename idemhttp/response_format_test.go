package idemhttp

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// storedResponse is a response as the tests give it and read it back: the
// parts that a stored response holds.
type storedResponse struct {
	Status int
	Header http.Header
	Body   []byte // the body when Fate is bodyKept
	Fate   bodyFate
	Size   int64 // body bytes the handler wrote
}

// goldenResponses are the responses of the golden payloads in testdata,
// response-v2-NAME.bin as format 2 writes them.
var goldenResponses = map[string]storedResponse{
	"created-json": {Status: 201, Header: http.Header{"Content-Type": {"application/json"}},
		Body: bytes.Repeat([]byte("x"), 200), Size: 200},
	"headers": {Status: 200, Header: http.Header{
		"X-Multi": {"one", "two", "three"}, "Link": {"</a>; rel=next", "</b>; rel=prev"},
		"Location": {"/payments/1"}, "x-lower": {"kept as written"}, "Content-Type": {"text/plain"},
		"X-Empty": {""},
	}, Body: []byte("body"), Size: 4},
	"too-large": {Status: 202, Header: http.Header{"Content-Type": {"application/json"}, "Etag": {`"v1"`}},
		Fate: bodyTooLarge, Size: 5 << 20},
	"streamed":   {Status: 200, Header: http.Header{"Content-Type": {"text/event-stream"}}, Fate: bodyStreamed, Size: 123},
	"no-content": {Status: 204, Header: http.Header{}},
}

// encodeResponse writes s in format 2, as the capture does: header names
// in the order of their bytes.
func encodeResponse(s storedResponse) []byte {
	names := slices.Sorted(maps.Keys(s.Header))
	p := appendHead(nil, s.Status, s.Header, names)
	if s.Fate == bodyKept {
		p = append(p, s.Body...)
	}
	return finishResponse(p, s.Fate, s.Size)
}

// decoded reads payload as a replay does, into a storedResponse.
func decoded(t *testing.T, payload []byte) storedResponse {
	t.Helper()
	e, err := decodeResponse(payload)
	require.NoError(t, err)
	h := http.Header{}
	e.copyHeader(h, 0)
	return storedResponse{Status: e.Status, Header: h, Body: e.Body, Fate: e.Fate, Size: e.Size}
}

// sameResponse asserts that got is want as a replay answers it: an empty
// body is no body.
func sameResponse(t *testing.T, want, got storedResponse, msg string) {
	t.Helper()
	assert.Equal(t, want.Status, got.Status, msg)
	assert.Equal(t, want.Header, got.Header, msg)
	assert.Equal(t, string(want.Body), string(got.Body), msg)
	assert.Equal(t, want.Fate, got.Fate, msg)
	assert.Equal(t, want.Size, got.Size, msg)
}

// TestResponseFormatGolden holds format 2 to its bytes (its tables are part
// of the format).
func TestResponseFormatGolden(t *testing.T) {
	for name, want := range goldenResponses {
		v2, err := os.ReadFile("testdata/response-v2-" + name + ".bin")
		require.NoError(t, err)

		assert.Equal(t, v2, encodeResponse(want), "%s: format 2 writes the golden bytes", name)
		sameResponse(t, want, decoded(t, v2), name+" read from format 2")
	}
}

// TestResponseFormatSize: a 201 with Content-Type: application/json and a
// 200-byte body takes 5 bytes besides its body.
func TestResponseFormatSize(t *testing.T) {
	assert.Len(t, encodeResponse(goldenResponses["created-json"]), 205)
}

// TestResponseFormatRoundTrip writes responses in format 2 and reads them
// back: every header as written (names not canonicalised, values in order,
// empty values), table entries or not, long values, many headers.
func TestResponseFormatRoundTrip(t *testing.T) {
	many := http.Header{}
	for i := range 40 {
		many[fmt.Sprintf("X-H%02d", i)] = []string{strings.Repeat("v", i*7)}
	}
	long := strings.Repeat("é", 5000)
	for name, s := range map[string]storedResponse{
		"pairs": {Status: 200, Header: http.Header{"Content-Type": {"application/json; charset=utf-8"},
			"X-Content-Type-Options": {"nosniff"}, "Cache-Control": {"no-store"}, "Vary": {"Origin"}}, Body: []byte("{}")},
		"table name, value spelled out":  {Status: 201, Header: http.Header{"Location": {"/p/1"}, "Content-Type": {"application/vnd.x+json"}}},
		"table value under another name": {Status: 201, Header: http.Header{"X-Kind": {"application/json"}, "Cache-Control": {"no-store", "private"}}},
		"not canonical":                  {Status: 200, Header: http.Header{"content-type": {"application/json"}, "x-id": {"7"}}},
		"empty values":                   {Status: 200, Header: http.Header{"X-Empty": {""}, "X-None": {}, "X-Two": {"", ""}}},
		"bytes of any kind":              {Status: 200, Header: http.Header{"X-Bin": {"\x00\xff\r\n"}, "X-Utf8": {"ünï"}}, Body: []byte{0, 1, 2}},
		"long value":                     {Status: 200, Header: http.Header{"X-Long": {long}, "Link": {long, "<b>"}}, Body: []byte(long)},
		"many headers":                   {Status: 200, Header: many},
		"status bounds low":              {Status: 100, Header: http.Header{}},
		"status bounds high":             {Status: 999, Header: http.Header{}},
		"too large":                      {Status: 201, Header: http.Header{"Etag": {`"x"`}}, Fate: bodyTooLarge, Size: 1 << 40},
		"streamed, nothing written":      {Status: 200, Header: http.Header{}, Fate: bodyStreamed},
	} {
		if s.Fate == bodyKept {
			s.Size = int64(len(s.Body))
		}
		p := encodeResponse(s)
		assert.Equal(t, p, encodeResponse(s), "%s: deterministic", name)
		sameResponse(t, s, decoded(t, p), name)
	}
}

// TestResponseFormatExtension: a payload of a later writer with the ext bit
// set reads as the response without its extension.
func TestResponseFormatExtension(t *testing.T) {
	s := goldenResponses["headers"]
	p := encodeResponse(s)
	e, err := decodeResponse(p)
	require.NoError(t, err)
	at := 4 + len(e.lines) // format, head (2 bytes), count (1 byte), lines
	ext := append([]byte(nil), p[:at]...)
	ext[1] |= 1 << 2
	ext = binary.AppendUvarint(ext, 3)
	ext = append(ext, "new"...)
	ext = append(ext, p[at:]...)
	sameResponse(t, s, decoded(t, ext), "with an extension")
}

// TestResponseFormatCorrupt: a payload that is not a response of format 2
// (among them the msgpack arrays of the unreleased format 1) is ErrCorrupt,
// never a panic nor a huge allocation.
func TestResponseFormatCorrupt(t *testing.T) {
	ok := encodeResponse(goldenResponses["too-large"])
	head := func(status uint64, fate byte) []byte {
		return binary.AppendUvarint([]byte{responseFormat2}, status<<3|uint64(fate))
	}
	for name, p := range map[string][]byte{
		"empty":                  nil,
		"format only":            {responseFormat2},
		"format 3":               {3, 0xc8, 0x0c, 0},
		"status 99":              append(head(99, 0), 0),
		"status 1000":            append(head(1000, 0), 0),
		"fate 3":                 append(head(200, 3), 0),
		"no count":               head(200, 0),
		"count past the end":     append(head(200, 0), 5, 0),
		"huge count":             append(head(200, 0), 0xff, 0xff, 0xff, 0xff, 0x0f),
		"unknown pair":           append(head(200, 0), 1, 0x7c),
		"unknown name":           append(binary.AppendUvarint(append(head(200, 0), 1), uint64(len(formatNames)+1)<<2|lineOne), 1),
		"unknown value":          append(head(200, 0), 1, 0x05, 0x7f),
		"reserved line kind":     append(head(200, 0), 1, 3),
		"name past the end":      append(head(200, 0), 1, 1, 9, 'a'),
		"value past the end":     append(head(200, 0), 1, 5, 20, 'a'),
		"values past the end":    append(head(200, 0), 1, 6, 9, 1),
		"ext past the end":       append(head(200, 0)[:1], append(binary.AppendUvarint(nil, 200<<3|4), 0, 9)...),
		"no size":                append(head(200, 1), 0),
		"bytes after the size":   append(ok, 0),
		"size past int64":        append(append(head(200, 1), 0), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01),
		"format 1, status 42":    {0x96, 1, 42, 0x80, 0xc0, 0, 0},
		"format 1":               {0x96, 1, 0xcc, 0xc8, 0x80, 0xc0, 0, 0},
		"format 1 truncated":     {0x96, 1, 0xcc},
		"not a response at all":  []byte("garbage"),
		"msgpack of three items": {0x93, 1, 2},
	} {
		_, err := decodeResponse(p)
		assert.ErrorIs(t, err, idem.ErrCorrupt, name)
	}
	for n := range len(ok) {
		_, err := decodeResponse(ok[:n])
		assert.ErrorIs(t, err, idem.ErrCorrupt, "too-large cut to %d bytes", n)
	}
}

// TestFormat1RecordUnreadable: a record in the unreleased format 1 (a
// msgpack array: a 200 with no headers and no body) is answered 500,
// unreadable, and the request is not run, on miniredis and on redis-server.
func TestFormat1RecordUnreadable(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		mw, err := New(k)
		require.NoError(t, err)
		ran := false
		h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ran = true }))
		r := postKey("k", "a")
		out, err := k.Begin(context.Background(), "", "k",
			idem.WithFingerprint(requestFingerprint(r, defaultFingerprint(r, []byte("a")))))
		require.NoError(t, err)
		v1 := []byte{0x96, 1, 0xcc, 0xc8, 0x80, 0xc0, 0, 0}
		require.NoError(t, out.Claim.Complete(context.Background(), v1, 0))

		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, postKey("k", "a"))
		checkProblem(t, rec.Code, rec.Header(), rec.Body.Bytes(), http.StatusInternalServerError, ProblemCorrupt)
		assert.False(t, ran, "an unreadable record does not run the handler")
	})
}

// TestCaptureWritesFormat2: the response a handler writes is stored as
// format 2, byte for byte what the format's encoder writes for it.
func TestCaptureWritesFormat2(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	want := goldenResponses["headers"]
	mw, err := New(k)
	require.NoError(t, err)
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for name, vs := range want.Header {
			w.Header()[name] = vs
		}
		w.Header().Set("Set-Cookie", "not kept")
		w.WriteHeader(want.Status)
		w.Write(want.Body)
	}))
	h.ServeHTTP(httptest.NewRecorder(), postKey("k", "a"))
	r := postKey("k", "a")
	out, err := k.Begin(context.Background(), "", "k", idem.WithFingerprint(requestFingerprint(r, defaultFingerprint(r, []byte("a")))))
	require.NoError(t, err)
	require.True(t, out.Replayed)
	golden, err := os.ReadFile("testdata/response-v2-headers.bin")
	require.NoError(t, err)
	assert.Equal(t, golden, out.Value)
}

// TestStoredResponseMemory measures, on redis-server, the memory of the
// record of a 201 with Content-Type: application/json and a 200-byte body
// (MEMORY USAGE: value, key and keyspace entry), and holds it to 350 bytes.
func TestStoredResponseMemory(t *testing.T) {
	b := redistest.Real(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	body := bytes.Repeat([]byte("x"), 200)
	mw, err := New(k)
	require.NoError(t, err)
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write(body)
	}))
	h.ServeHTTP(httptest.NewRecorder(), postKey("http-1", `{"amount":1000,"currency":"EUR"}`))
	key := recordKey(t, b, "", "http-1")
	value, err := b.Client.Get(ctx, key).Result()
	require.NoError(t, err)
	n, err := b.Client.MemoryUsage(ctx, key).Result()
	require.NoError(t, err)
	t.Logf("201 with Content-Type and a 200-byte body: value %d bytes (payload %d), MEMORY USAGE %d bytes",
		len(value), len(encodeResponse(goldenResponses["created-json"])), n)
	assert.LessOrEqual(t, n, int64(350))
}

// FuzzResponseFormat: whatever a record holds, reading it never panics;
// what reads as a response is written again as the same response.
//
// Fuzz it with -fuzztime as a count (-fuzztime 50000x): without a bound
// it never ends.
func FuzzResponseFormat(f *testing.F) {
	for name := range goldenResponses {
		p, err := os.ReadFile("testdata/response-v2-" + name + ".bin")
		require.NoError(f, err)
		f.Add(p)
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		e, err := decodeResponse(p)
		if err != nil {
			return
		}
		h := http.Header{}
		e.copyHeader(h, 0)
		s := storedResponse{Status: e.Status, Header: h, Body: e.Body, Fate: e.Fate, Size: e.Size}
		again := decoded(t, encodeResponse(s))
		sameResponse(t, s, again, "written again")
	})
}
