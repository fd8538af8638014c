package idem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Sentinels of CheckEviction. Match them with errors.Is; the error itself is
// an *EvictionError (or, when several nodes fail the check, an errors.Join of
// them).
var (
	// ErrEvictionPolicy reports that a Redis server the store writes to has a
	// maxmemory-policy other than noeviction. Such a server may drop records,
	// pending or completed, when it runs short of memory (volatile-* policies
	// included: every idem record has a TTL), and a retry of an evicted key
	// runs its operation again. Any policy but noeviction counts, including
	// ones this package does not know.
	ErrEvictionPolicy = errors.New("idem: redis may evict records")

	// ErrEvictionUnchecked reports that the eviction policy of a Redis server
	// could not be read: the server answered CONFIG GET with an error (managed
	// services often rename or deny CONFIG, ACLs may forbid it), the client
	// cannot send it, or the server is a Redis Cluster node reached through a
	// client that cannot see the other masters. Nothing is known about
	// eviction then: check the setting another way.
	ErrEvictionUnchecked = errors.New("idem: redis eviction policy unchecked")
)

// EvictionError is the error of CheckEviction for one Redis server. errors.Is
// reports true for ErrEvictionPolicy when Err is nil (the policy was read and
// is not noeviction), and for ErrEvictionUnchecked when Err is set (it could
// not be read, or not for every node).
type EvictionError struct {
	// Addr is the server's address as the client knows it; empty when the
	// client does not say (a *redis.Conn, a failover client).
	Addr string
	// Policy is the server's maxmemory-policy, such as "allkeys-lru"; empty
	// when it could not be read.
	Policy string
	// MaxMemory is the server's maxmemory in bytes: 0 means no limit (on a
	// 64-bit server nothing is evicted until someone sets one), -1 that it
	// could not be read.
	MaxMemory int64
	// Err is why the policy could not be checked: CONFIG GET's error reply,
	// or another reason. Nil when Policy holds an evicting policy.
	Err error
}

// Error implements error.
func (e *EvictionError) Error() string {
	var b strings.Builder
	if e.Err != nil {
		b.WriteString(ErrEvictionUnchecked.Error())
	} else {
		b.WriteString(ErrEvictionPolicy.Error())
	}
	if e.Addr != "" {
		b.WriteString(": " + e.Addr)
	}
	if e.Policy != "" {
		fmt.Fprintf(&b, ": maxmemory-policy %s", e.Policy)
		switch {
		case e.MaxMemory == 0:
			b.WriteString(" (maxmemory 0: no limit yet)")
		case e.MaxMemory > 0:
			fmt.Fprintf(&b, " (maxmemory %d bytes)", e.MaxMemory)
		}
	}
	if e.Err != nil {
		b.WriteString(": " + e.Err.Error())
	} else {
		b.WriteString("; set maxmemory-policy noeviction")
	}
	return b.String()
}

// Is reports whether target is ErrEvictionPolicy (Err is nil) or
// ErrEvictionUnchecked (Err is set).
func (e *EvictionError) Is(target error) bool {
	if e.Err != nil {
		return target == ErrEvictionUnchecked
	}
	return target == ErrEvictionPolicy
}

// Unwrap returns Err.
func (e *EvictionError) Unwrap() error { return e.Err }

// CheckEviction checks the eviction policy of the store's servers; see
// Keeper.CheckEviction.
func (s *redisStore) CheckEviction(ctx context.Context) error {
	switch c := s.client.(type) {
	case *redis.ClusterClient:
		return checkEvictionEach(ctx, c.ForEachMaster)
	case *redis.Ring:
		return checkEvictionEach(ctx, c.ForEachShard)
	case configGetter:
		return checkEvictionNode(ctx, c, clientAddr(c), true)
	}
	return &EvictionError{MaxMemory: -1, Err: fmt.Errorf("client %T cannot send CONFIG GET", s.client)}
}

// configGetter is a client that sends CONFIG GET to one server:
// *redis.Client, *redis.Conn, *redis.AutoPipeliner.
type configGetter interface {
	ConfigGet(ctx context.Context, parameter string) *redis.MapStringStringCmd
}

