package idemgrpc

import (
	"context"
	"time"

	"github.com/idemkit/idem"
	"google.golang.org/grpc/status"
)

// report is the idem.StepRequest event of one guarded call, filled in as
// the call goes, and told to the Keeper's Observer once it is answered.
type report struct {
	on      bool // the Keeper has an Observer; else nothing is measured
	k       *idem.Keeper
	ev      idem.Event
	ctx     context.Context
	started time.Time
	ran     time.Time // when the handler started under a claim; zero if it did not
}

// newReport starts the report of a call with ctx on k.
func newReport(k *idem.Keeper, ctx context.Context) report {
	if !k.Observing() {
		return report{}
	}
	return report{on: true, k: k, ev: idem.Event{Step: idem.StepRequest}, ctx: ctx, started: time.Now()}
}

// answer tells the Keeper's Observer the call's outcome, result with the
// error behind it (cause), and the code of answer, the call's error; it
// returns answer.
func (r *report) answer(result idem.Result, cause, answer error) error {
	if !r.on {
		return answer
	}
	r.ev.Result, r.ev.Err, r.ev.Status = result, cause, int(status.Code(answer))
	now := time.Now()
	r.ev.Took = now.Sub(r.started)
	if !r.ran.IsZero() {
		r.ev.Held = now.Sub(r.ran)
	}
	r.k.Report(r.ctx, r.ev)
	return answer
}
