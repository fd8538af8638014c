package idem

import (
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestConstructorsRefuseMisuse(t *testing.T) {
	b := redistest.Miniredis(t)
	s, err := NewRedisStore(b.Client)
	require.NoError(t, err)
	cases := map[string]func() error{
		"nil client":   func() error { _, err := NewRedisStore(nil); return err },
		"brace prefix": func() error { _, err := NewRedisStore(b.Client, WithPrefix("a{b")); return err },
		"nil store":    func() error { _, err := New(nil); return err },
		"zero lease":   func() error { _, err := New(s, WithLease(0)); return err },
		"neg lease":    func() error { _, err := New(s, WithLease(-time.Second)); return err },
		"short retention": func() error {
			_, err := New(s, WithLease(time.Minute), WithRetention(time.Second))
			return err
		},
		"neg error retention": func() error { _, err := New(s, WithErrorRetention(-1)); return err },
		"nil codec":           func() error { _, err := New(s, WithCodec(nil)); return err },
	}
	for name, f := range cases {
		assert.ErrorIs(t, f(), ErrInvalidConfig, name)
	}
	k, err := New(s)
	require.NoError(t, err)
	assert.Equal(t, DefaultLease, k.Lease())
	assert.Equal(t, DefaultRetention, k.Retention())
	assert.Equal(t, DefaultRetention, k.ErrorRetention())
}
