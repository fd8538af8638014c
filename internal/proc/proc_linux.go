package proc

import (
	"os/exec"
	"runtime"
	"syscall"
	"unsafe"
)

// The kernel sends the parent-death signal (PR_SET_PDEATHSIG) when the
// thread that forked the child ends, not when the process does. The Go
// runtime ends a thread when a goroutine locked to it returns, and moves
// other goroutines between threads freely, so the child is started from a
// goroutine that locks its thread and stays on it, blocked until the child
// has exited. Locking only around cmd.Start, or letting that goroutine
// return, kills the child as soon as the runtime ends or reuses the thread.
func start(cmd *exec.Cmd) error {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	if cmd.SysProcAttr.Pdeathsig == 0 {
		cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	}
	started := make(chan error, 1)
	go func() {
		// Never unlocked: when this goroutine returns, the child has exited
		// and the runtime may end the thread.
		runtime.LockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		waitExited(cmd.Process.Pid)
	}()
	return <-started
}

const pPID = 1 // idtype_t P_PID of waitid(2)

// waitExited blocks until the child pid has exited, without reaping it
// (WNOWAIT), so that the caller's cmd.Wait still collects its status. It
// returns at once if pid is no longer a child to wait for (ECHILD: it was
// reaped already).
func waitExited(pid int) {
	var info [128]byte // siginfo_t
	for {
		_, _, errno := syscall.Syscall6(syscall.SYS_WAITID, pPID, uintptr(pid),
			uintptr(unsafe.Pointer(&info[0])), syscall.WEXITED|syscall.WNOWAIT, 0, 0)
		if errno != syscall.EINTR {
			return
		}
	}
}
