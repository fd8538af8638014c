package idemwatermill_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemwatermill"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// wrap returns h behind the middleware on k.
func wrap(t *testing.T, k *idem.Keeper, h message.HandlerFunc, opts ...idemwatermill.Option) message.HandlerFunc {
	t.Helper()
	mw, err := idemwatermill.Middleware(k, opts...)
	require.NoError(t, err)
	return mw(h)
}

// delivery returns a fresh copy of msg, as a broker hands a redelivery over.
func delivery(msg *message.Message) *message.Message {
	return msg.Copy()
}

// producing is a handler that counts its runs and produces two messages
// with new UUIDs each run, so that a second run would show.
func producing(runs *atomic.Int64) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		a := message.NewMessage(watermill.NewUUID(), []byte("shipped "+string(msg.Payload)))
		a.Metadata.Set("run", watermill.NewShortUUID())
		a.Metadata.Set("order", msg.Metadata.Get("order"))
		b := message.NewMessage(watermill.NewUUID(), nil)
		return []*message.Message{a, b}, nil
	}
}

// requireEqualMessages fails unless got are want's messages, in order:
// UUID, metadata and payload.
func requireEqualMessages(t *testing.T, want, got []*message.Message) {
	t.Helper()
	require.Len(t, got, len(want))
	for i := range want {
		assert.Truef(t, want[i].Equals(got[i]), "message %d: want %s %v %q, got %s %v %q", i,
			want[i].UUID, want[i].Metadata, want[i].Payload, got[i].UUID, got[i].Metadata, got[i].Payload)
		assert.NotNil(t, got[i].Metadata, "a replayed message's metadata can be set")
	}
}

func TestRedeliveryGetsTheFirstOutput(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var runs atomic.Int64
	h := wrap(t, k, producing(&runs))
	msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
	msg.Metadata.Set("order", "1")

	first, err := h(delivery(msg))
	require.NoError(t, err)
	require.Len(t, first, 2)
	for range 3 {
		again, err := h(delivery(msg))
		require.NoError(t, err)
		requireEqualMessages(t, first, again)
	}
	assert.Equal(t, int64(1), runs.Load(), "the handler ran once")

	other := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
	_, err = h(other)
	require.NoError(t, err)
	assert.Equal(t, int64(2), runs.Load(), "another UUID is another key")
}

