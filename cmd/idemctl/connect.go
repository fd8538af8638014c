package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

// defaultRedis is the Redis used without -redis or -cluster.
const defaultRedis = "redis://127.0.0.1:6379/0"

// conn is an open Redis and a Keeper on it.
type conn struct {
	client redis.UniversalClient
	keeper *idem.Keeper
}

// connect opens the Redis the flags name, with a Keeper under prefix, of
// the placement -scope-shards gives, if given.
func connect(ctx context.Context, g *globals, prefix string) (*conn, error) {
	var client redis.UniversalClient
	switch {
	case g.redisURL != "" && g.cluster != "":
		return nil, fmt.Errorf("%w: -redis and -cluster exclude each other", errUsage)
	case g.cluster != "":
		client = redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(g.cluster, ",")})
	default:
		url := g.redisURL
		if url == "" {
			url = defaultRedis
		}
		opt, err := redis.ParseURL(url)
		if err != nil {
			return nil, fmt.Errorf("%w: -redis: %w", errUsage, err)
		}
		client = redis.NewClient(opt)
	}
	opts := []idem.Option{idem.WithPrefix(prefix)}
	if g.shardsSet {
		opts = append(opts, idem.WithScopeShards(g.shards))
	}
	keeper, err := idem.NewRedis(client, opts...)
	if err != nil {
		client.Close()
		return nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	return &conn{client: client, keeper: keeper}, nil
}

func (c *conn) Close() error { return c.client.Close() }

// splitRecordKey splits a Redis key as a listing shows it, prefix + "{" + id
// + "}", or prefix + "{" + shard + "}" + digest for a Keeper made
// WithScopeShards (its id is digest + shard), into its prefix and record
// id; the store checks the id.
func splitRecordKey(key string) (prefix, id string, err error) {
	open, end := strings.LastIndexByte(key, '{'), strings.LastIndexByte(key, '}')
	switch {
	case open < 0 || end < open:
	case end == len(key)-1:
		return key[:open], key[open+1 : end], nil
	case end-open-1 == placedTagLen:
		return key[:open], key[end+1:] + key[open+1:end], nil
	}
	return "", "", fmt.Errorf("%w: -record %q is not a record's Redis key (PREFIX{ID} or PREFIX{SHARD}DIGEST)", errUsage, key)
}

// placedTagLen is how many characters name the shard in the key of a
// record of a Keeper made WithScopeShards.
const placedTagLen = 6
