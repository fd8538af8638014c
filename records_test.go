package idem

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRecordsByID: what an operator lists with Scan, it reads, abandons
// and forgets by the id alone, as the methods by key do: a dead holder's
// claim found pending is abandoned and taken over at once; the completed
// record is forgotten by its token, and a stale token removes nothing.
func TestRecordsByID(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b, WithLease(time.Hour))
		dead, err := k.Begin(ctx, "s", "order-1")
		require.NoError(t, err)
		_, err = k.Begin(ctx, "s", "order-2")
		require.NoError(t, err)

		var pending []Record
		for r, err := range k.Scan(ctx, ScanOptions{State: StatePending}) {
			require.NoError(t, err)
			pending = append(pending, r)
		}
		require.Len(t, pending, 2)
		id := k.RecordID("s", "order-1")
		var listed Record
		for _, r := range pending {
			if r.ID == id {
				listed = r
			}
		}
		require.Equal(t, id, listed.ID, "Scan lists the claim of order-1 by its id")
		assert.Equal(t, dead.Claim.Token(), listed.Token)

		r, err := k.InspectRecord(ctx, id)
		require.NoError(t, err)
		byKey := inspectOK(t, k, "s", "order-1")
		for _, x := range []*Record{&r, &byKey} { // the times move between the two reads
			x.LeaseLeft, x.ExpiresIn, x.Age, x.ReadAt = 0, 0, 0, time.Time{}
		}
		assert.Equal(t, byKey, r, "by id, the record the key names")

		r, err = k.AbandonRecord(ctx, id, dead.Claim.Token())
		require.NoError(t, err)
		assert.Equal(t, StatePending, r.State)
		assert.LessOrEqual(t, r.LeaseLeft, time.Duration(0), "the lease is over")
		next, err := k.Begin(ctx, "s", "order-1")
		require.NoError(t, err, "the next attempt takes over at once")
		require.NotNil(t, next.Claim)
		assert.True(t, next.Claim.Recovered())
		require.NoError(t, next.Claim.Complete(ctx, []byte("done"), 0))

		r, err = k.ForgetRecord(ctx, id, dead.Claim.Token(), false)
		require.NoError(t, err)
		assert.Equal(t, StateAbsent, r.State, "a stale token removes nothing")
		assert.Equal(t, StateCompleted, inspectOK(t, k, "s", "order-1").State)
		r, err = k.ForgetRecord(ctx, id, next.Claim.Token(), false)
		require.NoError(t, err)
		assert.Equal(t, StateCompleted, r.State, "the record as it was")
		assert.Equal(t, StateAbsent, inspectOK(t, k, "s", "order-1").State)
	})
}

// TestRecordsByIDRefuseBadInput: an id no Keeper makes, or a token no
// claim gets, is refused before the store is touched.
func TestRecordsByIDRefuseBadInput(t *testing.T) {
	b := redistest.Miniredis(t)
	k := newKeeper(t, b)
	ctx := context.Background()
	var c redistest.Counter
	b.Client.AddHook(&c)
	good := k.RecordID("s", "k")
	for _, id := range []string{"", "short", good + "x", strings.Repeat("+", len(good)), "idem:{" + good[:16]} {
		_, err := k.InspectRecord(ctx, id)
		assert.ErrorIs(t, err, ErrInvalidKey, "inspect %q", id)
		_, err = k.ForgetRecord(ctx, id, 1, true)
		assert.ErrorIs(t, err, ErrInvalidKey, "forget %q", id)
		_, err = k.AbandonRecord(ctx, id, 1)
		assert.ErrorIs(t, err, ErrInvalidKey, "abandon %q", id)
	}
	for _, token := range []int64{0, -1, maxToken + 1} {
		_, err := k.ForgetRecord(ctx, good, token, true)
		assert.ErrorIs(t, err, ErrInvalidConfig, "forget, token %d", token)
		_, err = k.AbandonRecord(ctx, good, token)
		assert.ErrorIs(t, err, ErrInvalidConfig, "abandon, token %d", token)
	}
	assert.Zero(t, c.Commands(), "the store was not touched")
}

// TestKeeperChecksItsServers: LoadScripts loads every script and
// CheckEviction reads the policy of the Keeper's server: noeviction on a
// redis-server started for the test, unreadable on miniredis.
func TestKeeperChecksItsServers(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b)
		require.NoError(t, k.LoadScripts(ctx))
		for _, sc := range luaScripts {
			ok, err := sc.Exists(ctx, b.Client).Result()
			require.NoError(t, err)
			assert.Equal(t, []bool{true}, ok)
		}
		err := k.CheckEviction(ctx)
		if b.Mini != nil {
			assert.ErrorIs(t, err, ErrEvictionUnchecked)
		} else {
			assert.NoError(t, err)
		}
	})
}