// checkEvictionEach checks every node forEach visits (ForEachMaster,
// ForEachShard) and joins their errors, ordered by address.
func checkEvictionEach(ctx context.Context, forEach func(context.Context, func(context.Context, *redis.Client) error) error) error {
	type nodeErr struct {
		addr string
		err  error
	}
	var (
		mu   sync.Mutex
		errs []nodeErr
	)
	err := forEach(ctx, func(ctx context.Context, c *redis.Client) error {
		addr := c.Options().Addr
		if err := checkEvictionNode(ctx, c, addr, false); err != nil {
			mu.Lock()
			errs = append(errs, nodeErr{addr, err})
			mu.Unlock()
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("%w: checking eviction: %w", ErrUnavailable, err)
	}
	slices.SortFunc(errs, func(a, b nodeErr) int { return cmp.Compare(a.addr, b.addr) })
	switch len(errs) {
	case 0:
		return nil
	case 1:
		return errs[0].err
	}
	all := make([]error, len(errs))
	for i, e := range errs {
		all[i] = e.err
	}
	return errors.Join(all...)
}

// checkEvictionNode checks one server. lone is true when the client sees only
// this server, so that a Cluster node behind it means unchecked masters.
func checkEvictionNode(ctx context.Context, c configGetter, addr string, lone bool) error {
	conf, err := c.ConfigGet(ctx, "maxmemory*").Result()
	if err != nil {
		return configError(addr, err)
	}
	policy := strings.ToLower(conf["maxmemory-policy"])
	if policy == "" {
		return &EvictionError{Addr: addr, MaxMemory: -1, Err: errors.New("CONFIG GET maxmemory* answered no maxmemory-policy")}
	}
	maxMemory, perr := strconv.ParseInt(conf["maxmemory"], 10, 64)
	if perr != nil {
		maxMemory = -1
	}
	if policy != "noeviction" {
		return &EvictionError{Addr: addr, Policy: policy, MaxMemory: maxMemory}
	}
	if !lone {
		return nil
	}
	conf, err = c.ConfigGet(ctx, "cluster-enabled").Result()
	if err != nil {
		return configError(addr, err)
	}
	if conf["cluster-enabled"] == "yes" {
		return &EvictionError{Addr: addr, Policy: policy, MaxMemory: maxMemory,
			Err: errors.New("the server is a Redis Cluster node and the client is not a *redis.ClusterClient: the other masters were not checked")}
	}
	return nil
}

// configError sorts an error of CONFIG GET: an error reply means CONFIG was
// refused (unchecked), unless it says the server is busy or loading; anything
// else (a network error, the context) means the server is unavailable.
func configError(addr string, err error) error {
	var rerr redis.Error
	if errors.As(err, &rerr) {
		transient := false
		for _, p := range []string{"LOADING", "BUSY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN"} {
			transient = transient || redis.HasErrorPrefix(err, p)
		}
		if !transient {
			return &EvictionError{Addr: addr, MaxMemory: -1, Err: fmt.Errorf("CONFIG GET: %w", err)}
		}
	}
	if addr != "" {
		return fmt.Errorf("%w: checking eviction on %s: %w", ErrUnavailable, addr, err)
	}
	return fmt.Errorf("%w: checking eviction: %w", ErrUnavailable, err)
}

// clientAddr is the address a *redis.Client dials, or "" when it does not
// say (a *redis.Conn, a failover client).
func clientAddr(c any) string {
	if o, ok := c.(interface{ Options() *redis.Options }); ok {
		if a := o.Options().Addr; a != "FailoverClient" {
			return a
		}
	}
	return ""
}

// CheckEviction reads maxmemory-policy and maxmemory (CONFIG GET
// maxmemory*) from every Redis server the Keeper writes to: the server a
// *redis.Client or *redis.Conn reaches, every master of a
// *redis.ClusterClient, every live shard of a *redis.Ring. Replicas are not
// checked: give them the same setting. Call it once when the process
// starts, and refuse to start or warn (docs/durability.md). It returns:
//
//   - nil when every server has maxmemory-policy noeviction: a full Redis
//     then refuses writes (a claim fails with ErrUnavailable and its
//     operation does not run) instead of dropping records;
//   - an *EvictionError matching ErrEvictionPolicy when a server has any
//     other policy, whatever maxmemory is now (MaxMemory says it), since
//     maxmemory can be set at run time;
//   - an *EvictionError matching ErrEvictionUnchecked when the policy could
//     not be read: CONFIG refused or renamed (managed services, ACLs,
//     miniredis), a client that cannot send CONFIG GET, or a Cluster node
//     reached through a client that is not a *redis.ClusterClient (such as
//     an AutoPipeliner on one);
//   - an error matching ErrUnavailable when a server could not be reached.
//
// The failures of several servers are joined (errors.Join), ordered by
// address: errors.Is tests them all, errors.As finds the first
// *EvictionError.
func (k *Keeper) CheckEviction(ctx context.Context) error {
	rs, err := k.onRedis("CheckEviction")
	if err != nil {
		return err
	}
	return rs.CheckEviction(ctx)
}
