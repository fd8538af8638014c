package idem

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// Codec turns the results of Do into bytes and back. Implementations must be
// safe for concurrent use. The default encodes with
// github.com/vmihailenco/msgpack/v5: struct fields matched by name, or by
// the `msgpack` tag, in exactly msgpack.Marshal's bytes; a []byte or string
// result is written and read without reflection, in the same bytes.
type Codec interface {
	Marshal(v any) ([]byte, error)
	Unmarshal(data []byte, v any) error
}

// msgpackCodec encodes with github.com/vmihailenco/msgpack/v5. Struct fields
// are matched by name, or by the `msgpack` tag. Its bytes are exactly
// msgpack.Marshal's, and it decodes as msgpack.Unmarshal does.
//
// With msgpackCodec (the default), Do writes and reads a []byte or string
// result itself, without reflection, in the same bytes (msgpack bin and str),
// and encodes other results through a pooled buffer.
type msgpackCodec struct{}

// Marshal implements Codec.
func (msgpackCodec) Marshal(v any) ([]byte, error) { return msgpack.Marshal(v) }

// Unmarshal implements Codec, reading data through a pooled reader.
func (msgpackCodec) Unmarshal(data []byte, v any) error {
	r := readers.Get().(*bytes.Reader)
	r.Reset(data)
	dec := msgpack.GetDecoder()
	dec.Reset(r) // as msgpack.Unmarshal: every option off
	err := dec.Decode(v)
	msgpack.PutDecoder(dec) // drops its reference to r
	r.Reset(nil)
	readers.Put(r)
	return err
}

// readers are the readers msgpackCodec.Unmarshal decodes from.
var readers = sync.Pool{New: func() any { return new(bytes.Reader) }}

// WithCodec sets how Do encodes results. Default: msgpack (see Codec).
// Applies to a Keeper.
func WithCodec(c Codec) Option {
	return Option{name: "WithCodec", to: toKeeper, set: func(s *settings) { s.codec = c }}
}

// The envelope around every stored value: a format byte, a kind byte, then the
// body. A reader that meets another format byte reports ErrCorrupt instead of
// guessing, so the format can change later.
const (
	envelopeV1 byte = 1

	kindBytes byte = 'b' // bytes given to Claim.Complete
	kindValue byte = 'v' // a value of Do, encoded by the Codec
	kindError byte = 'e' // the message of a FinalError of Do
	kindFinal byte = 'E' // a FinalError of Do with a code or details; see sealFinal
	// kindMarker is an empty result kept as a marker is, in a record of its
	// own: its body is, in decimal, when the result's retention ends (Unix
	// microseconds); see markerEnvelope.
	kindMarker byte = 'm'
)

// markerEnvelope is the result a record keeps when a claim of a call that
// claims compactly (Consume, batchBegin with withCompactClaims) was kept in
// a record of its own (a takeover, a claim after a release) and completes
// with an empty result: the record answers as a marker does, as completed
// with an empty result until the retention ends at until, then as one whose
// result is no longer kept (ErrResultExpired) for as long as it is kept,
// the marker retention.
func markerEnvelope(until time.Time) []byte {
	return strconv.AppendInt([]byte{envelopeV1, kindMarker}, until.UnixMicro(), 10)
}

// markerUntil reads when the retention of the result env ends, if env is a
// markerEnvelope.
func markerUntil(env []byte) (until int64, ok bool) {
	if len(env) < 3 || env[0] != envelopeV1 || env[1] != kindMarker {
		return 0, false
	}
	until, err := strconv.ParseInt(string(env[2:]), 10, 64)
	return until, err == nil
}

// seal puts body in an envelope of the given kind.
func seal(kind byte, body []byte) []byte {
	b := make([]byte, 2+len(body))
	b[0], b[1] = envelopeV1, kind
	copy(b[2:], body)
	return b
}

// open takes body out of an envelope.
func open(b []byte) (kind byte, body []byte, err error) {
	if len(b) < 2 {
		return 0, nil, fmt.Errorf("%w: envelope of %d bytes", ErrCorrupt, len(b))
	}
	if b[0] != envelopeV1 {
		return 0, nil, fmt.Errorf("%w: envelope format %d unknown", ErrCorrupt, b[0])
	}
	switch b[1] {
	case kindBytes, kindValue, kindError, kindFinal:
		return b[1], b[2:], nil
	}
	return 0, nil, fmt.Errorf("%w: envelope kind %q unknown", ErrCorrupt, b[1])
}

