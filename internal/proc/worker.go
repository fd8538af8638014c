package proc

import (
	"os"
	"os/exec"
	"strings"
)

// TB is what StartWorker needs of a test (testing.TB has it), named here
// so that the commands that start servers through this package do not
// link the testing package.
type TB interface {
	Helper()
	Fatal(args ...any)
	Cleanup(func())
}

// Worker is the running test binary started again as a worker process of a
// test (a kill test's consumer): StartWorker starts it, and the test's
// Cleanup kills it and waits for it.
type Worker struct {
	Cmd *exec.Cmd
	// Done is closed once the process has exited; Err (what Wait returned)
	// and Out (its stdout and stderr) are read after that.
	Done chan struct{}
	Err  error
	Out  *strings.Builder
}

// StartWorker runs the test binary again with env added to this process's
// environment and no test selected (-test.run=^$), so that its TestMain,
// which reads env, runs the worker instead. It starts it with Start (it
// dies with this process), and stops it, if it still runs, in tb's
// Cleanup.
func StartWorker(tb TB, env ...string) *Worker {
	tb.Helper()
	exe, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	w := &Worker{Cmd: exec.Command(exe, "-test.run=^$"), Done: make(chan struct{}), Out: &strings.Builder{}}
	w.Cmd.Env = append(os.Environ(), env...)
	w.Cmd.Stdout, w.Cmd.Stderr = w.Out, w.Out
	if err := Start(w.Cmd); err != nil {
		tb.Fatal(err)
	}
	go func() { w.Err = w.Cmd.Wait(); close(w.Done) }()
	tb.Cleanup(func() {
		_ = w.Cmd.Process.Kill()
		<-w.Done
	})
	return w
}
