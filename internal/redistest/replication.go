package redistest

import (
	"context"
	"fmt"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// StartReplica starts a redis-server that replicates the master at
// masterAddr (plain replication, --replicaof; masterAddr may be a proxy in
// front of the master), and waits until its link to the master is up and it
// has loaded the master's data. It first sets the master's
// repl-diskless-sync-delay to 0 so that the first sync starts at once. args are
// extra redis-server options.
func StartReplica(tb testing.TB, masterAddr string, args ...string) *Server {
	tb.Helper()
	host, port, err := net.SplitHostPort(masterAddr)
	if err != nil {
		tb.Fatalf("StartReplica: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m := redis.NewClient(&redis.Options{Addr: masterAddr, MaxRetries: -1})
	defer m.Close()
	if err := m.ConfigSet(ctx, "repl-diskless-sync-delay", "0").Err(); err != nil {
		tb.Fatalf("StartReplica: configuring the master: %v", err)
	}
	r := Start(tb, append([]string{"--replicaof", host, port}, args...)...)
	c := redis.NewClient(&redis.Options{Addr: r.Addr, MaxRetries: -1})
	defer c.Close()
	err = poll(ctx, func() error {
		info, err := c.Info(ctx, "replication").Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "master_link_status:up") || strings.Contains(info, "master_sync_in_progress:1") {
			return fmt.Errorf("%s: not in sync with %s yet", r.Addr, masterAddr)
		}
		return nil
	})
	if err == nil {
		// After the first sync the master holds its stream back until the
		// replica's first REPLCONF ACK, sent up to a second later: wait until
		// a write made now has reached the replica.
		probe := "redistest:replica-probe:" + r.Addr
		if err = m.Set(ctx, probe, "1", 0).Err(); err == nil {
			err = poll(ctx, func() error { return c.Get(ctx, probe).Err() })
			if err == nil {
				err = m.Del(ctx, probe).Err()
			}
		}
	}
	if err != nil {
		tb.Fatalf("starting a replica of %s: %v", masterAddr, err)
	}
	return r
}

// Promote turns a replica into a master that takes writes (REPLICAOF NO ONE),
// as an operator or a Sentinel would after its master died.
func (s *Server) Promote(tb testing.TB) {
	tb.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Do(ctx, "replicaof", "no", "one").Err(); err != nil {
		tb.Fatalf("REPLICAOF NO ONE on %s: %v", s.Addr, err)
	}
}

// Pause stops the server process (SIGSTOP) without killing it: it answers
// nothing, and as a replica it acknowledges nothing, until Resume. Stop
// kills a paused server all the same.
func (s *Server) Pause(tb testing.TB) {
	tb.Helper()
	s.signal(tb, syscall.SIGSTOP)
}

// Resume continues a server stopped by Pause (SIGCONT).
func (s *Server) Resume(tb testing.TB) {
	tb.Helper()
	s.signal(tb, syscall.SIGCONT)
}

func (s *Server) signal(tb testing.TB, sig syscall.Signal) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		tb.Fatalf("signal %v to %s: the server is not running", sig, s.Addr)
	}
	if err := s.cmd.Process.Signal(sig); err != nil {
		tb.Fatalf("signal %v to %s: %v", sig, s.Addr, err)
	}
}