// sealFinal is how a FinalError is stored: its message alone (kindError, as
// the first format wrote every final error) when it has no code nor details,
// else a msgpack array [message, code, details] (kindFinal), details being a
// map of strings written in key order, so that one error always makes the
// same bytes. A reader skips elements after details, so that fields may be
// added later.
func sealFinal(e *FinalError) (kind byte, body []byte) {
	if e.Code == "" && len(e.Details) == 0 {
		return kindError, []byte(e.Error())
	}
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	// Strings into a buffer: the encoder cannot fail.
	_ = enc.EncodeArrayLen(3)
	_ = enc.EncodeString(e.Error())
	_ = enc.EncodeString(e.Code)
	_ = enc.EncodeMapLen(len(e.Details))
	for _, k := range slices.Sorted(maps.Keys(e.Details)) {
		_ = enc.EncodeString(k)
		_ = enc.EncodeString(e.Details[k])
	}
	return kindFinal, buf.Bytes()
}

// openFinal is the replayed FinalError stored by sealFinal, or nil for a
// result of another kind. An unreadable one is ErrCorrupt.
func openFinal(kind byte, body []byte) (*FinalError, error) {
	switch kind {
	case kindError:
		return &FinalError{Err: errors.New(string(body)), Replayed: true}, nil
	case kindFinal:
		e, err := decodeFinal(body)
		if err != nil {
			return nil, fmt.Errorf("%w: decoding the stored final error: %w", ErrCorrupt, err)
		}
		return e, nil
	}
	return nil, nil
}

// decodeFinal reads what sealFinal wrote for kindFinal.
func decodeFinal(body []byte) (*FinalError, error) {
	d := msgpack.NewDecoder(bytes.NewReader(body))
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	if n < 3 {
		return nil, fmt.Errorf("%d fields, want 3", n)
	}
	msg, err := d.DecodeString()
	if err != nil {
		return nil, err
	}
	e := &FinalError{Err: errors.New(msg), Replayed: true}
	if e.Code, err = d.DecodeString(); err != nil {
		return nil, err
	}
	if e.Details, err = decodeDetails(d); err != nil {
		return nil, err
	}
	for range n - 3 {
		if err := d.Skip(); err != nil {
			return nil, err
		}
	}
	return e, nil
}

