package idemgrpc

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"google.golang.org/grpc/codes"
)

// Defaults of both interceptors.
const (
	// DefaultKeyMetadata is the metadata key that carries the idempotency
	// key.
	DefaultKeyMetadata = "idempotency-key"
	// ReplayedMetadata is set to "true" in the header metadata of every
	// replayed answer.
	ReplayedMetadata = "idempotent-replayed"
	// DefaultRetryHint is the delay the server interceptor suggests in the
	// RetryInfo of an in-progress (Aborted) or store-down (Unavailable)
	// answer.
	DefaultRetryHint = time.Second
	// DefaultMaxAttempts is how many times the client interceptor sends a
	// call at most, the first time included.
	DefaultMaxAttempts = 5
	// DefaultBackoffBase and DefaultBackoffMax bound the client
	// interceptor's exponential backoff between attempts.
	DefaultBackoffBase = 100 * time.Millisecond
	DefaultBackoffMax  = 5 * time.Second
)

// cleanupTimeout bounds how long the interceptor spends storing or
// releasing a claim after the handler returned: the client may be gone, but
// the handler's outcome is still recorded.
const cleanupTimeout = 5 * time.Second

// Option configures UnaryServerInterceptor, UnaryClientInterceptor, or both;
// each option says what it applies to. Given to an interceptor it does not
// apply to, it is refused with an error wrapping idem.ErrInvalidConfig.
type Option struct {
	name   string
	server func(*server)
	client func(*client)
}

// WithMethods sets the full methods ("/package.Service/Method") that are
// guarded: the server interceptor claims their keys and the client
// interceptor attaches keys to them and retries them. Other calls pass
// straight through. Default: every unary method except those whose proto
// declaration, found in the global registry (generated code registers it),
// says idempotency_level = NO_SIDE_EFFECTS or IDEMPOTENT; a method not in
// the registry is guarded. Applies to both.
func WithMethods(fullMethods ...string) Option {
	set := func(m *methods) { m.only = slices.Clone(fullMethods); m.listed = true }
	return Option{
		name:   "WithMethods",
		server: func(s *server) { set(&s.methods) },
		client: func(c *client) { set(&c.methods) },
	}
}

// WithKeyMetadata sets the metadata key that carries the idempotency key;
// it is lower-cased, and must be a valid metadata key that does not end in
// "-bin" nor start with "grpc-". Default: "idempotency-key"
// (DefaultKeyMetadata). Applies to both.
func WithKeyMetadata(name string) Option {
	return Option{
		name:   "WithKeyMetadata",
		server: func(s *server) { s.header = name },
		client: func(c *client) { c.header = name },
	}
}

// WithKeyRequired sets whether a guarded call must carry a key. When it
// must, a call without one answers InvalidArgument (ErrorInfo reason
// ReasonKeyMissing) and the handler does not run; when it need not, the call
// passes through unguarded. Default: false. Applies to the server.
func WithKeyRequired(required bool) Option {
	return Option{name: "WithKeyRequired", server: func(s *server) { s.required = required }}
}

// WithTenant sets the function that names the tenant or principal a call
// acts for, such as an account taken from its credentials. A record is named
// by the full method, the tenant and the key, so one tenant can never replay
// another's answer nor block another's key. The function may refuse a call
// (no tenant) with an error: the call answers the error's gRPC status if it
// carries one (status.FromError), else InvalidArgument with its message,
// and the handler does not run; a refused call never shares a key space.
// Default: every call belongs to one tenant, "". Applies to the server.
func WithTenant(tenant func(ctx context.Context) (string, error)) Option {
	return Option{name: "WithTenant", server: func(s *server) { s.tenant = tenant }}
}

// WithStorePolicy sets which status codes the handler may answer for its
// answer to be stored and replayed; for the others the key is released, so
// that a retry runs the handler again. Default: DefaultStorePolicy. Applies
// to the server.
func WithStorePolicy(store func(codes.Code) bool) Option {
	return Option{name: "WithStorePolicy", server: func(s *server) { s.store = store }}
}

