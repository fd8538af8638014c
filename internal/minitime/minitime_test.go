package minitime

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func setup(t *testing.T) (*miniredis.Miniredis, *Time, *redis.Client, time.Time) {
	m := miniredis.RunT(t)
	start := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	m.SetTime(start)
	m.ClockTTL(true)
	mt := Install(m, start)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	c.AddHook(mt.Hook())
	t.Cleanup(func() { c.Close() })
	return m, mt, c, start
}

func redisTime(t *testing.T, c *redis.Client) time.Time {
	t.Helper()
	tm, err := c.Time(context.Background()).Result()
	require.NoError(t, err)
	return tm
}

// TIME starts at the instant set, then moves a microsecond per answer while
// the clock stands still, in scripts too; it follows Set, never backwards;
// key expiry stays with miniredis's own clock.
func TestTimeStrictlyIncreases(t *testing.T) {
	m, mt, c, start := setup(t)
	ctx := context.Background()
	assert.True(t, redisTime(t, c).Equal(start))
	assert.True(t, redisTime(t, c).Equal(start.Add(time.Microsecond)))
	v, err := c.Eval(ctx, "local t = redis.call('TIME'); return t[1] * 1000000 + t[2]", nil).Int64()
	require.NoError(t, err)
	assert.Equal(t, start.Add(2*time.Microsecond).UnixMicro(), v, "a script's TIME")

	require.NoError(t, c.Set(ctx, "k", "v", time.Minute).Err())
	assert.Equal(t, time.Minute, m.TTL("k"), "expiry does not move with TIME")

	later := start.Add(time.Second)
	m.SetTime(later)
	mt.Set(later)
	assert.True(t, redisTime(t, c).Equal(later))
	mt.Set(start) // back: TIME does not follow
	assert.True(t, redisTime(t, c).Equal(later.Add(time.Microsecond)))

	_, err = c.Do(ctx, "TIME", "x").Result()
	assert.Error(t, err, "miniredis still checks the arguments")
}

// An error set with SetError answers every command until cleared; one set
// with miniredis's own SetError too, and once it is cleared the next command
// puts the hook back.
func TestErrors(t *testing.T) {
	m, mt, c, start := setup(t)
	ctx := context.Background()
	mt.SetError("LOADING Redis is loading the dataset in memory")
	assert.ErrorContains(t, c.Ping(ctx).Err(), "LOADING")
	mt.SetError("")
	assert.True(t, redisTime(t, c).Equal(start))

	m.SetError("LOADING again")
	assert.ErrorContains(t, c.Ping(ctx).Err(), "LOADING")
	m.SetError("")
	// The first command runs without the hook, on miniredis's own clock,
	// moved past the last answer; then the hook is back.
	assert.True(t, redisTime(t, c).Equal(start.Add(time.Microsecond)))
	assert.True(t, redisTime(t, c).Equal(start.Add(2*time.Microsecond)))
	require.NoError(t, c.Ping(ctx).Err())
	assert.True(t, redisTime(t, c).Equal(start.Add(3*time.Microsecond)))
}

// TIME in a MULTI block is left to miniredis, which queues it.
func TestMulti(t *testing.T) {
	_, _, c, start := setup(t)
	ctx := context.Background()
	cmds, err := c.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.Time(ctx)
		return nil
	})
	require.NoError(t, err)
	assert.True(t, cmds[0].(*redis.TimeCmd).Val().Equal(start))
	assert.True(t, redisTime(t, c).Equal(start))
}
