package redistest

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// StartReplica starts a redis-server that replicates master (plain
// replication, --replicaof), and waits until its link to the master is up and
// it has loaded the master's data. args are extra redis-server options.
func StartReplica(tb testing.TB, master *Server, args ...string) *Server {
	tb.Helper()
	r := Start(tb, append([]string{"--replicaof", "127.0.0.1", strconv.Itoa(master.Port)}, args...)...)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := redis.NewClient(&redis.Options{Addr: r.Addr, MaxRetries: -1})
	defer c.Close()
	err := poll(ctx, func() error {
		info, err := c.Info(ctx, "replication").Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "master_link_status:up") || strings.Contains(info, "master_sync_in_progress:1") {
			return fmt.Errorf("%s: not in sync with %s yet", r.Addr, master.Addr)
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("starting a replica of %s: %v", master.Addr, err)
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
// nothing, and as a replica it acknowledges nothing, until Resume. A paused
// server is resumed before it is stopped.
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
