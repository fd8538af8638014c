//go:build linux

package redistest

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// holderEnv, set in the environment of a test binary this file starts
// again, makes the test it runs a holder: it starts a server and a small
// Cluster, prints "server PID PORT" for each and "ready", then sleeps until
// it is killed or its -test.timeout ends it, without running a cleanup.
const holderEnv = "REDISTEST_HOLDER"

// TestServersDieWithAKilledTest: a test binary killed by SIGKILL runs no
// t.Cleanup; every redis-server it started dies with it all the same.
func TestServersDieWithAKilledTest(t *testing.T) {
	if os.Getenv(holderEnv) != "" {
		holdServers(t)
		return
	}
	Binary(t, "redis-server")
	dir := t.TempDir()
	h := startHolder(t, "^TestServersDieWithAKilledTest$", dir, 2*time.Minute)
	if !h.ready {
		t.Fatalf("the holder started no servers: %v\n%s", h.err, h.stderr)
	}
	if err := h.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = h.cmd.Wait()
	assertGone(t, dir, h.servers)
}

// TestServersDieWithATimedOutTest: a test binary ended by go test's own
// -timeout panic runs no t.Cleanup; every redis-server it started dies with
// it all the same.
func TestServersDieWithATimedOutTest(t *testing.T) {
	if os.Getenv(holderEnv) != "" {
		holdServers(t)
		return
	}
	Binary(t, "redis-server")
	// The holder's -test.timeout must end it after its servers are up: a
	// loaded machine may need longer than the first try gives.
	for _, timeout := range []time.Duration{8 * time.Second, 40 * time.Second} {
		dir := t.TempDir()
		h := startHolder(t, "^TestServersDieWithATimedOutTest$", dir, timeout)
		err := h.cmd.Wait() // ended by its own -test.timeout
		if !strings.Contains(h.stderr.String(), "test timed out") {
			t.Fatalf("the holder ended by %v, not by its -test.timeout:\n%s", err, h.stderr)
		}
		assertGone(t, dir, h.servers)
		if h.ready {
			return
		}
		t.Logf("the holder's %v timeout ended it before all its servers were up; trying a longer one", timeout)
	}
	t.Fatal("the holder never started all its servers before its -test.timeout")
}

// holdServers is the holder's side: the servers, their PIDs, then sleep
// (not select {}, which the runtime ends as a deadlock).
func holdServers(t *testing.T) {
	say := func(s *Server) {
		s.mu.Lock()
		fmt.Printf("server %d %d\n", s.cmd.Process.Pid, s.Port)
		s.mu.Unlock()
	}
	say(Start(t))
	for _, s := range StartCluster(t, 2, 1).Nodes() {
		say(s)
	}
	fmt.Println("ready")
	time.Sleep(time.Hour)
}

type holder struct {
	cmd     *exec.Cmd
	servers map[int]int // PID to port
	ready   bool        // every server was printed
	err     error       // why reading stopped before "ready"
	stderr  *bytes.Buffer
}

// startHolder runs this test binary again as a holder of servers, with
// TMPDIR in dir, and reads what it prints until "ready" or its end.
func startHolder(t *testing.T, run, dir string, timeout time.Duration) *holder {
	t.Helper()
	h := &holder{servers: map[int]int{}, stderr: &bytes.Buffer{}}
	h.cmd = exec.Command(os.Args[0], "-test.run="+run, "-test.timeout="+timeout.String())
	h.cmd.Env = append(os.Environ(), holderEnv+"=1", "TMPDIR="+dir)
	h.cmd.Stderr = h.stderr
	out, err := h.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = h.cmd.Process.Kill()
		for pid := range h.servers { // only if one survived a failed check
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	lines := bufio.NewScanner(out)
	for lines.Scan() {
		f := strings.Fields(lines.Text())
		if len(f) == 1 && f[0] == "ready" {
			h.ready = true
			break
		}
		if len(f) == 3 && f[0] == "server" {
			pid, _ := strconv.Atoi(f[1])
			port, _ := strconv.Atoi(f[2])
			h.servers[pid] = port
		}
	}
	h.err = lines.Err()
	if len(h.servers) == 0 && !h.ready {
		t.Logf("the holder printed no server before it ended: %v", h.err)
	}
	return h
}

// assertGone fails t unless, within 5 seconds, every server is gone (its
// PID missing or a zombie, its port closed) and no live process has its
// working directory or executable under dir.
func assertGone(t *testing.T, dir string, servers map[int]int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		left := alive(dir, servers)
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("5s after the test binary died, still alive: %s", strings.Join(left, "; "))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func alive(dir string, servers map[int]int) []string {
	var left []string
	for pid, port := range servers {
		if running(pid) {
			left = append(left, fmt.Sprintf("redis-server PID %d", pid))
		}
		if c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), 100*time.Millisecond); err == nil {
			c.Close()
			left = append(left, fmt.Sprintf("a server on port %d", port))
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		pid, err := strconv.Atoi(filepath.Base(p))
		if err != nil || !running(pid) {
			continue
		}
		for _, link := range []string{"cwd", "exe"} {
			if target, err := os.Readlink(filepath.Join(p, link)); err == nil && strings.HasPrefix(target, dir+string(filepath.Separator)) {
				left = append(left, fmt.Sprintf("PID %d with its %s in %s", pid, link, target))
			}
		}
	}
	return left
}

// running reports whether pid is a process that has not exited: present in
// /proc and not a zombie.
func running(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name, which is in parentheses.
	i := bytes.LastIndexByte(stat, ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] != 'Z'
}
