package idemwatermill

import (
	"crypto/sha256"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/idemkit/idem"
)

// Option configures Middleware.
type Option func(*config)

// KeyFunc returns the key of a message: one logical operation, the same on
// every delivery of it. An error, or an empty key, refuses the message
// before Redis is touched (see Middleware).
type KeyFunc func(msg *message.Message) (string, error)

// config is what the options set.
type config struct {
	// key returns a message's key; nil until newConfig sets the default.
	key KeyFunc
	// metadataKey is the name WithMetadataKey was given, kept to refuse an
	// empty one; set only when WithMetadataKey was the last key option.
	metadataKey *string
	// scope is the fixed scope of WithScope; nil: the handler's name.
	scope *string
	// fingerprint digests a message; nil: no fingerprint.
	fingerprint func(msg *message.Message) []byte
	// fingerprintSet is true once WithFingerprint was given, nil included.
	fingerprintSet bool
	// opts are given to every idem.Do call.
	opts []idem.Option
}

// WithKeyFunc sets how a message's key is found. Default: the message's
// UUID, which watermill keeps across a broker's redeliveries and a
// publisher's retries of the same *message.Message. A producer that builds a
// new message to retry a send (a new UUID) must carry its own key instead:
// see WithMetadataKey. A nil f keeps the default.
func WithKeyFunc(f KeyFunc) Option {
	return func(c *config) { c.key, c.metadataKey = f, nil }
}

// WithMetadataKey takes a message's key from its metadata entry name, for
// example an event id the producer sets. A message without the entry (or
// with an empty one) is refused with an error wrapping idem.ErrInvalidKey.
// The name must not be empty.
func WithMetadataKey(name string) Option {
	return func(c *config) {
		c.metadataKey = &name
		c.key = func(msg *message.Message) (string, error) { return msg.Metadata.Get(name), nil }
	}
}

// WithScope sets the scope of every key: keys in two scopes are two
// records. Default: the name of the router's handler that received the
// message (message.HandlerNameFromCtx), so that two handlers consuming the
// same message each run once; "" outside a router. Renaming a handler
// changes its scope: a redelivery across the rename runs again; give a fixed
// scope to keep it.
func WithScope(scope string) Option {
	return func(c *config) { c.scope = &scope }
}

// WithFingerprint sets what binds a key to its message: a later delivery
// with the same key and another fingerprint is refused with an error
// wrapping idem.ErrMismatch, never answered with the first message's output.
// Default: the SHA-256 digest of the payload. A nil f takes none: every
// message with the key is answered the same (use it when a producer's
// retries under one key may carry another payload, a timestamp for one).
func WithFingerprint(f func(msg *message.Message) []byte) Option {
	return func(c *config) { c.fingerprint, c.fingerprintSet = f, true }
}

// WithCallOptions adds options given to every idem.Do call, such as
// idem.WithWait. Options that apply only to a Keeper are refused when a
// message is handled, with an error wrapping idem.ErrInvalidConfig.
func WithCallOptions(opts ...idem.Option) Option {
	return func(c *config) { c.opts = append(c.opts, opts...) }
}

// uuidKey is the default KeyFunc: the message's UUID.
func uuidKey(msg *message.Message) (string, error) { return msg.UUID, nil }

// payloadDigest is the default fingerprint: the SHA-256 digest of the
// payload.
func payloadDigest(msg *message.Message) []byte {
	d := sha256.Sum256(msg.Payload)
	return d[:]
}

// newConfig applies opts over the defaults and refuses a setting that
// cannot work.
func newConfig(k *idem.Keeper, opts []Option) (config, error) {
	if k == nil {
		return config{}, fmt.Errorf("%w: idemwatermill: nil Keeper", idem.ErrInvalidConfig)
	}
	var c config
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	if c.metadataKey != nil && *c.metadataKey == "" {
		return config{}, fmt.Errorf("%w: idemwatermill: WithMetadataKey needs a name", idem.ErrInvalidConfig)
	}
	if c.key == nil {
		c.key = uuidKey
	}
	if !c.fingerprintSet {
		c.fingerprint = payloadDigest
	}
	return c, nil
}
