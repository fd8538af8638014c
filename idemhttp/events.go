package idemhttp

import (
	"context"
	"errors"
	"time"

	"github.com/idemkit/idem"
)

// report is the idem.StepRequest event of one guarded request, filled in as
// the request goes, and told to the Keeper's Observer once it is answered.
type report struct {
	on      bool // the Keeper has an Observer; else nothing is measured
	ev      idem.Event
	ctx     context.Context
	started time.Time
	ran     time.Time // when the handler started under a claim; zero if it did not
}

// newReport starts the report of a request with ctx.
func (m *middleware) newReport(ctx context.Context) report {
	if !m.k.Observing() {
		return report{}
	}
	return report{on: true, ev: idem.Event{Step: idem.StepRequest}, ctx: ctx, started: time.Now()}
}

// emit tells the Keeper's Observer the request's outcome: result, with the
// status answered (0 when unknown) and the error behind it.
func (m *middleware) emit(rep *report, result idem.Result, status int, err error) {
	if !rep.on {
		return
	}
	rep.ev.Result, rep.ev.Status, rep.ev.Err = result, status, err
	now := time.Now()
	rep.ev.Took = now.Sub(rep.started)
	if !rep.ran.IsZero() {
		rep.ev.Held = now.Sub(rep.ran)
	}
	m.k.Report(rep.ctx, rep.ev)
}

// errPanicked is the Err of the ResultReleased of a panicking handler.
var errPanicked = errors.New("idem: the handler panicked; the key was released")
