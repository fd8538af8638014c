package idem

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// inspectOK inspects (scope, key) and fails the test on an error.
func inspectOK(t *testing.T, k *Keeper, scope, key string) Record {
	t.Helper()
	r, err := k.Inspect(context.Background(), scope, key)
	require.NoError(t, err)
	return r
}

func TestInspectEveryState(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		const lease = time.Hour
		k := newKeeper(t, b, WithLease(lease), WithRetention(2*time.Hour), WithErrorRetention(90*time.Minute))
		ctx := context.Background()
		id := recordID("s", "absent")
		assert.Equal(t, Record{ID: id, Key: "idem:{" + id + "}"}, inspectOK(t, k, "s", "absent"), "no record")

		out, err := k.Begin(ctx, "s", "pending", WithFingerprint([]byte("body")))
		require.NoError(t, err)
		r := inspectOK(t, k, "s", "pending")
		assert.Equal(t, StatePending, r.State)
		assert.Equal(t, out.Claim.Token(), r.Token)
		assert.Equal(t, 1, r.Attempt)
		assert.False(t, r.Recovered)
		assert.True(t, r.Fingerprint)
		assert.Positive(t, r.LeaseLeft)
		assert.LessOrEqual(t, r.LeaseLeft, lease)
		assert.Greater(t, r.ExpiresIn, lease, "a pending record is kept for the retention after its lease")
		assert.GreaterOrEqual(t, r.Age, time.Duration(0))
		assert.Equal(t, StoredNone, r.Stored)
		assert.Zero(t, r.Size)

		out, err = k.Begin(ctx, "s", "bytes")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Complete(ctx, []byte("shipped"), 0))
		r = inspectOK(t, k, "s", "bytes")
		assert.Equal(t, StateCompleted, r.State)
		assert.Equal(t, out.Claim.Token(), r.Token)
		assert.False(t, r.Fingerprint)
		assert.Zero(t, r.LeaseLeft, "only a pending record has a lease")
		assert.Equal(t, StoredBytes, r.Stored)
		assert.Equal(t, len("shipped"), r.Size)
		assert.Positive(t, r.ExpiresIn)
		assert.LessOrEqual(t, r.ExpiresIn, 2*time.Hour)

		_, err = Do(ctx, k, "s", "value", func(context.Context) (receipt, error) { return receipt{ID: "ch_1", Amount: 42}, nil })
		require.NoError(t, err)
		encoded, err := msgpackCodec{}.Marshal(receipt{ID: "ch_1", Amount: 42})
		require.NoError(t, err)
		r = inspectOK(t, k, "s", "value")
		assert.Equal(t, StoredValue, r.Stored)
		assert.Equal(t, len(encoded), r.Size)

		_, err = Do(ctx, k, "s", "final", func(context.Context) (int, error) { return 0, Final(errors.New("card declined")) })
		require.Error(t, err)
		r = inspectOK(t, k, "s", "final")
		assert.Equal(t, StateCompleted, r.State)
		assert.Equal(t, StoredError, r.Stored)
		assert.Equal(t, len("card declined"), r.Size)
		assert.LessOrEqual(t, r.ExpiresIn, 90*time.Minute, "kept for the error retention")

		out, err = k.Begin(ctx, "s", "released")
		require.NoError(t, err)
		require.NoError(t, out.Claim.Release(ctx))
		r = inspectOK(t, k, "s", "released")
		assert.Equal(t, StateReleased, r.State)
		assert.Equal(t, out.Claim.Token(), r.Token)
		assert.Equal(t, 1, r.Attempt)
		assert.Equal(t, StoredNone, r.Stored)
	})
}

func TestInspectAbandonedAndRecovered(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		const lease = 50 * time.Millisecond
		k := newKeeper(t, b, WithLease(lease), WithRetention(time.Hour))
		ctx := context.Background()
		first, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		b.Advance(lease + 10*time.Millisecond)
		r := inspectOK(t, k, "s", "k")
		assert.Equal(t, StatePending, r.State)
		assert.LessOrEqual(t, r.LeaseLeft, -10*time.Millisecond, "the lease ran out that long ago at least")
		assert.GreaterOrEqual(t, r.Age, lease+10*time.Millisecond)
		if !b.Real {
			// miniredis's clock moves only with Advance: the age is exact.
			assert.Equal(t, lease+10*time.Millisecond, r.Age)
			assert.Equal(t, -10*time.Millisecond, r.LeaseLeft)
		}

		second, err := k.Begin(ctx, "s", "k")
		require.NoError(t, err)
		r = inspectOK(t, k, "s", "k")
		assert.True(t, r.Recovered)
		assert.Equal(t, 2, r.Attempt)
		assert.Equal(t, second.Claim.Token(), r.Token)
		assert.Greater(t, r.Token, first.Claim.Token())
	})
}

