package idemhttp

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tap carries what the middleware's tests wait for: every request step,
// and the claims under which a handler runs (the Keeper's own claim steps
// that claimed or recovered the key).
type tap chan idem.Event

// tapObserver is the Observer that feeds a tap. It never blocks the request
// it is told of: an event the tap has no room for is dropped and counted,
// and the test fails when it ends.
type tapObserver struct {
	ch      tap
	dropped atomic.Int64
}

// Observe implements idem.Observer.
func (o *tapObserver) Observe(_ context.Context, ev idem.Event) {
	ran := ev.Step == idem.StepClaim && (ev.Result == idem.ResultClaimed || ev.Result == idem.ResultRecovered)
	if ev.Step != idem.StepRequest && !ran {
		return
	}
	select {
	case o.ch <- ev:
	default:
		o.dropped.Add(1)
	}
}

// taps holds the tap of each Keeper built by tapped.
var taps sync.Map // *idem.Keeper -> tap

// tapped builds a Keeper with build, given the option that sets its
// Observer to a new tap, and keeps the tap for tapOf. A test that leaves
// more than the tap holds unread fails: it wants a Keeper without a tap.
func tapped(t testing.TB, build func(observe idem.Option) (*idem.Keeper, error)) *idem.Keeper {
	t.Helper()
	obs := &tapObserver{ch: make(tap, 4096)}
	k, err := build(idem.WithObserver(obs))
	require.NoError(t, err)
	taps.Store(k, obs.ch)
	t.Cleanup(func() {
		taps.Delete(k)
		assert.Zero(t, obs.dropped.Load(), "events dropped: the tap was left unread; build this Keeper without one")
	})
	return k
}

// tapOf returns the tap of k, which tapped must have built.
func tapOf(t testing.TB, k *idem.Keeper) tap {
	t.Helper()
	ch, ok := taps.Load(k)
	require.True(t, ok, "the Keeper was not built by tapped")
	return ch.(tap)
}

// until returns the results of the events up to the first of result,
// included; it fails the test after ten seconds.
func (c tap) until(t testing.TB, result idem.Result) []idem.Result {
	t.Helper()
	var seen []idem.Result
	for {
		ev := awaitAny(t, c)
		seen = append(seen, ev.Result)
		if ev.Result == result {
			return seen
		}
	}
}

// drain returns the results of the events told so far and not read.
func (c tap) drain() []idem.Result {
	var seen []idem.Result
	for {
		select {
		case ev := <-c:
			seen = append(seen, ev.Result)
		default:
			return seen
		}
	}
}

// awaitAny returns the next event of c; it fails the test after ten
// seconds.
func awaitAny(t testing.TB, c tap) idem.Event {
	t.Helper()
	select {
	case ev := <-c:
		return ev
	case <-time.After(10 * time.Second):
		require.FailNow(t, "timed out", "no event")
		return idem.Event{}
	}
}
