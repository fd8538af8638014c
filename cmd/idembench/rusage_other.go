//go:build !unix

package main

// processCPU reports that this platform's process CPU time is not read.
func processCPU() (usec int64, ok bool) { return 0, false }
