package idemjetstream_test

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
	"github.com/idemkit/idem/internal/proc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
)

// The tests start their own servers: nats-server with JetStream for every
// test that consumes, redis-server for the kill test and the benchmark
// (miniredis for the others). Each runs on a free loopback port in a
// temporary directory and is stopped in Cleanup. A missing server skips the
// test with a message; IDEM_REQUIRE_NATS=1 (or IDEM_REQUIRE_REDIS=1) makes
// it a failure, as CI (.ci/run) does.

// binary returns the path of a server program, or skips (fails, when
// require names a variable set to 1) tb.
func binary(tb testing.TB, name, require string, also ...string) string {
	tb.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		for _, a := range also {
			if _, serr := os.Stat(a); serr == nil {
				return a
			}
		}
		if os.Getenv(require) == "1" {
			tb.Fatalf("%s not found on PATH and %s=1: %v", name, require, err)
		}
		tb.Skipf("%s not found on PATH; install it to run this test (%s=1 makes this a failure)", name, require)
	}
	return p
}

// startServer starts bin with args(port, dir) on a free port, its output
// in dir/server.log, and waits until ready(addr) answers nil; it stops the
// server (SIGKILL) in Cleanup.
func startServer(tb testing.TB, bin string, args func(port int, dir string) []string, ready func(addr string) error) string {
	tb.Helper()
	var last error
	for try := 0; try < 5; try++ {
		dir, port := tb.TempDir(), redistest.FreePort(tb)
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		log, err := os.Create(filepath.Join(dir, "server.log"))
		if err != nil {
			tb.Fatal(err)
		}
		cmd := exec.Command(bin, args(port, dir)...)
		cmd.Dir, cmd.Stdout, cmd.Stderr = dir, log, log
		if err := proc.Start(cmd); err != nil {
			tb.Fatalf("starting %s: %v", bin, err)
		}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		stop := func() { _ = cmd.Process.Kill(); <-exited; log.Close() }
		if last = waitReady(addr, exited, ready); last == nil {
			tb.Cleanup(stop)
			return addr
		}
		stop()
		b, _ := os.ReadFile(filepath.Join(dir, "server.log"))
		last = fmt.Errorf("%w; its log: %s", last, b)
	}
	tb.Fatalf("starting %s: %v", bin, last)
	return ""
}

func waitReady(addr string, exited chan struct{}, ready func(addr string) error) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := ready(addr)
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("the server exited: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the server on %s is not ready: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startNATS starts nats-server with JetStream and returns its URL.
func startNATS(tb testing.TB) string {
	tb.Helper()
	bin := binary(tb, "nats-server", "IDEM_REQUIRE_NATS", "/usr/sbin/nats-server")
	addr := startServer(tb, bin, func(port int, dir string) []string {
		return []string{"-js", "-sd", dir, "-a", "127.0.0.1", "-p", strconv.Itoa(port)}
	}, func(addr string) error {
		nc, err := nats.Connect("nats://"+addr, nats.Timeout(500*time.Millisecond))
		if err != nil {
			return err
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err = js.AccountInfo(ctx)
		return err
	})
	return "nats://" + addr
}

// connect returns a JetStream context on url, its connection closed in
// Cleanup.
func connect(tb testing.TB, url string) (*nats.Conn, jetstream.JetStream) {
	tb.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatal(err)
	}
	return nc, js
}

// miniKeeper returns a Keeper on a miniredis, and the client on it.
func miniKeeper(tb testing.TB, opts ...idem.Option) (*idem.Keeper, *redis.Client) {
	tb.Helper()
	mr := miniredis.RunT(tb)
	c := redistest.NewClient(tb, mr.Addr())
	k, err := idem.NewRedis(c, opts...)
	if err != nil {
		tb.Fatal(err)
	}
	return k, c
}

// stream creates a stream of one subject and a durable pull consumer on it.
func stream(tb testing.TB, js jetstream.JetStream, name string, scfg jetstream.StreamConfig, ccfg jetstream.ConsumerConfig) jetstream.Consumer {
	tb.Helper()
	ctx := context.Background()
	scfg.Name, scfg.Subjects = name, []string{name + ".>"}
	s, err := js.CreateStream(ctx, scfg)
	if err != nil {
		tb.Fatal(err)
	}
	if ccfg.Durable == "" {
		ccfg.Durable = "worker"
	}
	c, err := s.CreateOrUpdateConsumer(ctx, ccfg)
	if err != nil {
		tb.Fatal(err)
	}
	return c
}
