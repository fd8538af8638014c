package idem

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/vmihailenco/msgpack/v5"
)

// Codec turns the results of Do into bytes and back. Implementations must be
// safe for concurrent use. The default is MsgpackCodec.
type Codec interface {
	Marshal(v any) ([]byte, error)
	Unmarshal(data []byte, v any) error
}

// MsgpackCodec encodes with github.com/vmihailenco/msgpack/v5. Struct fields
// are matched by name, or by the `msgpack` tag.
type MsgpackCodec struct{}

// Marshal implements Codec.
func (MsgpackCodec) Marshal(v any) ([]byte, error) { return msgpack.Marshal(v) }

// Unmarshal implements Codec.
func (MsgpackCodec) Unmarshal(data []byte, v any) error { return msgpack.Unmarshal(data, v) }

// WithCodec sets how Do encodes results. Default: MsgpackCodec. Applies to a
// Keeper.
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
)

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
