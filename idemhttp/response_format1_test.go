package idemhttp

import (
	"bytes"
	"slices"

	"github.com/vmihailenco/msgpack/v5"
)

// The format-1 writer, as the middleware had it before format 2, byte for
// byte: the tests make format-1 payloads with it, to show they are still
// read.

var _ msgpack.CustomEncoder = (*storedResponse)(nil)

// EncodeMsgpack implements msgpack.CustomEncoder.
func (s *storedResponse) EncodeMsgpack(e *msgpack.Encoder) error {
	if err := e.EncodeArrayLen(6); err != nil {
		return err
	}
	if err := e.EncodeUint(responseFormat1); err != nil {
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

// marshal writes s in format 1, as the middleware stored it before format 2.
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
