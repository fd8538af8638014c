package main

import (
	"os"
	"syscall"
	"time"
	"unsafe"
)

// preciseSleeper sleeps to within a tenth of a millisecond or so, where a Go
// timer, when the process has nothing else to do, waits for epoll_wait's
// timeout in whole milliseconds and wakes up to a millisecond late. It
// reads a timerfd(2) through the runtime's poller: the goroutine parks, as
// one waiting on a socket does (its P free for others), and epoll wakes it
// when the timer fires. Without a timerfd it sleeps as time.Sleep does.
type preciseSleeper struct {
	// f reads the timerfd, whose descriptor is fd: os.File.Fd would set
	// it blocking, out of the poller.
	f   *os.File
	fd  uintptr
	buf [8]byte
}

// The constants of timerfd_create(2).
const (
	clockMonotonic = 1
	tfdNonblock    = syscall.O_NONBLOCK
	tfdCloexec     = syscall.O_CLOEXEC
)

// itimerspec is timerfd_settime(2)'s struct itimerspec.
type itimerspec struct {
	interval, value syscall.Timespec
}

func newPreciseSleeper() *preciseSleeper {
	fd, _, errno := syscall.Syscall(syscall.SYS_TIMERFD_CREATE, clockMonotonic, tfdNonblock|tfdCloexec, 0)
	if errno != 0 {
		return &preciseSleeper{}
	}
	// A non-blocking descriptor: os.NewFile hands it to the poller.
	return &preciseSleeper{f: os.NewFile(fd, "timerfd"), fd: fd}
}

// sleep sleeps for d.
func (s *preciseSleeper) sleep(d time.Duration) {
	if d <= 0 {
		return
	}
	if s.f != nil {
		its := itimerspec{value: syscall.NsecToTimespec(int64(d))}
		_, _, errno := syscall.Syscall6(syscall.SYS_TIMERFD_SETTIME, s.fd, 0, uintptr(unsafe.Pointer(&its)), 0, 0, 0)
		if errno == 0 {
			if _, err := s.f.Read(s.buf[:]); err == nil {
				return
			}
		}
	}
	time.Sleep(d)
}

// close releases the timerfd.
func (s *preciseSleeper) close() {
	if s.f != nil {
		_ = s.f.Close()
		s.f = nil
	}
}
