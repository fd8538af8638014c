package idemwatermill

import (
	"maps"

	"github.com/ThreeDotsLabs/watermill/message"
)

// output is what the first run of a handler produced, as idem.Do stores it
// with the Keeper's Codec (msgpack by default): one entry a message, in
// the order the handler returned them. Nil when it produced none.
type output []storedMessage

// storedMessage is one produced message: what a replay publishes again. Its
// context and acknowledgement state are not kept. The short field names are
// the stored format: renaming one makes older records read without it.
type storedMessage struct {
	UUID     string            `msgpack:"u" json:"u"`
	Metadata map[string]string `msgpack:"m,omitempty" json:"m,omitempty"`
	Payload  []byte            `msgpack:"p" json:"p"`
}

// seal returns what is stored of msgs. It copies nothing: it is encoded
// before the router publishes msgs.
func seal(msgs []*message.Message) output {
	if len(msgs) == 0 {
		return nil
	}
	out := make(output, len(msgs))
	for i, m := range msgs {
		out[i] = storedMessage{UUID: m.UUID, Metadata: m.Metadata, Payload: m.Payload}
	}
	return out
}

// open returns new messages equal (message.Message.Equals) to those out was
// sealed from, each with metadata of its own, never nil.
func (out output) open() []*message.Message {
	if len(out) == 0 {
		return nil
	}
	msgs := make([]*message.Message, len(out))
	for i, s := range out {
		m := message.NewMessage(s.UUID, s.Payload)
		maps.Copy(m.Metadata, s.Metadata)
		msgs[i] = m
	}
	return msgs
}
