// Package redistest starts real redis-server processes for tests: each on a
// free loopback port, in a temporary directory, stopped in t.Cleanup, and
// killed with the test binary if it dies without running its cleanups
// (internal/proc).
//
// Without redis-server on PATH, tests that need one are skipped with a
// message; with IDEM_REQUIRE_REDIS=1 in the environment they fail instead.
package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/proc"
	"github.com/redis/go-redis/v9"
)

// Required reports whether IDEM_REQUIRE_REDIS=1 is set: tests that cannot find
// redis-server must fail rather than skip.
func Required() bool { return os.Getenv("IDEM_REQUIRE_REDIS") == "1" }

// Binary returns the path of a program (redis-server, redis-cli) on PATH, or
// skips tb (fails it when Required) if there is none.
func Binary(tb testing.TB, name string) string {
	tb.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if Required() {
			tb.Fatalf("%s not found on PATH and IDEM_REQUIRE_REDIS=1: %v", name, err)
		}
		tb.Skipf("%s not found on PATH; install Redis to run this test (IDEM_REQUIRE_REDIS=1 makes this a failure)", name)
	}
	return p
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(tb testing.TB) int {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("finding a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Server is a redis-server started by a test.
type Server struct {
	// Addr is host:port on 127.0.0.1.
	Addr string
	// Port is the port of Addr.
	Port int
	// Dir is the server's working directory (AOF, RDB, cluster config).
	Dir string

	bin  string
	args []string

	mu     sync.Mutex
	cmd    *exec.Cmd
	log    *os.File
	exited chan struct{} // closed when cmd has exited
}

// Start starts redis-server on a free loopback port in a temporary directory,
// with persistence off unless args say otherwise, waits until it answers PING
// (and is the process that answers on its port), and stops it in tb.Cleanup. args are extra redis-server options, such as
// "--appendonly", "yes".
func Start(tb testing.TB, args ...string) *Server {
	tb.Helper()
	bin := Binary(tb, "redis-server")
	var err error
	for try := 0; try < 5; try++ {
		s := &Server{bin: bin, Dir: tb.TempDir(), Port: FreePort(tb), args: args}
		s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port))
		if err = s.start(); err == nil {
			tb.Cleanup(s.Stop)
			return s
		}
		s.Stop()
	}
	tb.Fatalf("starting redis-server: %v", err)
	return nil
}

func (s *Server) start() error {
	argv := []string{
		"--port", strconv.Itoa(s.Port), "--bind", "127.0.0.1",
		"--dir", s.Dir, "--save", "", "--appendonly", "no",
		"--protected-mode", "no", "--daemonize", "no",
	}
	argv = append(argv, s.args...)
	log, err := os.OpenFile(filepath.Join(s.Dir, "redis.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(s.bin, argv...)
	cmd.Dir = s.Dir
	cmd.Stdout, cmd.Stderr = log, log
	if err := proc.Start(cmd); err != nil {
		log.Close()
		return err
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	s.mu.Lock()
	s.cmd, s.log, s.exited = cmd, log, exited
	s.mu.Unlock()
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		err := c.Ping(ctx).Err() // LOADING until its data is read
		var info string
		if err == nil {
			info, err = c.Info(ctx, "server").Result()
		}
		cancel()
		if err == nil {
			// The server that answers must be this one: another process
			// may have taken the port between FreePort and the bind, and
			// then this one exits while the other answers.
			if pid := infoField(info, "process_id"); pid != strconv.Itoa(cmd.Process.Pid) {
				return fmt.Errorf("%s is answered by process %s, not by the redis-server started (%d)", s.Addr, pid, cmd.Process.Pid)
			}
			return nil
		}
		select {
		case <-exited:
			b, _ := os.ReadFile(filepath.Join(s.Dir, "redis.log"))
			return fmt.Errorf("redis-server exited: %s", tail(b))
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redis-server on %s did not answer PING: %v", s.Addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop kills the server at once (SIGKILL: nothing is saved on the way out) and
// waits for it to exit. Stopping a stopped server does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	cmd, log, exited := s.cmd, s.log, s.exited
	s.cmd, s.log = nil, nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-exited
	log.Close()
}

// Restart starts the server again on the same port and directory, with the
// same options (so an AOF or RDB file there is loaded), after Stop.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	s.Stop()
	if err := s.start(); err != nil {
		tb.Fatalf("restarting redis-server: %v", err)
	}
}

// Client returns a go-redis client of the server, closed in tb.Cleanup.
func (s *Server) Client(tb testing.TB) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
	tb.Cleanup(func() { c.Close() })
	return c
}

// infoField is the value of field in an INFO reply, or "".
func infoField(info, field string) string {
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return v
		}
	}
	return ""
}

func tail(b []byte) string {
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}