func TestNoOutputIsReplayedAsNone(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var runs atomic.Int64
	h := wrap(t, k, func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, nil
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
	for range 2 {
		out, err := h(delivery(msg))
		require.NoError(t, err)
		assert.Empty(t, out)
	}
	assert.Equal(t, int64(1), runs.Load())
}

func TestHandlerErrorReleasesTheKey(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var runs atomic.Int64
	failure := errors.New("downstream timed out")
	inner := producing(&runs)
	h := wrap(t, k, func(msg *message.Message) ([]*message.Message, error) {
		if runs.Load() == 0 {
			runs.Add(1)
			return nil, failure
		}
		return inner(msg)
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))

	_, err := h(delivery(msg))
	require.ErrorIs(t, err, failure, "the handler's error, as is")
	assert.False(t, idemwatermill.IsPermanent(err))

	first, err := h(delivery(msg))
	require.NoError(t, err, "the redelivery runs the handler again")
	require.Len(t, first, 2)
	again, err := h(delivery(msg))
	require.NoError(t, err)
	requireEqualMessages(t, first, again)
	assert.Equal(t, int64(2), runs.Load())
}

func TestPanicReleasesTheKey(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var runs atomic.Int64
	h := wrap(t, k, func(msg *message.Message) ([]*message.Message, error) {
		if runs.Add(1) == 1 {
			panic("boom")
		}
		return nil, nil
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
	require.PanicsWithValue(t, "boom", func() { _, _ = h(delivery(msg)) })
	_, err := h(delivery(msg))
	require.NoError(t, err)
	assert.Equal(t, int64(2), runs.Load())
}

func TestFinalErrorIsKeptAndPermanent(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var runs atomic.Int64
	h := wrap(t, k, func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, idem.FinalCode(errors.New("no such customer"), "unknown_customer", nil)
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
	for range 2 {
		_, err := h(delivery(msg))
		var final *idem.FinalError
		require.ErrorAs(t, err, &final)
		assert.Equal(t, "unknown_customer", final.Code)
		assert.True(t, idemwatermill.IsPermanent(err))
	}
	assert.Equal(t, int64(1), runs.Load())
}

func TestHandlerSeesTheClaim(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var token int64
	h := wrap(t, k, func(msg *message.Message) ([]*message.Message, error) {
		c, ok := idem.ClaimFromContext(msg.Context())
		require.True(t, ok)
		token = c.Token()
		return nil, nil
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
	ctx := context.WithValue(context.Background(), struct{}{}, "outer")
	msg.SetContext(ctx)
	_, err := h(msg)
	require.NoError(t, err)
	assert.NotZero(t, token)
	assert.Equal(t, ctx, msg.Context(), "the message's own context is given back")
}

func TestInProgress(t *testing.T) {
	k, _ := newMiniKeeper(t)
	started, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int64
	inner := producing(&runs)
	h := wrap(t, k, func(msg *message.Message) ([]*message.Message, error) {
		close(started)
		<-release
		return inner(msg)
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
	type result struct {
		out []*message.Message
		err error
	}
	done := make(chan result)
	go func() {
		out, err := h(delivery(msg))
		done <- result{out, err}
	}()
	<-started
	_, err := h(delivery(msg))
	require.ErrorIs(t, err, idem.ErrInProgress, "nacked: it comes again")
	assert.False(t, idemwatermill.IsPermanent(err))

	waiting := wrap(t, k, inner, idemwatermill.WithCallOptions(idem.WithWait(10*time.Second)))
	waited := make(chan result)
	go func() {
		out, err := waiting(delivery(msg))
		waited <- result{out, err}
	}()
	close(release)
	first := <-done
	require.NoError(t, first.err)
	second := <-waited
	require.NoError(t, second.err, "with WithWait the delivery waits for the first output")
	requireEqualMessages(t, first.out, second.out)
	assert.Equal(t, int64(1), runs.Load())
}

func TestKeys(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var runs atomic.Int64
	h := producing(&runs)

	t.Run("no UUID", func(t *testing.T) {
		_, err := wrap(t, k, h)(message.NewMessage("", []byte("x")))
		require.ErrorIs(t, err, idem.ErrInvalidKey)
		assert.True(t, idemwatermill.IsPermanent(err))
	})
	t.Run("metadata", func(t *testing.T) {
		byEvent := wrap(t, k, h, idemwatermill.WithMetadataKey("event_id"))
		_, err := byEvent(message.NewMessage(watermill.NewUUID(), []byte("x")))
		require.ErrorIs(t, err, idem.ErrInvalidKey, "no entry: refused")
		before := runs.Load()
		for range 2 {
			// A producer that rebuilt the message: a new UUID, the same event.
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			msg.Metadata.Set("event_id", "evt-1")
			_, err := byEvent(msg)
			require.NoError(t, err)
		}
		assert.Equal(t, before+1, runs.Load())
	})
	t.Run("key function", func(t *testing.T) {
		refused := errors.New("not ours")
		f := wrap(t, k, h, idemwatermill.WithKeyFunc(func(*message.Message) (string, error) { return "", refused }))
		_, err := f(message.NewMessage(watermill.NewUUID(), []byte("x")))
		require.ErrorIs(t, err, refused)
		require.ErrorIs(t, err, idem.ErrInvalidKey)
	})
	t.Run("too long", func(t *testing.T) {
		long := string(make([]byte, idem.MaxKeyLen+1))
		_, err := wrap(t, k, h)(message.NewMessage(long, []byte("x")))
		require.ErrorIs(t, err, idem.ErrInvalidKey)
	})
}

func TestFingerprint(t *testing.T) {
	k, _ := newMiniKeeper(t)
	var runs atomic.Int64
	uuid := watermill.NewUUID()

	h := wrap(t, k, producing(&runs))
	_, err := h(message.NewMessage(uuid, []byte("order 1")))
	require.NoError(t, err)
	_, err = h(message.NewMessage(uuid, []byte("order 2")))
	require.ErrorIs(t, err, idem.ErrMismatch, "the same UUID on another payload")
	assert.True(t, idemwatermill.IsPermanent(err))

	loose := wrap(t, k, producing(&runs), idemwatermill.WithFingerprint(nil), idemwatermill.WithScope("loose"))
	_, err = loose(message.NewMessage(uuid, []byte("order 1")))
	require.NoError(t, err)
	_, err = loose(message.NewMessage(uuid, []byte("order 2")))
	require.NoError(t, err, "without a fingerprint every payload is answered the same")
	assert.Equal(t, int64(2), runs.Load())
}

func TestMisuseIsRefused(t *testing.T) {
	k, _ := newMiniKeeper(t)
	_, err := idemwatermill.Middleware(nil)
	require.ErrorIs(t, err, idem.ErrInvalidConfig)
	_, err = idemwatermill.Middleware(k, idemwatermill.WithMetadataKey(""))
	require.ErrorIs(t, err, idem.ErrInvalidConfig)
	_, err = idemwatermill.Middleware(k, nil)
	require.NoError(t, err, "a nil option is ignored")

	h := wrap(t, k, producing(new(atomic.Int64)), idemwatermill.WithCallOptions(idem.WithLease(time.Second)))
	_, err = h(message.NewMessage(watermill.NewUUID(), []byte("x")))
	require.ErrorIs(t, err, idem.ErrInvalidConfig, "a Keeper's option given to a call")
}

func TestStoreDownAfterTheHandlerStillPublishes(t *testing.T) {
	k, m := newMiniKeeper(t)
	var runs atomic.Int64
	inner := producing(&runs)
	h := wrap(t, k, func(msg *message.Message) ([]*message.Message, error) {
		out, err := inner(msg)
		m.Close() // Redis goes away after the side effect.
		return out, err
	})
	out, err := h(message.NewMessage(watermill.NewUUID(), []byte("x")))
	require.NoError(t, err, "the side effect happened: its output is published, the message acknowledged")
	assert.Len(t, out, 2)

	_, err = h(message.NewMessage(watermill.NewUUID(), []byte("y")))
	require.ErrorIs(t, err, idem.ErrUnavailable, "with Redis down nothing runs")
	assert.Equal(t, int64(1), runs.Load())
}