// decodeDetails reads a map of strings; nil when it is empty.
func decodeDetails(d *msgpack.Decoder) (map[string]string, error) {
	n, err := d.DecodeMapLen()
	if err != nil || n <= 0 {
		return nil, err
	}
	m := make(map[string]string, min(n, 64))
	for range n {
		k, err := d.DecodeString()
		if err != nil {
			return nil, err
		}
		if m[k], err = d.DecodeString(); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// replayedFinal is Outcome.Err for a stored result of kind: the replayed
// *FinalError, or nil for a result that is not a final error.
func replayedFinal(kind byte, body []byte) (error, error) {
	final, err := openFinal(kind, body)
	if final == nil || err != nil {
		return nil, err
	}
	return final, nil
}

// sealResult is the envelope Do stores for its result v: v encoded by the
// Keeper's Codec, of kindValue. With msgpackCodec, a []byte or a string is
// written here without reflection, and anything else is encoded through a
// pooled buffer; either way in one allocation, of the envelope's size, and
// in the bytes seal(kindValue, msgpack.Marshal(v)) would make.
func sealResult[T any](k *Keeper, v T) ([]byte, error) {
	if !k.msgpack {
		body, err := k.codec.Marshal(v)
		if err != nil {
			return nil, err
		}
		return seal(kindValue, body), nil
	}
	switch p := any(&v).(type) {
	case *[]byte:
		return appendMsgpackBin(make([]byte, 0, 2+msgpackHeaderLen(len(*p))+len(*p)), *p), nil
	case *string:
		return appendMsgpackStr(make([]byte, 0, 2+msgpackHeaderLen(len(*p))+len(*p)), *p), nil
	}
	return sealMsgpack(v)
}

// openResult decodes body, a result Do stored (kindValue), into a T. With
// msgpackCodec, a []byte or string stored as msgpack bin, str or nil is read
// here, without reflection: a []byte result is then body's own bytes, so
// body must be the caller's (see Outcome.shared). Anything else goes to the
// Codec.
func openResult[T any](k *Keeper, body []byte) (T, error) {
	if k.msgpack {
		if v, ok := openMsgpackBytes[T](body); ok {
			return v, nil
		}
	}
	return unmarshalResult[T](k.codec, body)
}

// openMsgpackBytes reads body into a T that is a []byte or a string, as
// msgpack.Unmarshal would, when body is exactly one msgpack bin, str or nil.
// A []byte is body's own bytes.
func openMsgpackBytes[T any](body []byte) (v T, ok bool) {
	switch p := any(&v).(type) {
	case *[]byte:
		*p, ok = msgpackBytes(body)
	case *string:
		var b []byte
		b, ok = msgpackBytes(body)
		*p = string(b)
	}
	return v, ok
}

// unmarshalResult decodes body into a T with codec. Apart from
// openMsgpackBytes, so that only this path puts the T on the heap.
func unmarshalResult[T any](codec Codec, body []byte) (T, error) {
	var v T
	err := codec.Unmarshal(body, &v)
	return v, err
}

// encodeBufs are the buffers sealMsgpack encodes into; one that grew past
// maxPooledBuffer is not put back.
var encodeBufs = sync.Pool{New: func() any { return new(bytes.Buffer) }}

const maxPooledBuffer = 64 << 10

// sealMsgpack encodes v as msgpack.Marshal does, into an envelope of
// kindValue, through a pooled buffer.
func sealMsgpack(v any) ([]byte, error) {
	buf := encodeBufs.Get().(*bytes.Buffer)
	buf.Reset()
	buf.WriteByte(envelopeV1)
	buf.WriteByte(kindValue)
	enc := msgpack.GetEncoder()
	enc.Reset(buf) // as msgpack.Marshal: every option off
	err := enc.Encode(v)
	msgpack.PutEncoder(enc)
	var b []byte
	if err == nil {
		b = bytes.Clone(buf.Bytes())
	}
	if buf.Cap() <= maxPooledBuffer {
		encodeBufs.Put(buf)
	}
	return b, err
}

// The msgpack codes Do writes and reads itself (see the msgpack spec).
const (
	msgpackNil      byte = 0xc0
	msgpackBin8     byte = 0xc4
	msgpackBin16    byte = 0xc5
	msgpackBin32    byte = 0xc6
	msgpackStr8     byte = 0xd9
	msgpackStr16    byte = 0xda
	msgpackStr32    byte = 0xdb
	msgpackFixStr   byte = 0xa0 // 0xa0 to 0xbf: a string of up to 31 bytes
	msgpackFixStrTo byte = 0xbf
)

// msgpackHeaderLen is the longest header of a bin or str of n bytes.
func msgpackHeaderLen(n int) int {
	switch {
	case n <= math.MaxUint8:
		return 2
	case n <= math.MaxUint16:
		return 3
	}
	return 5
}

// appendMsgpackBin appends an envelope of kindValue holding b as
// msgpack.Marshal encodes a []byte: nil as nil, else bin 8, 16 or 32.
func appendMsgpackBin(dst, b []byte) []byte {
	dst = append(dst, envelopeV1, kindValue)
	if b == nil {
		return append(dst, msgpackNil)
	}
	dst = appendMsgpackLen(dst, len(b), msgpackBin8)
	return append(dst, b...)
}

// appendMsgpackStr appends an envelope of kindValue holding s as
// msgpack.Marshal encodes a string: fixstr up to 31 bytes, else str 8, 16 or
// 32.
func appendMsgpackStr(dst []byte, s string) []byte {
	dst = append(dst, envelopeV1, kindValue)
	if len(s) < 32 {
		dst = append(dst, msgpackFixStr|byte(len(s)))
	} else {
		dst = appendMsgpackLen(dst, len(s), msgpackStr8)
	}
	return append(dst, s...)
}

// appendMsgpackLen appends the header of a bin or str of n bytes, code8 being
// the code of its 8-bit form (the 16- and 32-bit forms follow it).
func appendMsgpackLen(dst []byte, n int, code8 byte) []byte {
	switch {
	case n <= math.MaxUint8:
		return append(dst, code8, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, code8+1), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(dst, code8+2), uint32(n))
}

// msgpackBytes returns the bytes of body when body is exactly one msgpack
// nil (nil), bin or str, as msgpack.Unmarshal decodes it into a []byte: a
// slice of body (never nil for a bin or str, even empty) capped at its end.
// ok is false for anything else, which the Codec decodes instead.
func msgpackBytes(body []byte) (b []byte, ok bool) {
	if len(body) == 0 {
		return nil, false
	}
	c := body[0]
	if c == msgpackNil {
		return nil, len(body) == 1
	}
	var n, h int
	switch {
	case msgpackFixStr <= c && c <= msgpackFixStrTo:
		n, h = int(c-msgpackFixStr), 1
	case (c == msgpackBin8 || c == msgpackStr8) && len(body) >= 2:
		n, h = int(body[1]), 2
	case (c == msgpackBin16 || c == msgpackStr16) && len(body) >= 3:
		n, h = int(binary.BigEndian.Uint16(body[1:])), 3
	case (c == msgpackBin32 || c == msgpackStr32) && len(body) >= 5:
		n, h = int(binary.BigEndian.Uint32(body[1:])), 5
	default:
		return nil, false
	}
	if len(body)-h != n {
		return nil, false
	}
	return body[h:len(body):len(body)], true
}
