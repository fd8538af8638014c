package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/proc"
	"github.com/redis/go-redis/v9"
)

// redisServer is a redis-server the command started: on a free loopback
// port, in a temporary directory, without persistence.
type redisServer struct {
	addr    string
	version string
	dir     string
	cmd     *exec.Cmd
	exited  chan struct{}
}

// startRedis starts bin (a name on PATH or a path) and waits until it
// answers PING.
func startRedis(ctx context.Context, bin string) (_ *redisServer, err error) {
	path, err := exec.LookPath(bin)
	if err != nil {
		return nil, fmt.Errorf("redis-server not found (%w): install Redis, pass -redis-server, or leave out the peers that need it (-peers)", err)
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	s := &redisServer{addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}
	if s.dir, err = os.MkdirTemp("", "idem-peers-redis-"); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			s.stop()
		}
	}()
	if err := s.start(path, port); err != nil {
		return nil, err
	}
	if err := s.await(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// start starts the process, its output going to redis.log in its directory.
func (s *redisServer) start(path string, port int) error {
	log, err := os.Create(filepath.Join(s.dir, "redis.log"))
	if err != nil {
		return err
	}
	defer log.Close()
	s.cmd = exec.Command(path,
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", s.dir,
		"--save", "", "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no")
	s.cmd.Stdout, s.cmd.Stderr = log, log
	if err := proc.Start(s.cmd); err != nil { // killed if this program dies
		return fmt.Errorf("starting redis-server: %w", err)
	}
	s.exited = make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(s.exited) }()
	return nil
}

// await waits, up to 20 seconds, until the server answers PING, and reads
// its version.
func (s *redisServer) await(ctx context.Context) error {
	c := s.client()
	defer c.Close()
	deadline := time.Now().Add(20 * time.Second)
	for {
		info, err := c.Info(ctx, "server").Result()
		if err == nil {
			s.version = infoField(info, "redis_version")
			return nil
		}
		select {
		case <-s.exited:
			return fmt.Errorf("redis-server exited: %s", logTail(filepath.Join(s.dir, "redis.log")))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redis-server on %s did not answer: %w", s.addr, err)
		}
	}
}

// client returns a new client of the server with a pool of the default size;
// the caller closes it.
func (s *redisServer) client() *redis.Client {
	return s.clientWithPool(0)
}

// clientWithPool returns a new client of the server whose pool holds up to
// size connections (0: go-redis's default); the caller closes it.
func (s *redisServer) clientWithPool(size int) *redis.Client {
	return redis.NewClient(&redis.Options{Addr: s.addr, PoolSize: size})
}

// stop kills the server, waits for it, and removes its directory.
func (s *redisServer) stop() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
	_ = os.RemoveAll(s.dir)
}

// infoField returns the value of field in an INFO reply.
func infoField(info, field string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("finding a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// logTail returns the end of a log file, for an error message.
func logTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > 1500 {
		b = b[len(b)-1500:]
	}
	return strings.TrimSpace(string(b))
}
