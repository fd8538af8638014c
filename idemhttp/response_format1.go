package idemhttp

import (
	"bytes"
	"fmt"
	"net/http"
	"slices"

	"github.com/idemkit/idem"

	"github.com/vmihailenco/msgpack/v5"
)

// storedResponse is a response as format 1 stored it, which the middleware
// wrote before format 2 (response_format.go) and still reads: a msgpack
// array [1, status, headers, body, fate, size], where headers is a map from
// name to an array of values (every value, in order), body is nil unless
// fate is bodyKept, and size is how many body bytes the handler wrote. A
// reader skips elements after size.
type storedResponse struct {
	Status int
	Header http.Header
	Body   []byte
	Fate   bodyFate
	Size   int64
}

var _ msgpack.CustomDecoder = (*storedResponse)(nil)

// DecodeMsgpack implements msgpack.CustomDecoder: it reads format 1,
// without reflection.
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
	if version != responseFormat1 {
		return fmt.Errorf("stored response format %d unknown", version)
	}
	if s.Status, err = d.DecodeInt(); err != nil {
		return err
	}
	if s.Status < 100 || s.Status > 999 {
		return fmt.Errorf("stored status %d out of range", s.Status)
	}
	if s.Header, err = decodeFormat1Header(d); err != nil {
		return err
	}
	return s.decodeTail(d, n)
}

// decodeFormat1Header reads format 1's map of headers.
func decodeFormat1Header(d *msgpack.Decoder) (http.Header, error) {
	nh, err := d.DecodeMapLen()
	if err != nil {
		return nil, err
	}
	h := make(http.Header, min(max(nh, 0), 64))
	for range nh {
		name, err := d.DecodeString()
		if err != nil {
			return nil, err
		}
		nv, err := d.DecodeArrayLen()
		if err != nil {
			return nil, err
		}
		vs := make([]string, 0, min(max(nv, 0), 16))
		for range nv {
			v, err := d.DecodeString()
			if err != nil {
				return nil, err
			}
			vs = append(vs, v)
		}
		h[name] = vs
	}
	return h, nil
}

// decodeTail reads the body, fate and size of a format-1 array of n
// elements, and skips the elements after them.
func (s *storedResponse) decodeTail(d *msgpack.Decoder, n int) error {
	var err error
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

// unmarshal reads a format-1 payload. Errors wrap ErrCorrupt.
func (s *storedResponse) unmarshal(b []byte) error {
	if err := s.decodeFormat1(b); err != nil {
		return fmt.Errorf("%w: decoding the stored response: %w", idem.ErrCorrupt, err)
	}
	return nil
}

// decodeFormat1 reads a format-1 payload with a pooled decoder.
func (s *storedResponse) decodeFormat1(b []byte) error {
	d := msgpack.GetDecoder()
	defer msgpack.PutDecoder(d)
	d.Reset(bytes.NewReader(b))
	return s.DecodeMsgpack(d)
}

// format2 is s written in format 2: the same status, headers (names as
// they are, values in order), body and size.
func (s *storedResponse) format2() []byte {
	names := make([]string, 0, len(s.Header))
	for name := range s.Header {
		names = append(names, name)
	}
	slices.Sort(names)
	p := appendHead(nil, s.Status, s.Header, names)
	if s.Fate == bodyKept {
		p = append(p, s.Body...)
	}
	return finishResponse(p, s.Fate, s.Size)
}

// convertFormat1 reads a format-1 payload and writes it as format 2, so
// that a replay reads one format.
func convertFormat1(b []byte) ([]byte, error) {
	var s storedResponse
	if err := s.decodeFormat1(b); err != nil {
		return nil, err
	}
	return s.format2(), nil
}
