package redistest

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/slot"
	"github.com/redis/go-redis/v9"
)

// Slots is the number of hash slots of a Redis Cluster.
const Slots = slot.Slots

// Cluster is a Redis Cluster of redis-server processes on loopback, started
// by a test.
type Cluster struct {
	// Masters are the nodes that serve slots, in slot order: Masters[i]
	// serves an equal share of the slots, starting at i*Slots/len(Masters).
	Masters []*Server
	// Replicas[i] are the replicas of Masters[i] when the cluster started.
	// After a failover a replica may be a master and the other way round.
	Replicas [][]*Server
}

// StartCluster starts a Redis Cluster of masters nodes (at least 1), each
// with replicas replicas, every node on a free loopback port with
// --cluster-enabled yes. It assigns the slots and introduces the nodes to each
// other with CLUSTER ADDSLOTSRANGE, MEET and REPLICATE (no redis-cli needed),
// waits until every node reports cluster_state:ok, agrees on the topology and
// every replica is in sync, and stops every node in tb.Cleanup. args are extra
// redis-server options for every node.
//
// It skips tb without redis-server on PATH, and fails it under
// IDEM_REQUIRE_REDIS=1.
func StartCluster(tb testing.TB, masters, replicas int, args ...string) *Cluster {
	tb.Helper()
	if masters < 1 || replicas < 0 {
		tb.Fatalf("StartCluster: %d masters, %d replicas each", masters, replicas)
	}
	nodeArgs := append([]string{
		"--cluster-enabled", "yes",
		"--cluster-node-timeout", "3000",
		"--cluster-config-file", "nodes.conf",
		// A replica that lost its master for a while may still be promoted.
		"--cluster-replica-validity-factor", "0",
		// Replicas sync at once rather than after the default 5s.
		"--repl-diskless-sync-delay", "0",
	}, args...)
	c := &Cluster{Replicas: make([][]*Server, masters)}
	for i := 0; i < masters; i++ {
		c.Masters = append(c.Masters, Start(tb, nodeArgs...))
	}
	for i := 0; i < masters; i++ {
		for j := 0; j < replicas; j++ {
			c.Replicas[i] = append(c.Replicas[i], Start(tb, nodeArgs...))
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := c.create(ctx); err != nil {
		tb.Fatalf("creating the cluster: %v", err)
	}
	return c
}

// Nodes returns every node: the masters first, then the replicas.
func (c *Cluster) Nodes() []*Server {
	nodes := append([]*Server(nil), c.Masters...)
	for _, rs := range c.Replicas {
		nodes = append(nodes, rs...)
	}
	return nodes
}

// Addrs returns the address of every node, masters first.
func (c *Cluster) Addrs() []string {
	var addrs []string
	for _, n := range c.Nodes() {
		addrs = append(addrs, n.Addr)
	}
	return addrs
}

// Client returns a go-redis cluster client of the cluster, closed in
// tb.Cleanup. opt may be nil; its Addrs are set to the cluster's nodes.
func (c *Cluster) Client(tb testing.TB, opt *redis.ClusterOptions) *redis.ClusterClient {
	if opt == nil {
		opt = &redis.ClusterOptions{}
	}
	o := *opt
	o.Addrs = c.Addrs()
	cc := redis.NewClusterClient(&o)
	tb.Cleanup(func() { cc.Close() })
	return cc
}

func (c *Cluster) create(ctx context.Context) error {
	client, closeAll := nodeClients()
	defer closeAll()
	// Slots and a distinct config epoch per master, as redis-cli does, so
	// that no epoch collision has to be resolved later.
	for i, m := range c.Masters {
		first, last := i*Slots/len(c.Masters), (i+1)*Slots/len(c.Masters)-1
		cl := client(m)
		if err := cl.ClusterAddSlotsRange(ctx, first, last).Err(); err != nil {
			return fmt.Errorf("ADDSLOTSRANGE on %s: %w", m.Addr, err)
		}
		if err := cl.Do(ctx, "cluster", "set-config-epoch", i+1).Err(); err != nil {
			return fmt.Errorf("SET-CONFIG-EPOCH on %s: %w", m.Addr, err)
		}
	}
	nodes := c.Nodes()
	for _, n := range nodes[1:] {
		if err := client(n).ClusterMeet(ctx, "127.0.0.1", strconv.Itoa(nodes[0].Port)).Err(); err != nil {
			return fmt.Errorf("MEET from %s: %w", n.Addr, err)
		}
	}
	// Every node must know every other before a replica can name its master.
	if err := poll(ctx, func() error {
		for _, n := range nodes {
			out, err := client(n).ClusterNodes(ctx).Result()
			if err != nil {
				return err
			}
			if got := len(strings.Split(strings.TrimSpace(out), "\n")); got != len(nodes) {
				return fmt.Errorf("%s knows %d of %d nodes", n.Addr, got, len(nodes))
			}
		}
		return nil
	}); err != nil {
		return err
	}
	for i, m := range c.Masters {
		id, err := client(m).ClusterMyID(ctx).Result()
		if err != nil {
			return err
		}
		for _, r := range c.Replicas[i] {
			if err := client(r).ClusterReplicate(ctx, id).Err(); err != nil {
				return fmt.Errorf("REPLICATE on %s: %w", r.Addr, err)
			}
		}
	}
	return c.waitStable(ctx, client)
}

// waitStable waits until every node says cluster_state:ok, sees the same
// masters and replicas, and every replica's link to its master is up.
func (c *Cluster) waitStable(ctx context.Context, client func(*Server) *redis.Client) error {
	nodes := c.Nodes()
	return poll(ctx, func() error {
		var want string
		for _, n := range nodes {
			cl := client(n)
			info, err := cl.ClusterInfo(ctx).Result()
			if err != nil {
				return err
			}
			if !strings.Contains(info, "cluster_state:ok") {
				return fmt.Errorf("%s: cluster_state not ok", n.Addr)
			}
			out, err := cl.ClusterNodes(ctx).Result()
			if err != nil {
				return err
			}
			view := topology(out)
			if want == "" {
				want = view
			} else if view != want {
				return fmt.Errorf("nodes disagree on the topology:\n%s\n%s", want, view)
			}
			repl, err := cl.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			if strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
				return fmt.Errorf("%s: replica link not up", n.Addr)
			}
			// A master streams to a replica only once it lists it online.
			if strings.Contains(repl, "role:master") && strings.Count(repl, "state=online") != strings.Count(repl, ",state=") {
				return fmt.Errorf("%s: a replica is not online yet", n.Addr)
			}
		}
		return nil
	})
}

// topology reduces CLUSTER NODES to "id role master slots" lines, sorted,
// without the fields that change from node to node (myself, ping times).
func topology(out string) string {
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(l)
		if len(f) < 8 {
			continue
		}
		role := "replica"
		if strings.Contains(f[2], "master") {
			role = "master"
		}
		if strings.Contains(f[2], "fail") || strings.Contains(f[2], "handshake") || strings.Contains(f[2], "noaddr") {
			role += "!" + f[2]
		}
		lines = append(lines, strings.Join(append([]string{f[0], f[1], role, f[3]}, f[8:]...), " "))
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

// Failover promotes replica with a manual CLUSTER FAILOVER (the coordinated
// kind: its master stops taking writes until the replica has caught up, so no
// acknowledged write is lost), and waits until every node agrees that it is a
// master and the cluster is ok again. It fails tb on error or after 30s.
func (c *Cluster) Failover(tb testing.TB, replica *Server) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client, closeAll := nodeClients()
	defer closeAll()
	r := client(replica)
	id, err := r.ClusterMyID(ctx).Result()
	if err != nil {
		tb.Fatalf("CLUSTER MYID on %s: %v", replica.Addr, err)
	}
	if err := r.Do(ctx, "cluster", "failover").Err(); err != nil {
		tb.Fatalf("CLUSTER FAILOVER on %s: %v", replica.Addr, err)
	}
	err = poll(ctx, func() error {
		for _, n := range c.Nodes() {
			out, err := client(n).ClusterNodes(ctx).Result()
			if err != nil {
				return err
			}
			if !isMaster(out, id) {
				return fmt.Errorf("%s does not see %s as a master yet", n.Addr, replica.Addr)
			}
		}
		return nil
	})
	if err == nil {
		err = c.waitStable(ctx, client)
	}
	if err != nil {
		tb.Fatalf("failover to %s: %v", replica.Addr, err)
	}
}

func isMaster(clusterNodes, id string) bool {
	for _, l := range strings.Split(clusterNodes, "\n") {
		f := strings.Fields(l)
		if len(f) > 2 && f[0] == id {
			return strings.Contains(f[2], "master")
		}
	}
	return false
}

// poll calls f every 50ms until it returns nil or ctx ends; then it returns
// f's last error.
func poll(ctx context.Context, f func() error) error {
	for {
		err := f()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: last: %v", ctx.Err(), err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// nodeClients returns a function that gives one client per node, made on
// first use and without retries, and a function that closes them all.
func nodeClients() (client func(*Server) *redis.Client, closeAll func()) {
	clients := map[*Server]*redis.Client{}
	client = func(s *Server) *redis.Client {
		if cl, ok := clients[s]; ok {
			return cl
		}
		cl := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1})
		clients[s] = cl
		return cl
	}
	closeAll = func() {
		for _, cl := range clients {
			cl.Close()
		}
	}
	return client, closeAll
}
