package idem

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestInvalidKeys(t *testing.T) {
	for _, key := range []string{"", strings.Repeat("k", MaxKeyLen+1), "a\nb", "tab\there", "nul\x00", "del\x7f"} {
		require.ErrorIs(t, ValidateKey(key), ErrInvalidKey, "%q", key)
	}
	for _, key := range []string{"k", strings.Repeat("k", MaxKeyLen), "order-42/ünïcode ok", "a b"} {
		require.NoError(t, ValidateKey(key), "%q", key)
	}
}

// TestBadKeys: keys refused before Redis is touched, with the answer each
// gets.
func TestBadKeys(t *testing.T) {
	table := []struct {
		key    string
		answer string // what the error says, after "idem: invalid key: "
	}{
		{"", "empty"},
		{strings.Repeat("k", MaxKeyLen+1), "256 bytes, longer than 255"},
		{strings.Repeat("ü", 128), "256 bytes, longer than 255"},
		{"nul\x00", "control character 0x00 at byte 3"},
		{"line\nbreak", "control character 0x0a at byte 4"},
		{"\ttab", "control character 0x09 at byte 0"},
		{"del\x7f", "control character 0x7f at byte 3"},
		{"\x1b[31mred", "control character 0x1b at byte 0"},
		{"cr\r\nLF-injection: x", "control character 0x0d at byte 2"},
	}
	for name, c := range badInputBackends(t) {
		t.Run(name, func(t *testing.T) {
			k, err := NewRedis(c)
			require.NoError(t, err)
			ctx := context.Background()
			for _, row := range table {
				_, err := k.Begin(ctx, "scope", row.key)
				assert.ErrorIs(t, err, ErrInvalidKey, "Begin(%q)", row.key)
				assert.EqualError(t, err, "idem: invalid key: "+row.answer, "Begin(%q)", row.key)
				ran := false
				_, err = Do(ctx, k, "scope", row.key, func(context.Context) (int, error) { ran = true; return 1, nil })
				assert.ErrorIs(t, err, ErrInvalidKey, "Do(%q)", row.key)
				assert.False(t, ran, "Do(%q) ran the operation", row.key)
			}
			assert.Zero(t, c.DBSize(ctx).Val(), "keys Redis holds after refused keys")
		})
	}
}
