package idem

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMarkerScaleChangesNothingAReaderRelies: the index sizes itself, and
// WithMarkerScale is ignored, so stores that were given different scales
// read one index. Before, with a declared scale: "every store on a prefix must
// use the same [scale], each index key records it, and a store of another
// scale is refused with ErrInvalidConfig before it writes anything"
// (docs/consumers.md). On one server, a scale above 2^25 spreads the index
// over several keys (i:0, i:1, ...). A deployment that raises the scale
// from the default to 2^26 finds the old layout only in i:0; its calls whose
// entries fall in i:1, which does not exist yet, are not refused: they
// write i:1 with the new layout and claim afresh messages that the old
// store handled (their markers are in i:0), so their handlers run again.
func TestMarkerScaleChangesNothingAReaderRelies(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		old := newKeeper(t, b) // DefaultMarkerScale: one index key, i:0
		msgs := make([]string, 200)
		for i := range msgs {
			msgs[i] = fmt.Sprint("m", i)
		}
		id := func(m string) string { return m }
		res, err := Consume(ctx, old, "s", msgs, id, func(context.Context, string) error { return nil })
		require.NoError(t, err)
		for i, r := range res {
			require.Equal(t, MessageHandled, r.Status, msgs[i])
		}

		bigger := newKeeper(t, b, WithMarkerScale(1<<26)) // two index keys, i:0 and i:1
		ran, refused := 0, 0
		res, err = Consume(ctx, bigger, "s", msgs, id, func(context.Context, string) error { ran++; return nil })
		require.NoError(t, err)
		for _, r := range res {
			if errors.Is(r.Err, ErrInvalidConfig) {
				refused++
			}
		}
		t.Logf("redelivered to a store of another scale: %d refused (ErrInvalidConfig), %d handlers ran again", refused, ran)
		assert.Zero(t, ran, "messages handled before ran again under a store of another scale")
		n, _ := b.Client.Exists(ctx, "idem:i:1").Result()
		assert.Zero(t, n, "the store of another scale wrote an index key")
	})
}
