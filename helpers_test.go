package idem

import (
	"context"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// newKeeper returns a Keeper on b's client.
func newKeeper(t testing.TB, b *redistest.Backend, opts ...Option) *Keeper {
	t.Helper()
	k, err := NewRedis(b.Client, opts...)
	require.NoError(t, err, "NewRedis")
	return k
}

// quietLogger drops go-redis's own log lines (dial failures in the
// unavailability tests), which the tests assert on as errors instead.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

func init() { redis.SetLogger(quietLogger{}) }

// expireLeaseSrc makes the lease of the claim of a record run out: the
// record's own (KEYS[1]), or, when it is kept compactly (ARGV[1] the first 8
// bytes of its digest, ARGV[2] its index key, ARGV[3] the start of the call
// record keys), that of the call that holds it, which its other claims
// share. lib.lua goes before it.
const expireLeaseSrc = `
local v = redis.call('GET', KEYS[1])
if v then
  local a, b = string.match(v, '^(i1P%d+:%d+:[01]:)%d+(:.*)$')
  if not a then return 0 end
  redis.call('SET', KEYS[1], a .. '1' .. b, 'KEEPTTL')
  return 1
end
if ARGV[1] == '' then return 0 end
local _, pos, tok = index_entry(ARGV[2], {ARGV[1], ARGV[3]})
if not pos then return 0 end
local ck = ARGV[3] .. tok
local cv = redis.call('GET', ck)
if not cv then return 0 end
redis.call('SET', ck, 'i2B1' .. string.sub(cv, string.find(cv, ':', 1, true), -1), 'KEEPTTL')
return 1`

var expireLeaseLua = redis.NewScript(scriptLib + expireLeaseSrc)

// expireLease makes the lease of the claim of (scope, key) in s run out, by
// Redis's clock, whether the claim is kept in a record or compactly.
func expireLease(t testing.TB, s *RedisStore, scope, key string) {
	t.Helper()
	id := recordID(scope, key)
	d8, index, calls := s.compactIndexArgs(id)
	require.NoError(t, expireLeaseLua.Run(context.Background(), s.client, []string{s.key(id)}, d8, index, calls).Err())
}

// errOf is the error of a Store's Complete, for a test that asserts on it
// alone.
func errOf(_ bool, err error) error { return err }
