package idem

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// BenchmarkObserver measures what an Observer costs Do, first execution and
// replay, on a store in memory: none set (it must cost nothing), and one
// that does nothing (the cost of measuring and telling it).
func BenchmarkObserver(b *testing.B) {
	ctx := context.Background()
	fn := func(ctx context.Context) ([]byte, error) { return benchResult, nil }
	for _, tc := range []struct {
		name string
		opts []Option
	}{
		{"none", nil},
		{"noop", []Option{WithObserver(ObserverFunc(func(context.Context, Event) {}))}},
	} {
		k, err := keeperOn(&memStore{m: map[string][]byte{}}, tc.opts...)
		require.NoError(b, err)
		b.Run("first/"+tc.name, func(b *testing.B) {
			b.ReportAllocs()
			keys := benchKeysFor(b.N)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := Do(ctx, k, "bench", keys[i], fn); err != nil {
					require.NoError(b, err)
				}
			}
		})
		b.Run("replay/"+tc.name, func(b *testing.B) {
			key := nextBenchKey()
			_, err := Do(ctx, k, "bench", key, fn)
			require.NoError(b, err)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := Do(ctx, k, "bench", key, fn); err != nil {
					require.NoError(b, err)
				}
			}
		})
	}
}