func TestInspectIsOneRoundTripAndChangesNothing(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var n redistest.Counter
		b.Client.AddHook(&n)
		k := newKeeper(t, b)
		ctx := context.Background()
		_, err := Do(ctx, k, "s", "k", func(context.Context) (string, error) { return "v", nil })
		require.NoError(t, err)
		store := k.store.(*redisStore)
		require.NoError(t, store.LoadScripts(ctx), "so that no call falls back to EVAL")
		rk := store.RecordKey("s", "k")
		before, err := b.Client.Get(ctx, rk).Result()
		require.NoError(t, err)
		for _, key := range []string{"k", "absent"} {
			assert.EqualValues(t, 1, n.Count(func() { inspectOK(t, k, "s", key) }), "round trips of Inspect(%q)", key)
		}
		after, err := b.Client.Get(ctx, rk).Result()
		require.NoError(t, err)
		assert.Equal(t, before, after)
	})
}

// TestInspectOddRecords covers values that are not records (ErrCorrupt) and
// records a later version may write: trailing bytes after the header of a
// pending record (checkpoints) and envelope kinds this version does not know
// are reported, not refused.
func TestInspectOddRecords(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		k := newKeeper(t, b)
		ctx := context.Background()
		rows := []struct {
			name, value string
			check       func(t *testing.T, r Record, err error)
		}{
			{"not a record", "hello", corruptRecord},
			{"token too long", "i1C12345678901234567:1:0:0:::\x01bx", corruptRecord},
			{"attempt zero", "i1C1700000000000000:0:0:0:::\x01bx", corruptRecord},
			{"completed, no envelope", "i1C1700000000000000:1:0:0:::", corruptRecord},
			{"completed, envelope format 2", "i1C1700000000000000:1:0:0:::\x02bx", corruptRecord},
			{"completed, unknown kind", "i1C1700000000000000:1:0:0:::\x01Zabc", func(t *testing.T, r Record, err error) {
				require.NoError(t, err)
				assert.Equal(t, StoredKind('Z'), r.Stored)
				assert.Equal(t, `unknown ('Z')`, r.Stored.String())
				assert.Equal(t, 3, r.Size)
			}},
			{"completed, empty result", "i1C1700000000000000:1:0:0:::\x01b", func(t *testing.T, r Record, err error) {
				require.NoError(t, err)
				assert.Equal(t, StoredBytes, r.Stored)
				assert.Zero(t, r.Size)
			}},
			{"pending with trailing bytes", "i1P1700000000000000:2:1:4102444800000000:AAAAAAAAAAA:fp:\x00checkpoint", func(t *testing.T, r Record, err error) {
				require.NoError(t, err)
				assert.Equal(t, StatePending, r.State)
				assert.Equal(t, 2, r.Attempt)
				assert.True(t, r.Recovered)
				assert.True(t, r.Fingerprint)
				assert.Positive(t, r.LeaseLeft)
				assert.Equal(t, StoredNone, r.Stored)
				assert.Zero(t, r.Size)
				assert.Nil(t, r.Checkpoints, "what is not checkpoints is not read as them")
			}},
		}
		for _, row := range rows {
			t.Run(row.name, func(t *testing.T) {
				rk := k.store.(*redisStore).RecordKey("s", row.name)
				require.NoError(t, b.Client.Set(ctx, rk, row.value, time.Hour).Err())
				r, err := k.Inspect(ctx, "s", row.name)
				assert.Equal(t, rk, r.Key)
				assert.Equal(t, recordID("s", row.name), r.ID)
				row.check(t, r, err)
			})
		}
		t.Run("wrong type", func(t *testing.T) {
			rk := k.store.(*redisStore).RecordKey("s", "hash")
			require.NoError(t, b.Client.HSet(ctx, rk, "f", "v").Err())
			r, err := k.Inspect(ctx, "s", "hash")
			corruptRecord(t, r, err)
		})
	})
}

