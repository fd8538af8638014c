package idemhttp

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"math"
	"net/http"
	"strings"
	"sync"

	"github.com/idemkit/idem"
)

// requestFingerprint is the fingerprint of a request's record: SHA-256 over
// its method and its concrete path, then the digest of the fingerprint
// function (WithFingerprint; nil: nothing more). The method and the path are
// always part of it, so that a key reused on another endpoint or another
// resource answers 422 whatever the fingerprint function reads, and a
// record never replays to a request for another resource.
func requestFingerprint(r *http.Request, digest []byte) []byte {
	d := getDigester()
	defer digesters.Put(d)
	return append([]byte(nil), d.request(r, digest)...)
}

// fingerprintOf is the fingerprint of r's record: requestFingerprint over
// the fingerprint function's digest of r and body, or, without a function
// of the user's (WithFingerprint), over defaultFingerprint's. It is d's
// until d is used again.
func (m *middleware) fingerprintOf(d *digester, r *http.Request, body []byte) []byte {
	var digest []byte
	if m.ownDigest {
		digest = m.fingerprint(r, body)
	} else {
		var sum [sha256.Size]byte
		digest = append(sum[:0], d.body(r, body)...)
	}
	return d.request(r, digest)
}

// digester computes fingerprints with a SHA-256 and a buffer that it keeps
// between requests (in digesters), so that a fingerprint costs no
// allocation but its result's.
type digester struct {
	h   hash.Hash
	buf []byte            // the fields being hashed
	sum [sha256.Size]byte // the last digest
}

var digesters = sync.Pool{New: func() any { return &digester{h: sha256.New()} }}

func getDigester() *digester { return digesters.Get().(*digester) }

// request is requestFingerprint's digest: of r's method and concrete path,
// then digest. It is d's until d is used again.
func (d *digester) request(r *http.Request, digest []byte) []byte {
	d.buf = appendField(appendField(d.buf[:0], r.Method), requestPath(r))
	d.buf = append(d.buf, digest...)
	return d.digest(nil)
}

// body is defaultFingerprint's digest: of r's method, request target and
// body. It is d's until d is used again.
func (d *digester) body(r *http.Request, body []byte) []byte {
	d.buf = appendField(appendField(d.buf[:0], r.Method), r.URL.RequestURI())
	return d.digest(body)
}

// digest hashes d's fields, then tail.
func (d *digester) digest(tail []byte) []byte {
	d.h.Reset()
	d.h.Write(d.buf)
	d.h.Write(tail)
	if cap(d.buf) > maxKeptDigestBuffer {
		d.buf = nil // a path this long is rare: do not keep its memory
	}
	return d.h.Sum(d.sum[:0])
}

// maxKeptDigestBuffer is the largest buffer a pooled digester keeps.
const maxKeptDigestBuffer = 4 << 10

// requestPath is the path the client asked for: the request target as
// received (before any router or http.StripPrefix rewrote r.URL) up to its
// query, or r.URL's escaped path for a request made in process.
func requestPath(r *http.Request) string {
	if r.RequestURI != "" {
		path, _, _ := strings.Cut(r.RequestURI, "?")
		return path
	}
	return r.URL.EscapedPath()
}

// appendField appends s to b, its length first (8 bytes, big-endian), so
// that no field can end where another goes on.
func appendField(b []byte, s string) []byte {
	return append(binary.BigEndian.AppendUint64(b, uint64(len(s))), s...)
}

// verdict is what the steps before the claim decided: go on (the zero
// value), pass the request through unguarded, or refuse it with problem.
type verdict struct {
	pass    bool
	kind    idem.Result // of a refusal; 0 otherwise
	err     error
	problem problem
}

// identify reads a guarded request's key and body: the key header first, so
// that a request without one is passed through or refused before its body
// is read; or, with a key function, the body first, for the function to
// read.
func (m *middleware) identify(r *http.Request) (key string, body []byte, v verdict) {
	if m.keyFunc != nil {
		return m.identifyByFunc(r)
	}
	key, present, err := m.requestKey(r)
	if v = m.checkKey(present, err); v.pass || v.kind != 0 {
		return key, nil, v
	}
	if body, err = m.readBody(r); err != nil {
		return key, nil, m.bodyProblem(r, err)
	}
	return key, body, verdict{}
}

// identifyByFunc reads the body, then asks the key function for the key.
func (m *middleware) identifyByFunc(r *http.Request) (string, []byte, verdict) {
	body, err := m.readBody(r)
	if err != nil {
		return "", nil, m.bodyProblem(r, err)
	}
	restoreBody(r, body) // for a function that reads r.Body, as some webhook libraries do
	key, err := m.keyFunc(r, body)
	restoreBody(r, body)
	if err != nil {
		return key, body, verdict{kind: idem.ResultRefused, err: err, problem: refusedProblem(err, ProblemKeyRefused,
			"This request could not be accepted, so it was not run.")}
	}
	present := key != ""
	if present {
		err = idem.ValidateKey(key)
	}
	return key, body, m.checkKey(present, err)
}

