package idem

import (
	"fmt"

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
	case kindBytes, kindValue, kindError:
		return b[1], b[2:], nil
	}
	return 0, nil, fmt.Errorf("%w: envelope kind %q unknown", ErrCorrupt, b[1])
}
