package idem

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var errDeclined = errors.New("card declined")

// declined is a final error with a code and details, as an operation returns
// it.
func declined() error {
	return FinalCode(errDeclined, "card_declined", map[string]string{"decline_code": "insufficient_funds", "charge": "ch_1"})
}

// requireFinal asserts that err is a *FinalError with declined's message,
// code and details, replayed or not.
func requireFinal(t *testing.T, err error, replayed bool) *FinalError {
	t.Helper()
	var final *FinalError
	require.ErrorAs(t, err, &final)
	assert.Equal(t, "card declined", err.Error())
	assert.Equal(t, "card_declined", final.Code)
	assert.Equal(t, map[string]string{"decline_code": "insufficient_funds", "charge": "ch_1"}, final.Details)
	assert.Equal(t, replayed, final.Replayed)
	return final
}

func TestFinalCodeReplaysCodeAndDetails(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		var runs atomic.Int32
		charge := func(context.Context) (string, error) {
			runs.Add(1)
			return "", declined()
		}

		_, err := Do(ctx, k, "s", "pay-1", charge)
		first := requireFinal(t, err, false)
		assert.ErrorIs(t, err, errDeclined, "the first call gets the operation's own error")

		_, err = Do(ctx, k, "s", "pay-1", charge)
		replayed := requireFinal(t, err, true)
		assert.NotErrorIs(t, err, errDeclined, "a replay cannot bring the error's identity back: match on Code")
		assert.Equal(t, int32(1), runs.Load(), "a final error is the operation's answer: it runs once")

		replayed.Details["charge"] = "changed"
		_, err = Do(ctx, k, "s", "pay-1", charge)
		requireFinal(t, err, true) // each replay has details of its own
		assert.Equal(t, "ch_1", first.Details["charge"])

		out, err := k.Begin(ctx, "s", "pay-1")
		require.NoError(t, err)
		require.True(t, out.Replayed)
		requireFinal(t, out.Err, true)
	})
}

func TestFinalWithoutCodeIsStoredAsBefore(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	_, err := Do(ctx, k, "s", "k", func(context.Context) (int, error) { return 0, Final(errDeclined) })
	require.Error(t, err)
	raw, err := b.Client.Get(ctx, DefaultPrefix+"{"+recordID("s", "k")+"}").Result()
	require.NoError(t, err)
	assert.Regexp(t, "\x01ecard declined$", raw, "a final error without a code keeps the first format's kind 'e'")

	_, err = Do(ctx, k, "s", "k", func(context.Context) (int, error) { return 0, nil })
	var final *FinalError
	require.ErrorAs(t, err, &final)
	assert.Empty(t, final.Code)
	assert.Nil(t, final.Details)
	assert.True(t, final.Replayed)
}

// A caller coalesced behind the leader in the process gets the leader's final
// error, code and details, as a caller that asked Redis would.
func TestFinalCodeReachesCoalescedFollowers(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b, WithCoalescing(true))
		ctx := context.Background()
		started, gate := make(chan struct{}), make(chan struct{})
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := Do(ctx, k, "s", "k", func(context.Context) (int, error) {
				close(started)
				<-gate
				return 0, declined()
			})
			assert.Error(t, err)
		}()
		<-started
		viaDo, viaBegin := make(chan error, 1), make(chan Outcome, 1)
		go func() {
			_, err := Do(ctx, k, "s", "k", func(context.Context) (int, error) { return 7, nil }, WithWait(time.Minute))
			viaDo <- err
		}()
		go func() {
			out, err := k.Begin(ctx, "s", "k", WithWait(time.Minute))
			assert.NoError(t, err)
			viaBegin <- out
		}()
		eventually(t, "both followers joined the leader's flight", func() bool { return waiting(k) == 2 })
		close(gate)
		requireFinal(t, <-viaDo, true)
		out := <-viaBegin
		assert.True(t, out.Replayed)
		requireFinal(t, out.Err, true)
		wg.Wait()

		out, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		requireFinal(t, out.Err, true)
	})
}

func TestFinalCodeUnreadableRecordIsCorrupt(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	for name, body := range map[string]string{
		"not msgpack":    "\xc1",
		"too few fields": "\x92\xa1m\xa1c",
		"code not a str": "\x93\xa1m\x01\x80",
		"truncated map":  "\x93\xa1m\xa1c\x81\xa1k",
	} {
		t.Run(name, func(t *testing.T) {
			rk := DefaultPrefix + "{" + recordID("s", name) + "}"
			require.NoError(t, b.Client.Set(ctx, rk, "i1C1700000000000000:1:0:0:::\x01E"+body, time.Hour).Err())
			_, err := Do(ctx, k, "s", name, func(context.Context) (int, error) { return 1, nil })
			assert.ErrorIs(t, err, ErrCorrupt)
			_, err = k.Begin(ctx, "s", name)
			assert.ErrorIs(t, err, ErrCorrupt)
			got, err := b.Client.Get(ctx, rk).Result()
			require.NoError(t, err)
			assert.Contains(t, got, "\x01E"+body, "nothing is overwritten")
		})
	}
}

func TestFinalCodeOfNilIsNil(t *testing.T) {
	assert.NoError(t, FinalCode(nil, "code", nil))
	assert.NoError(t, Final(nil))
}

func TestFinalCodeCopiesDetails(t *testing.T) {
	details := map[string]string{"a": "1"}
	err := FinalCode(errDeclined, "c", details)
	details["a"] = "2"
	var final *FinalError
	require.ErrorAs(t, err, &final)
	assert.Equal(t, "1", final.Details["a"])
}

func TestFinalErrorWithoutErr(t *testing.T) {
	e := &FinalError{Code: "card_declined"}
	assert.Equal(t, `idem: final error "card_declined"`, e.Error())
	kind, body := sealFinal(e)
	got, err := openFinal(kind, body)
	require.NoError(t, err)
	assert.Equal(t, "card_declined", got.Code)
	assert.Equal(t, e.Error(), got.Error())
}

// One error always seals to the same bytes, whatever the map's order.
func TestSealFinalIsDeterministic(t *testing.T) {
	details := map[string]string{}
	for _, k := range []string{"z", "a", "m", "b", "y", "c"} {
		details[k] = k + k
	}
	_, want := sealFinal(&FinalError{Err: errDeclined, Code: "c", Details: details})
	for range 20 {
		_, got := sealFinal(&FinalError{Err: errDeclined, Code: "c", Details: details})
		require.Equal(t, want, got)
	}
}

// sealFinal writes what format_test.go's golden kind 'E' record holds.
func TestSealFinalWritesTheGoldenRecord(t *testing.T) {
	kind, body := sealFinal(&FinalError{Err: errDeclined, Code: "card_declined", Details: map[string]string{"decline_code": "insufficient_funds"}})
	assert.Equal(t, kindFinal, kind)
	assert.Equal(t, codedFinalV1, string(body))
}
