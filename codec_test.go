package idem

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// fastPathSizes cross every boundary of msgpack's str and bin headers.
var fastPathSizes = []int{0, 1, 31, 32, 255, 256, 65535, 65536, 70000}

// TestSealResultWritesMsgpackBytes: Do's own encoding of []byte and string
// results is byte for byte what the msgpack codec wrote before it, so that
// records stay readable by every release and by Begin's callers.
func TestSealResultWritesMsgpackBytes(t *testing.T) {
	k := &Keeper{codec: msgpackCodec{}, msgpack: true}
	check := func(t *testing.T, v any, got []byte, err error) {
		t.Helper()
		require.NoError(t, err)
		want, err := msgpack.Marshal(v)
		require.NoError(t, err)
		assert.Equal(t, seal(kindValue, want), got)
	}
	for _, n := range fastPathSizes {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			b := bytes.Repeat([]byte{'x'}, n)
			got, err := sealResult(k, b)
			check(t, b, got, err)
			got, err = sealResult(k, string(b))
			check(t, string(b), got, err)
		})
	}
	got, err := sealResult(k, []byte(nil))
	check(t, []byte(nil), got, err)
	got, err = sealResult(k, benchReceipt)
	check(t, benchReceipt, got, err)
}

// TestOpenResultReadsAsMsgpack: Do's own decoding of []byte and string
// results answers what msgpack.Unmarshal answers, nil and empty included, and
// anything it does not read itself goes to the codec.
func TestOpenResultReadsAsMsgpack(t *testing.T) {
	k := &Keeper{codec: msgpackCodec{}, msgpack: true}
	encode := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		require.NoError(t, err)
		return b
	}
	bodies := [][]byte{encode(nil), encode([]byte(nil))}
	for _, n := range fastPathSizes {
		bodies = append(bodies, encode(bytes.Repeat([]byte{'y'}, n)), encode(string(bytes.Repeat([]byte{'z'}, n))))
	}
	bodies = append(bodies,
		append(encode("trailing"), 0x01), // a value, then more: msgpack reads the value
		encode("truncated")[:5],
		encode(42),
		encode([]string{"an", "array"}),
		[]byte{},
	)
	for i, body := range bodies {
		var wantB []byte
		errB := msgpack.Unmarshal(body, &wantB)
		gotB, err := openResult[[]byte](k, bytes.Clone(body))
		assert.Equal(t, errB != nil, err != nil, "body %d as []byte: %v, msgpack: %v", i, err, errB)
		assert.Equal(t, wantB, gotB, "body %d as []byte", i)
		assert.Equal(t, wantB == nil, gotB == nil, "body %d: nil and empty apart", i)

		var wantS string
		errS := msgpack.Unmarshal(body, &wantS)
		gotS, err := openResult[string](k, body)
		assert.Equal(t, errS != nil, err != nil, "body %d as string: %v, msgpack: %v", i, err, errS)
		assert.Equal(t, wantS, gotS, "body %d as string", i)
	}
}

// TestReplayedBytesAreTheCallersOwn: a []byte result is handed over without
// a copy only when the caller owns the bytes; a replay from the replay cache
// or of a coalesced leader is copied, so that a caller who writes into its
// result changes no later replay.
func TestReplayedBytesAreTheCallersOwn(t *testing.T) {
	for _, opts := range [][]Option{nil, {WithReplayCache(16, 1<<20, time.Hour)}, {WithCoalescing(true)}} {
		redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
			k := newKeeper(t, b, opts...)
			ctx := context.Background()
			for _, key := range []string{"do", "complete"} {
				if key == "do" {
					_, err := Do(ctx, k, "s", key, func(context.Context) ([]byte, error) { return []byte("result"), nil })
					require.NoError(t, err)
				} else {
					out, err := k.Begin(ctx, "s", key)
					require.NoError(t, err)
					require.NoError(t, out.Claim.Complete(ctx, []byte("result"), 0))
				}
				for range 3 {
					v, err := Do(ctx, k, "s", key, func(context.Context) ([]byte, error) { return nil, errors.New("ran again") })
					require.NoError(t, err)
					require.Equal(t, "result", string(v))
					copy(v, "XXXXXX")
					out, err := k.Begin(ctx, "s", key)
					require.NoError(t, err)
					require.True(t, out.Replayed)
					copy(out.Value, "YYYYYY")
				}
			}
		})
	}
}

