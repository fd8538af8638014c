package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestPreciseSleeperHasATimerfd(t *testing.T) {
	s := newPreciseSleeper()
	defer s.close()
	assert.NotNil(t, s.f, "timerfd_create failed: the paced waits would wake as late as Go timers do")
}
