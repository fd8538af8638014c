//go:build unix

package main

import "syscall"

// processCPU returns the CPU time this process has used so far, user plus
// system, in microseconds (getrusage RUSAGE_SELF: every thread, the garbage
// collector's included).
func processCPU() (usec int64, ok bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return ru.Utime.Nano()/1000 + ru.Stime.Nano()/1000, true
}