// TestDoReadsAcrossResultTypes: a []byte and a string result are one
// encoding, so either type reads what the other stored, as with msgpack.
func TestDoReadsAcrossResultTypes(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		_, err := Do(ctx, k, "s", "bytes", func(context.Context) ([]byte, error) { return []byte("as bytes"), nil })
		require.NoError(t, err)
		s, err := Do(ctx, k, "s", "bytes", func(context.Context) (string, error) { return "", errors.New("ran again") })
		require.NoError(t, err)
		assert.Equal(t, "as bytes", s)

		_, err = Do(ctx, k, "s", "string", func(context.Context) (string, error) { return "as string", nil })
		require.NoError(t, err)
		v, err := Do(ctx, k, "s", "string", func(context.Context) ([]byte, error) { return nil, errors.New("ran again") })
		require.NoError(t, err)
		assert.Equal(t, "as string", string(v))

		// Begin sees Do's result as the codec's encoding.
		out, err := k.Begin(ctx, "s", "string")
		require.NoError(t, err)
		var decoded string
		require.NoError(t, msgpack.Unmarshal(out.Value, &decoded))
		assert.Equal(t, "as string", decoded)

		// An empty result and a nil one stay apart.
		_, err = Do(ctx, k, "s", "empty", func(context.Context) ([]byte, error) { return []byte{}, nil })
		require.NoError(t, err)
		v, err = Do(ctx, k, "s", "empty", func(context.Context) ([]byte, error) { return nil, errors.New("ran again") })
		require.NoError(t, err)
		assert.NotNil(t, v)
		assert.Empty(t, v)
		_, err = Do(ctx, k, "s", "nil", func(context.Context) ([]byte, error) { return nil, nil })
		require.NoError(t, err)
		v, err = Do(ctx, k, "s", "nil", func(context.Context) ([]byte, error) { return []byte("ran again"), nil })
		require.NoError(t, err)
		assert.Nil(t, v)
	})
}

// jsonCodec is a Codec other than msgpackCodec that counts its calls.
type jsonCodec struct{ calls atomic.Int32 }

func (c *jsonCodec) Marshal(v any) ([]byte, error) {
	c.calls.Add(1)
	return json.Marshal(v)
}

func (c *jsonCodec) Unmarshal(data []byte, v any) error {
	c.calls.Add(1)
	return json.Unmarshal(data, v)
}

// TestOtherCodecEncodesEveryResult: with a Codec of the caller's, Do's own
// encoding of []byte and string results is off: the Codec encodes and
// decodes them all.
func TestOtherCodecEncodesEveryResult(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		codec := &jsonCodec{}
		k := newKeeper(t, b, WithCodec(codec), WithReplayCache(16, 1<<20, time.Hour))
		ctx := context.Background()
		for range 2 {
			v, err := Do(ctx, k, "s", "bytes", func(context.Context) ([]byte, error) { return []byte("raw"), nil })
			require.NoError(t, err)
			assert.Equal(t, "raw", string(v))
			s, err := Do(ctx, k, "s", "string", func(context.Context) (string, error) { return "text", nil })
			require.NoError(t, err)
			assert.Equal(t, "text", s)
		}
		assert.EqualValues(t, 4, codec.calls.Load(), "two encodings, two decodings")
		out, err := k.Begin(ctx, "s", "string")
		require.NoError(t, err)
		assert.JSONEq(t, `"text"`, string(out.Value))
	})
}

// TestCoalescedDoResultsAreTheCallersOwn: callers that waited in the process
// for a leader's result (WithCoalescing) share one copy of it inside idem,
// and each gets a []byte result of its own.
func TestCoalescedDoResultsAreTheCallersOwn(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithCoalescing(true))
		ctx := context.Background()
		release := make(chan struct{})
		leader := make(chan []byte, 1)
		go func() {
			v, err := Do(ctx, k, "s", "k", func(context.Context) ([]byte, error) {
				<-release
				return []byte("result"), nil
			})
			assert.NoError(t, err)
			leader <- v
		}()
		eventually(t, "the leader holds the key", func() bool { return joined(k, "s", "k") == 0 })
		got := make(chan []byte, 2)
		for range 2 {
			go func() {
				v, err := Do(ctx, k, "s", "k", func(context.Context) ([]byte, error) { return nil, errors.New("ran again") }, WithWait(time.Minute))
				assert.NoError(t, err)
				got <- v
			}()
		}
		eventually(t, "both wait", func() bool { return joined(k, "s", "k") == 2 })
		close(release)
		first, a, c := <-leader, <-got, <-got
		for _, v := range [][]byte{first, a, c} {
			assert.Equal(t, "result", string(v))
		}
		first[0], a[0] = 'X', 'Y'
		assert.Equal(t, "result", string(c), "each caller has its own result")
		v, err := Do(ctx, k, "s", "k", func(context.Context) ([]byte, error) { return nil, errors.New("ran again") })
		require.NoError(t, err)
		assert.Equal(t, "result", string(v))
	})
}
