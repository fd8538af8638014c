//go:build !linux

package main

import "time"

// preciseSleeper sleeps as precisely as a Go timer does on this platform.
type preciseSleeper struct{}

func newPreciseSleeper() *preciseSleeper { return &preciseSleeper{} }

// sleep sleeps for d.
func (*preciseSleeper) sleep(d time.Duration) { time.Sleep(d) }

// close does nothing.
func (*preciseSleeper) close() {}
