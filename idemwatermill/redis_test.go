package idemwatermill_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// newMiniKeeper returns a Keeper on a miniredis of its own, stopped with
// the test, and that miniredis.
func newMiniKeeper(t testing.TB, opts ...idem.Option) (*idem.Keeper, *miniredis.Miniredis) {
	t.Helper()
	m := miniredis.RunT(t)
	k, err := idem.NewRedis(newRedisClient(t, m.Addr()), opts...)
	require.NoError(t, err)
	return k, m
}

// newRedisClient returns a client of addr, closed with the test, that gives
// up on an unreachable server within milliseconds.
func newRedisClient(t testing.TB, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{
		Addr: addr, MaxRetries: 1, DialTimeout: time.Second,
		MaxRetryBackoff: 16 * time.Millisecond, DialerRetryTimeout: 5 * time.Millisecond,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

// startRedis starts redis-server on a free loopback port in a temporary
// directory, waits until it answers PING, stops it with the test, and
// returns its address. Without redis-server on PATH the test is skipped, or
// fails when IDEM_REQUIRE_REDIS=1. (The core's internal/redistest is
// internal to its module.)
func startRedis(t testing.TB) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("IDEM_REQUIRE_REDIS") == "1" {
			t.Fatalf("redis-server not found on PATH and IDEM_REQUIRE_REDIS=1: %v", err)
		}
		t.Skipf("redis-server not found on PATH; install Redis to run this test (IDEM_REQUIRE_REDIS=1 makes this a failure)")
	}
	for try := 0; ; try++ {
		addr, err := runRedis(t, bin)
		if err == nil {
			return addr
		}
		if try == 4 {
			t.Fatalf("starting redis-server: %v", err)
		}
	}
}

// runRedis runs one redis-server and waits for it to answer.
func runRedis(t testing.TB, bin string) (string, error) {
	dir := t.TempDir()
	port := freePort(t)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	log, err := os.Create(filepath.Join(dir, "redis.log"))
	if err != nil {
		return "", err
	}
	cmd := exec.Command(bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
		"--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		return "", err
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	stop := func() {
		_ = cmd.Process.Kill()
		<-exited
		log.Close()
	}
	if err := awaitPing(addr, exited); err != nil {
		stop()
		return "", err
	}
	t.Cleanup(stop)
	return addr, nil
}

// awaitPing polls addr with PING for up to 10s, or until exited is closed.
func awaitPing(addr string, exited <-chan struct{}) error {
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer c.Close()
	var err error
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		err = c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("redis-server on %s exited", addr)
		default:
		}
	}
	return fmt.Errorf("redis-server on %s did not answer PING: %w", addr, err)
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