func corruptRecord(t *testing.T, r Record, err error) {
	require.ErrorIs(t, err, ErrCorrupt)
	assert.NotEmpty(t, r.Key)
	assert.NotErrorIs(t, err, ErrUnavailable)
}

// TestInspectFormatV1 reads the records the first format writes.
func TestInspectFormatV1(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	want := map[string]Record{
		"completed bytes":             {State: StateCompleted, Token: 1700000000000000, Attempt: 1, Stored: StoredBytes, Size: len("shipped")},
		"completed value of Do":       {State: StateCompleted, Token: 1700000000000000, Attempt: 2, Recovered: true, Stored: StoredValue, Size: 1},
		"completed final error of Do": {State: StateCompleted, Token: 1700000000000000, Attempt: 1, Stored: StoredError, Size: len("card declined")},
		"completed with a fingerprint": {State: StateCompleted, Token: 1700000000000000, Attempt: 1, Fingerprint: true,
			Stored: StoredBytes, Size: len("ok")},
		"pending, lease alive":   {State: StatePending, Token: 1700000000000000, Attempt: 1},
		"pending, lease run out": {State: StatePending, Token: 1700000000000000, Attempt: 1},
		"released":               {State: StateReleased, Token: 1700000000000000, Attempt: 3},
	}
	for _, row := range formatV1 {
		rk := k.store.(*redisStore).RecordKey("s", row.name)
		require.NoError(t, b.Client.Set(ctx, rk, row.record, time.Hour).Err())
		r, err := k.Inspect(ctx, "s", row.name)
		require.NoError(t, err, row.name)
		w, ok := want[row.name]
		if !ok {
			continue // a row added since: read without an error is enough here
		}
		w.ID, w.Key, w.ExpiresIn, w.Age, w.LeaseLeft, w.ReadAt = r.ID, rk, r.ExpiresIn, r.Age, r.LeaseLeft, r.ReadAt
		assert.Equal(t, w, r, row.name)
		assert.Equal(t, row.name == "pending, lease alive", r.LeaseLeft > 0, row.name)
	}
}

func TestInspectRefusesBeforeTheStore(t *testing.T) {
	b := redistest.Miniredis(t)
	var n redistest.Counter
	b.Client.AddHook(&n)
	k := newKeeper(t, b)
	ctx := context.Background()
	assert.Zero(t, n.Count(func() {
		_, err := k.Inspect(ctx, "s", "")
		assert.ErrorIs(t, err, ErrInvalidKey)
		_, err = k.store.(*redisStore).Inspect(ctx, "not an id")
		assert.ErrorIs(t, err, ErrInvalidKey)
	}))
}

func TestInspectUnavailableAndCanceled(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := k.Inspect(canceled, "s", "k")
	assert.ErrorIs(t, err, context.Canceled)
	assert.NotErrorIs(t, err, ErrUnavailable)

	b.Stop()
	_, err = k.Inspect(context.Background(), "s", "k")
	assert.ErrorIs(t, err, ErrUnavailable)
	_, err = k.Forget(context.Background(), "s", "k", true)
	assert.ErrorIs(t, err, ErrUnavailable)
}

// BenchmarkInspect reads one completed record on a real redis-server.
func BenchmarkInspect(b *testing.B) {
	be := redistest.Real(b)
	k := newKeeper(b, be)
	ctx := context.Background()
	_, err := Do(ctx, k, "s", "k", func(context.Context) (string, error) { return "v", nil })
	require.NoError(b, err)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := k.Inspect(ctx, "s", "k"); err != nil {
			b.Fatal(err)
		}
	}
}

// FuzzParseHeader: any header is read or refused with ErrCorrupt, never a
// panic.
//
// Fuzz it with -fuzztime as a count (-fuzztime 50000x): without a bound
// it never ends.
func FuzzParseHeader(f *testing.F) {
	for _, row := range formatV1 {
		f.Add(row.record)
	}
	f.Add("i1P1:1:0:0:a:b:")
	f.Fuzz(func(t *testing.T, head string) {
		r, err := parseHeader(Record{}, head, 1700000000000000)
		if err != nil {
			require.ErrorIs(t, err, ErrCorrupt)
			return
		}
		assert.NotEqual(t, StateAbsent, r.State)
		assert.Positive(t, r.Token)
		assert.Positive(t, r.Attempt)
	})
}