// DefaultStorePolicy stores OK and the codes that say the request itself
// was wrong or cannot be served, whatever the moment: InvalidArgument,
// NotFound, AlreadyExists, FailedPrecondition, OutOfRange and
// Unimplemented. It releases the codes that say "try again" or "the
// outcome is unknown": Canceled, Unknown, DeadlineExceeded,
// ResourceExhausted, Aborted, Internal, Unavailable and DataLoss; and
// Unauthenticated and PermissionDenied, which say the call failed
// authentication and never started the operation (as idemhttp releases
// 401, 403 and 407): a call with forged or stale credentials cannot answer
// for the key, and a retry with valid ones runs.
func DefaultStorePolicy(code codes.Code) bool {
	switch code {
	case codes.OK, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists,
		codes.FailedPrecondition, codes.OutOfRange, codes.Unimplemented:
		return true
	}
	return false
}

// WithRetryHint sets the delay suggested in the RetryInfo detail of an
// in-progress answer (Aborted), never more than the lease the other attempt
// has left, and of a store-down answer (Unavailable). It is a hint of when
// the answer may be ready, not the lease left: a short one lets a client
// that obeys it get the replay soon after the first call ends. Default: 1s
// (DefaultRetryHint). It must be positive. Applies to the server.
func WithRetryHint(d time.Duration) Option {
	return Option{name: "WithRetryHint", server: func(s *server) { s.retryHint = d }}
}

// WithWait makes a call that finds its key in progress wait up to d (and
// within its context) for the first call's answer, and replay it, instead of
// answering Aborted at once (see idem.WithWait); WithWait(0) never waits.
// Default: the Keeper's own (idem.WithWait given to idem.New; none unless
// set). It must not be negative. Applies to the server.
func WithWait(d time.Duration) Option {
	return Option{name: "WithWait", server: func(s *server) { s.wait, s.waitSet = d, true }}
}

// WithMaxAttempts sets how many times the client interceptor sends a call
// at most, the first time included; WithMaxAttempts(1) never retries.
// Default: 5 (DefaultMaxAttempts). It must be at least 1. Applies to the
// client.
func WithMaxAttempts(n int) Option {
	return Option{name: "WithMaxAttempts", client: func(c *client) { c.maxAttempts = n }}
}

// WithBackoff sets the client interceptor's backoff between attempts that
// carry no RetryInfo: before retry n (1, 2, ...) it waits a random time
// between half and all of min(base<<(n-1), ceiling). A RetryInfo delay is
// honoured instead, with up to a fifth more at random; one longer than
// ceiling ends the retries. Default: 100ms (DefaultBackoffBase) and 5s
// (DefaultBackoffMax). base must be positive and ceiling at least base.
// Applies to the client.
func WithBackoff(base, ceiling time.Duration) Option {
	return Option{name: "WithBackoff", client: func(c *client) { c.base, c.ceiling = base, ceiling }}
}

// applyServer sets opts on s, refusing client-only options.
func applyServer(s *server, opts []Option) error {
	for _, o := range opts {
		if o.server == nil && o.client == nil {
			continue // the zero Option
		}
		if o.server == nil {
			return invalid("%s does not apply to the server interceptor", o.name)
		}
		o.server(s)
	}
	return nil
}

// applyClient sets opts on c, refusing server-only options.
func applyClient(c *client, opts []Option) error {
	for _, o := range opts {
		if o.server == nil && o.client == nil {
			continue // the zero Option
		}
		if o.client == nil {
			return invalid("%s does not apply to the client interceptor", o.name)
		}
		o.client(c)
	}
	return nil
}

// invalid is an error wrapping idem.ErrInvalidConfig.
func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: idemgrpc: "+format, append([]any{idem.ErrInvalidConfig}, args...)...)
}

// checkKeyMetadata lower-cases a key metadata name and checks it.
func checkKeyMetadata(name string) (string, error) {
	name = strings.ToLower(name)
	switch {
	case name == "":
		return "", invalid("empty key metadata name")
	case strings.HasSuffix(name, "-bin"):
		return "", invalid("key metadata %q is binary (-bin)", name)
	case strings.HasPrefix(name, "grpc-"):
		return "", invalid("key metadata %q is reserved for gRPC (grpc-)", name)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.') {
			return "", invalid("key metadata %q holds %q, not allowed in a metadata key", name, c)
		}
	}
	return name, nil
}
