package idem

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/require"
)

// BenchmarkStore runs redisStore's steps alone, one after another, on a real
// redis-server it starts (skipped without one): what the store's Go side
// allocates per step, go-redis's own allocations included, apart from the
// Keeper's.
//
//	go test -run '^$' -bench BenchmarkStore -benchmem .
func BenchmarkStore(b *testing.B) {
	c := redistest.Start(b).Client(b)
	s, err := openRedisStore(c)
	require.NoError(b, err)
	ctx := context.Background()
	require.NoError(b, s.LoadScripts(ctx))
	req := claimRequest{Fingerprint: fingerprintDigest([]byte("body")), Attempt: newAttemptID(), Lease: 30 * time.Second, Keep: time.Hour}
	payload := costPayload()

	b.Run("claim+complete", func(b *testing.B) {
		ids := benchIDs(b.N)
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			r, err := s.Claim(ctx, ids[i], req)
			if err == nil {
				_, err = s.Complete(ctx, ids[i], r.Token, payload, time.Hour)
			}
			if err != nil {
				require.NoError(b, err)
			}
		}
	})
	b.Run("replay", func(b *testing.B) {
		ids := benchIDs(64)
		for _, id := range ids {
			r, err := s.Claim(ctx, id, req)
			require.NoError(b, err)
			require.NoError(b, errOf(s.Complete(ctx, id, r.Token, payload, time.Hour)))
		}
		again := req
		again.Attempt = newAttemptID()
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			r, err := s.Claim(ctx, ids[i%len(ids)], again)
			if err == nil && len(r.Value) != len(payload) {
				err = errors.New("short replay")
			}
			if err != nil {
				require.NoError(b, err)
			}
		}
	})
}

// benchIDs returns n fresh record ids, made before the timer starts.
func benchIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = recordID("bench", nextBenchKey())
	}
	return ids
}
