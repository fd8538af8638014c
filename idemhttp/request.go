package idemhttp

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"

	"github.com/idemkit/idem"
)

// requestFingerprint is the fingerprint of a request's record: SHA-256 over
// its method and its concrete path, then the digest of the fingerprint
// function (WithFingerprint; nil: nothing more). The method and the path are
// always part of it, so that a key reused on another endpoint or another
// resource answers 422 whatever the fingerprint function reads, and a
// record never replays to a request for another resource.
func requestFingerprint(r *http.Request, digest []byte) []byte {
	h := sha256.New()
	writeField(h, r.Method)
	writeField(h, requestPath(r))
	h.Write(digest)
	return h.Sum(nil)
}

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

// writeField writes s to h, its length first, so that no field can end where
// another goes on.
func writeField(h io.Writer, s string) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(s)))
	h.Write(n[:])
	io.WriteString(h, s)
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
		return key, body, verdict{kind: idem.ResultRefused, err: err, problem: refusal(err, ProblemKeyRefused,
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

// restoreBody gives r its whole body again, once the middleware has read it.
func restoreBody(r *http.Request, body []byte) {
	if r.Body != nil && r.Body != http.NoBody {
		r.Body = io.NopCloser(bytes.NewReader(body))
	}
}

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

// readBody reads the request body, up to the limit.
func (m *middleware) readBody(r *http.Request) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	if r.ContentLength > m.bodyLimit {
		return nil, errBodyTooLarge
	}
	// One byte past the limit tells a body at the limit from a larger one;
	// a limit of math.MaxInt64 has no byte past it.
	body, err := io.ReadAll(io.LimitReader(r.Body, saturatingAdd(m.bodyLimit, 1)))
	if err != nil {
		return nil, err
	}
	if int64(len(body)) > m.bodyLimit {
		return nil, errBodyTooLarge
	}
	return body, nil
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
	h := sha256.New()
	writeField(h, r.Method)
	writeField(h, r.URL.RequestURI())
	h.Write(body)
	return h.Sum(nil)
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
