package idem

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCompactCompletionKeepsItsRetention: a marker keeps the retention its
// completion asked for, as a record does. Completion.Retention (and
// Claim.Complete's retention) is "how long the result is kept". A claim of
// BeginBatch(WithCompactClaims()) completed with an empty result and a
// retention of 10s, read 700ms later by a Keeper whose retention is 200ms
// and marker retention 400ms, must still be replayed: a claim kept in a record
// (WithCompactClaims off, or the same call's claim that went to a record)
// is. The marker instead answers by the reader's retention and marker
// retention only, so past 400ms the key is free and the operation runs again.
func TestCompactCompletionKeepsItsRetention(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		// Scaled down so that a real redis-server can wait for it: a retention
		// of 200ms, a marker retention of 400ms, a completion kept 10s, read
		// 700ms later.
		k := newKeeper(t, b, WithLease(100*time.Millisecond), WithRetention(200*time.Millisecond), WithMarkerRetention(400*time.Millisecond))
		ctx := context.Background()

		for _, compact := range []bool{false, true} {
			key := map[bool]string{false: "record", true: "compact"}[compact]
			var opts []Option
			if compact {
				opts = append(opts, WithCompactClaims())
			}
			res, err := k.BeginBatch(ctx, "s", []string{key}, opts...)
			require.NoError(t, err)
			require.NoError(t, res[0].Err)
			c := res[0].Outcome.Claim
			require.NotNil(t, c)
			t.Logf("%s: ref %d", key, c.ref)
			errs := k.CompleteBatch(ctx, []Completion{{Claim: c, Value: nil, Retention: 10 * time.Second}})
			require.NoError(t, errs[0])
		}

		b.Advance(700 * time.Millisecond) // within the 10s asked for
		for _, key := range []string{"record", "compact"} {
			o, err := k.Begin(ctx, "s", key)
			if o.Claim != nil {
				_ = o.Claim.Release(ctx)
			}
			assert.NoError(t, err, "%s", key)
			assert.Nil(t, o.Claim, "%s: completed 700ms ago with a retention of 10s (marker retention 400ms), claimed again: the operation runs twice", key)
			assert.True(t, o.Replayed, "%s: not replayed", key)
		}
	})
}
