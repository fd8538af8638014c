package proc

import (
	"errors"
	"os/exec"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The main goroutine keeps the main thread to itself, so that every
// goroutine of a test runs on threads the runtime may end: a goroutine that
// returns locked on the main thread only parks it, and a child forked there
// would outlive a broken Start by chance.
func init() { runtime.LockOSThread() }

// TestChildOutlivesTheThreadsOfOthers: the child lives as long as this
// process does, while other goroutines end the threads they locked (each
// such return ends an OS thread, which would kill a child forked from it),
// and the caller's Wait still reaps it with its real status.
func TestChildOutlivesTheThreadsOfOthers(t *testing.T) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skipf("no sleep on PATH: %v", err)
	}
	cmd := exec.Command(sleep, "60")
	if err := Start(cmd); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	for round := 0; round < 20; round++ {
		var wg sync.WaitGroup
		for i := 0; i < 8; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				runtime.LockOSThread() // returning locked ends the thread
			}()
		}
		wg.Wait()
		select {
		case err := <-exited:
			t.Fatalf("the child exited while this process lives: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}

	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err = <-exited
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("Wait after SIGKILL: %v, want an exit error", err)
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("Wait reaped %v, want killed by SIGKILL", ee)
	}
}

// TestStartFailsAsCmdStartDoes: a program that cannot be started is
// reported by Start, and no goroutine is left waiting.
func TestStartFailsAsCmdStartDoes(t *testing.T) {
	err := Start(exec.Command("/nonexistent/program"))
	if err == nil {
		t.Fatal("Start of a missing program succeeded")
	}
}
