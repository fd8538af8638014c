package idem

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestConstructorsRefuseMisuse(t *testing.T) {
	b := redistest.Miniredis(t)
	s, err := openRedisStore(b.Client)
	require.NoError(t, err)
	cases := map[string]func() error{
		"nil client":   func() error { _, err := openRedisStore(nil); return err },
		"brace prefix": func() error { _, err := openRedisStore(b.Client, WithPrefix("a{b")); return err },
		"nil store":    func() error { _, err := keeperOn(nil); return err },
		"zero lease":   func() error { _, err := keeperOn(s, WithLease(0)); return err },
		"neg lease":    func() error { _, err := keeperOn(s, WithLease(-time.Second)); return err },
		"short retention": func() error {
			_, err := keeperOn(s, WithLease(time.Minute), WithRetention(time.Second))
			return err
		},
		"neg error retention": func() error { _, err := keeperOn(s, WithErrorRetention(-1)); return err },
		"nil codec":           func() error { _, err := keeperOn(s, WithCodec(nil)); return err },
	}
	for name, f := range cases {
		assert.ErrorIs(t, f(), ErrInvalidConfig, name)
	}
	k, err := keeperOn(s)
	require.NoError(t, err)
	assert.Equal(t, DefaultLease, k.policy.lease)
	assert.Equal(t, DefaultRetention, k.policy.retention)
	assert.Equal(t, DefaultRetention, k.policy.errorRetention)
}

// TestBadOptions: settings and clients that cannot work, refused by the
// constructors with ErrInvalidConfig and the answer each gets.
func TestBadOptions(t *testing.T) {
	m := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer c.Close()
	slow := redis.NewClient(&redis.Options{Addr: m.Addr(), ReadTimeout: 2 * time.Second})
	defer slow.Close()
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": m.Addr()}})
	defer ring.Close()
	store, err := openRedisStore(c)
	require.NoError(t, err)
	table := []struct {
		name   string
		try    func() error
		answer string
	}{
		{"nil store", func() error { _, err := keeperOn(nil); return err }, "nil store"},
		{"zero lease", func() error { _, err := keeperOn(store, WithLease(0)); return err }, "lease 0s is shorter than 1ms"},
		{"negative lease", func() error { _, err := keeperOn(store, WithLease(-time.Second)); return err }, "lease -1s is shorter than 1ms"},
		{"lease under 1ms", func() error { _, err := keeperOn(store, WithLease(time.Microsecond)); return err }, "lease 1µs is shorter than 1ms"},
		{"retention shorter than lease", func() error { _, err := keeperOn(store, WithRetention(time.Second)); return err }, "retention 1s is shorter than the lease 30s"},
		{"negative error retention", func() error { _, err := keeperOn(store, WithErrorRetention(-time.Second)); return err }, "error retention -1s is shorter than 1ms"},
		{"nil codec", func() error { _, err := keeperOn(store, WithCodec(nil)); return err }, "nil codec"},
		{"nil client", func() error { _, err := openRedisStore(nil); return err }, "nil redis client"},
		{"nil client (NewRedis)", func() error { _, err := NewRedis(nil); return err }, "nil redis client"},
		{"prefix with {", func() error { _, err := openRedisStore(c, WithPrefix("app{")); return err }, "prefix \"app{\" holds '{' or '}', which would break the hash tag"},
		{"prefix with }", func() error { _, err := openRedisStore(c, WithPrefix("}")); return err }, "prefix \"}\" holds '{' or '}', which would break the hash tag"},
		{"no replicas", func() error { _, err := openRedisStore(c, WithReplicas(0, time.Second)); return err }, "WithReplicas: 0 replicas, want at least 1"},
		{"zero WAIT timeout", func() error { _, err := openRedisStore(c, WithReplicas(1, 0)); return err }, "WithReplicas: timeout 0s is shorter than 1ms"},
		{"WAIT timeout past the read timeout", func() error { _, err := openRedisStore(slow, WithReplicas(1, 2*time.Second)); return err },
			"WithReplicas: timeout 2s is not shorter than the client's ReadTimeout 2s"},
		{"WithReplicas on a Ring", func() error { _, err := openRedisStore(ring, WithReplicas(1, time.Second)); return err },
			"WithReplicas needs a *redis.Client, *redis.Conn or *redis.ClusterClient, so that WAIT runs on the connection that wrote; got *redis.Ring"},

		{"attempt id not base64url", func() error {
			_, err := store.Claim(context.Background(), "id", claimRequest{Attempt: "a b", Lease: time.Second, Keep: time.Second})
			return err
		}, "fingerprint and attempt must be base64url"},
		{"empty attempt id", func() error {
			_, err := store.Claim(context.Background(), "id", claimRequest{Lease: time.Second, Keep: time.Second})
			return err
		}, "fingerprint and attempt must be base64url"},
	}
	for _, row := range table {
		err := row.try()
		if !assert.ErrorIs(t, err, ErrInvalidConfig, row.name) {
			continue
		}
		if row.answer != "" {
			assert.EqualError(t, err, "idem: invalid configuration: "+row.answer, row.name)
		}
	}
	assert.Zero(t, c.DBSize(context.Background()).Val(), "keys Redis holds after refused settings")
}
