package idem

import (
	"strings"
	"testing"

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