// checkKey decides on a request by its key: pass it through when it has none
// and none is required, refuse it when it has none or an unusable one (err),
// go on otherwise.
func (m *middleware) checkKey(present bool, err error) verdict {
	switch {
	case !present && !m.required:
		return verdict{pass: true}
	case !present || err != nil:
		return verdict{kind: idem.ResultInvalid, err: err, problem: m.keyProblem(present, err)}
	}
	return verdict{}
}

// restoreBody gives r its whole body again, once the middleware has read
// it: a reader of body, or the one restoreBody gave r before, rewound.
func restoreBody(r *http.Request, body []byte) {
	switch b := r.Body.(type) {
	case nil:
	case *bodyReader:
		b.r.Reset(body)
	default:
		if r.Body != http.NoBody {
			r.Body = &bodyReader{r: *bytes.NewReader(body)}
		}
	}
}

// bodyReader is the body restoreBody gives a request: what
// io.NopCloser(bytes.NewReader(body)) would give, in one allocation.
type bodyReader struct{ r bytes.Reader }

func (b *bodyReader) Read(p []byte) (int, error)         { return b.r.Read(p) }
func (b *bodyReader) WriteTo(w io.Writer) (int64, error) { return b.r.WriteTo(w) }
func (*bodyReader) Close() error                         { return nil }

// requestKey returns the request's key, whether it has the header, and an
// error wrapping ErrInvalidKey if the key cannot be used.
func (m *middleware) requestKey(r *http.Request) (key string, present bool, err error) {
	vs := r.Header.Values(m.header)
	switch len(vs) {
	case 0:
		return "", false, nil
	case 1:
	default:
		return "", true, fmt.Errorf("%w: %d %s headers", idem.ErrInvalidKey, len(vs), m.header)
	}
	key, err = unquoteKey(vs[0])
	if err != nil {
		return "", true, err
	}
	return key, true, idem.ValidateKey(key)
}

// unquoteKey returns the content of v if it is a Structured Field string
// ("..." with \" and \\ escapes, RFC 8941), else v.
func unquoteKey(v string) (string, error) {
	if v == "" || v[0] != '"' {
		return v, nil
	}
	if len(v) < 2 || v[len(v)-1] != '"' {
		return "", fmt.Errorf("%w: unterminated quoted string", idem.ErrInvalidKey)
	}
	inner := v[1 : len(v)-1]
	if !strings.ContainsAny(inner, `\"`) {
		return inner, nil
	}
	var b strings.Builder
	for i := 0; i < len(inner); i++ {
		switch c := inner[i]; c {
		case '\\':
			i++
			if i == len(inner) || (inner[i] != '"' && inner[i] != '\\') {
				return "", fmt.Errorf("%w: bad escape in quoted string", idem.ErrInvalidKey)
			}
			b.WriteByte(inner[i])
		case '"':
			return "", fmt.Errorf("%w: unescaped quote in quoted string", idem.ErrInvalidKey)
		default:
			b.WriteByte(c)
		}
	}
	return b.String(), nil
}

var errBodyTooLarge = errors.New("idem: request body too large")

// readBody reads the request body, up to the limit, into a buffer of its
// Content-Length (with a byte to spare to see the end), or of 512 bytes
// growing as io.ReadAll's does when the length is unknown. The body is
// handed to the handler and to the fingerprint and key functions, which
// may keep it, so its buffer is the request's own, never pooled.
func (m *middleware) readBody(r *http.Request) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	if r.ContentLength > m.bodyLimit {
		return nil, errBodyTooLarge
	}
	size := int64(512)
	if r.ContentLength >= 0 {
		size = min(r.ContentLength, maxBodyRoom) + 1
	}
	// One byte past the limit tells a body at the limit from a larger one;
	// a limit of math.MaxInt64 has no byte past it.
	body, err := readAtMost(r.Body, make([]byte, 0, size), saturatingAdd(m.bodyLimit, 1))
	if err != nil {
		return nil, err
	}
	if int64(len(body)) > m.bodyLimit {
		return nil, errBodyTooLarge
	}
	return body, nil
}

// maxBodyRoom is the most a request's Content-Length makes room for before
// its body arrives; a larger body's buffer grows as the body comes, so
// that a client cannot make the server hold memory it did not send.
const maxBodyRoom = 64 << 10

// readAtMost appends what src reads to b, until src ends or b holds n
// bytes, growing b as append does.
func readAtMost(src io.Reader, b []byte, n int64) ([]byte, error) {
	for int64(len(b)) < n {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		end := int64(cap(b))
		if end > n {
			end = n
		}
		k, err := src.Read(b[len(b):end])
		b = b[:len(b)+k]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
	}
	return b, nil
}

// saturatingAdd returns a+b for b >= 0, or math.MaxInt64 where that
// overflows.
func saturatingAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// defaultFingerprint is SHA-256 over the method, the request target and the
// body, each but the last preceded by its length.
func defaultFingerprint(r *http.Request, body []byte) []byte {
	d := getDigester()
	defer digesters.Put(d)
	return append([]byte(nil), d.body(r, body)...)
}

// isToken reports whether s is a non-empty HTTP token (RFC 9110, 5.6.2).
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}
