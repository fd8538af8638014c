package idemhttp

import (
	"errors"
	"net/http"
	"strconv"
)

// RefusedError is an error with which a scope function (WithScope) or a key
// function (WithKeyFunc) refuses a request: the middleware answers Status with
// an application/problem+json body whose detail is Detail (with
// WithErrorWriter, the writer's body, given Detail as Refusal.Detail). The
// handler does not run, Redis is not touched, and the Keeper's Observer is
// told of a StepRequest with ResultRefused and the error. A function may
// return any other error: that answers 400 with a generic detail.
type RefusedError struct {
	// Status is the status answered, from 400 to 599; any other value, zero
	// included, answers 400.
	Status int
	// Detail is the problem's detail, shown to the client; empty: a generic
	// sentence.
	Detail string
	// Err is the cause, for the Observer (idem.Event.Err) and logs; it is not shown to
	// the client. May be nil.
	Err error
}

// Refuse returns a *RefusedError that answers status with detail.
func Refuse(status int, detail string) error {
	return &RefusedError{Status: status, Detail: detail}
}

// Error implements error.
func (e *RefusedError) Error() string {
	msg := "idemhttp: request refused (" + strconv.Itoa(e.status()) + ")"
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Unwrap returns the cause.
func (e *RefusedError) Unwrap() error { return e.Err }

// status is the status answered: Status, or 400 when it is not an error
// status.
func (e *RefusedError) status() int {
	if e.Status >= 400 && e.Status <= 599 {
		return e.Status
	}
	return http.StatusBadRequest
}

// refusedProblem is the answer to a request that a scope or key function
// refused with err: a problem of type typ, with the status and detail of a
// *RefusedError, else 400 and the generic detail; err's own text is never
// shown to the client.
func refusedProblem(err error, typ, detail string) problem {
	p := problem{Type: typ, Title: "Request refused", Status: http.StatusBadRequest, Detail: detail}
	var re *RefusedError
	if errors.As(err, &re) {
		p.Status = re.status()
		if re.Detail != "" {
			p.Detail = re.Detail
		}
	}
	return p
}
