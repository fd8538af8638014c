package idemgrpc

import (
	"context"
	"time"
)

// WithSleep replaces the client interceptor's wait between attempts: tests
// see the delays it is asked for without waiting them.
func WithSleep(sleep func(ctx context.Context, d time.Duration) bool) Option {
	return Option{name: "WithSleep", client: func(c *client) { c.sleep = sleep }}
}

// Sleep is the client interceptor's own wait.
var Sleep = sleep
