package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

// defaultRedis is the Redis used without -redis or -cluster.
const defaultRedis = "redis://127.0.0.1:6379/0"

// conn is an open Redis and the store on it.
type conn struct {
	client redis.UniversalClient
	store  *idem.RedisStore
	keeper *idem.Keeper
}

// connect opens the Redis the flags name, with a store under prefix, laid
// out for the marker scale of -marker-scale or, without it, the one the
// prefix's index records (the default scale when there is no index).
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
	scale := g.markerScale
	if scale == 0 {
		var err error
		if scale, err = indexScale(ctx, client, prefix); err != nil {
			client.Close()
			return nil, err
		}
	}
	store, err := idem.NewRedisStore(client, idem.WithPrefix(prefix), idem.WithMarkerScale(scale))
	if err != nil {
		client.Close()
		return nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	keeper, err := idem.New(store)
	if err != nil {
		client.Close()
		return nil, err
	}
	return &conn{client: client, store: store, keeper: keeper}, nil
}

func (c *conn) Close() error { return c.client.Close() }

// indexScale reads the marker scale the index of prefix records (see
// idem.WithMarkerScale): in the field "" of an index key, prefix + "i:0"
// on one server, prefix + "{TAG}i" on a Cluster's masters, the first found.
// Without an index it is idem.DefaultMarkerScale.
func indexScale(ctx context.Context, client redis.UniversalClient, prefix string) (int64, error) {
	var layout string
	read := func(ctx context.Context, c *redis.Client, key string) error {
		v, err := c.HGet(ctx, key, "").Result()
		if err == nil {
			layout = v
		} else if !errors.Is(err, redis.Nil) {
			return err
		}
		return nil
	}
	var err error
	switch c := client.(type) {
	case *redis.ClusterClient:
		var mu sync.Mutex
		err = c.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
			keys, _, err := node.Scan(ctx, 0, escapeGlob(prefix)+"{*}i", 1000).Result()
			for _, k := range keys {
				if err == nil {
					mu.Lock()
					err = read(ctx, node, k)
					mu.Unlock()
				}
			}
			return err
		})
	case *redis.Client:
		err = read(ctx, c, prefix+"i:0")
	}
	if err != nil {
		return 0, fmt.Errorf("%w: reading the layout of the index of %q: %w", idem.ErrUnavailable, prefix, err)
	}
	if layout == "" {
		return idem.DefaultMarkerScale, nil
	}
	n, err := strconv.ParseInt(strings.TrimPrefix(layout, "v1 scale="), 10, 64)
	if err != nil || !strings.HasPrefix(layout, "v1 scale=") {
		return 0, fmt.Errorf("the index of %q is laid out as %q, which this idemctl does not know", prefix, layout)
	}
	return n, nil
}

// escapeGlob escapes the characters of s that Redis's glob patterns give a
// meaning to.
func escapeGlob(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if strings.IndexByte(`*?[]\`, s[i]) >= 0 {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// splitRecordKey splits a Redis key as a listing shows it, prefix + "{" + id
// + "}", into its prefix and record id; the store checks the id.
func splitRecordKey(key string) (prefix, id string, err error) {
	open := strings.LastIndexByte(key, '{')
	if open < 0 || !strings.HasSuffix(key, "}") {
		return "", "", fmt.Errorf("%w: -record %q is not a record's Redis key (PREFIX{ID})", errUsage, key)
	}
	return key[:open], key[open+1 : len(key)-1], nil
}
