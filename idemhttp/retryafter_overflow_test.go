package idemhttp

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestHugeRetryAfterEndsTheRetries: RFC 9110 delay-seconds is 1*DIGIT, of
// any length. A Retry-After of more digits than an int64 holds is the
// longest delay, so, like any Retry-After longer than MaxDelay, it ends the
// retries: that response is returned, not retried after the backoff.
func TestHugeRetryAfterEndsTheRetries(t *testing.T) {
	for _, v := range []string{"99999999999999999", "99999999999999999999"} {
		tr, base, waits := newScripted(reply{status: 503, header: []string{"Retry-After", v}}, reply{status: 201})
		resp, err := tr.RoundTrip(newPost("x"))
		require.NoError(t, err)
		assert.Equal(t, 503, resp.StatusCode, "Retry-After: %s: the server asks for longer than the caller waits", v)
		assert.Equal(t, 1, base.attempts(), "Retry-After: %s", v)
		assert.Empty(t, *waits, "Retry-After: %s", v)
	}
}
