package idemhttp

import (
	"errors"
	"net/http"
	"strconv"
	"time"
)

// EventKind is the outcome an Event reports.
type EventKind uint8

// The outcomes of a guarded request. A request that runs the handler reports
// EventClaimed, then one of EventStored, EventReleased, EventLeaseLost or
// EventUnavailable; every other request reports one event.
const (
	// EventClaimed: the key was claimed; the handler runs now.
	EventClaimed EventKind = iota + 1
	// EventStored: the handler's response was stored for replays.
	EventStored
	// EventReleased: the key was released after the handler, so a retry
	// runs it again: the store policy said so, the client went away, or the
	// handler panicked (Err says so).
	EventReleased
	// EventReplayed: a stored response was replayed.
	EventReplayed
	// EventConflict: another request with the key was in progress; answered
	// 409 (after waiting, with WithWait).
	EventConflict
	// EventMismatch: the key was used with another request; answered 422.
	EventMismatch
	// EventLeaseLost: the handler's claim was taken over or expired before
	// its response could be stored; the response reached the client but was
	// not stored.
	EventLeaseLost
	// EventUnavailable: the store could not be reached. Before the handler:
	// answered 503. After it: the response reached the client but could not
	// be stored or released, and the key stays in progress until its lease
	// runs out.
	EventUnavailable
	// EventFailOpen: the store could not be reached and the handler ran
	// unguarded (WithFailOpen).
	EventFailOpen
	// EventInvalid: the key was missing or malformed, or the body could not
	// be read; answered 400.
	EventInvalid
	// EventTooLarge: the request body was above the body limit; answered 413.
	EventTooLarge
	// EventCorrupt: the record could not be read; answered 500.
	EventCorrupt
	// EventCanceled: the request's context ended (the client went away)
	// before the key could be checked; the handler did not run, even with
	// WithFailOpen, and the answer is StatusClientClosedRequest, which the
	// client most likely never reads.
	EventCanceled
	// EventRefused: the scope function (WithScope) or the key function
	// (WithKeyFunc) refused the request; answered the status its error
	// names (default 400). Err is the function's error.
	EventRefused
)

var eventNames = [...]string{
	EventClaimed: "claimed", EventStored: "stored", EventReleased: "released",
	EventReplayed: "replayed", EventConflict: "conflict", EventMismatch: "mismatch",
	EventLeaseLost: "lease lost", EventUnavailable: "unavailable", EventFailOpen: "fail open",
	EventInvalid: "invalid", EventTooLarge: "too large", EventCorrupt: "corrupt",
	EventCanceled: "canceled", EventRefused: "refused",
}

// String returns the outcome's name, such as "replayed".
func (k EventKind) String() string {
	if int(k) < len(eventNames) && eventNames[k] != "" {
		return eventNames[k]
	}
	return "EventKind(" + strconv.Itoa(int(k)) + ")"
}

// Event is one outcome of a guarded request, given to the WithHook function.
type Event struct {
	Kind EventKind
	// Request is the request as the middleware received it.
	Request *http.Request
	// Key is the client's key; empty when there was none.
	Key string
	// Scope is the request's scope (WithScope), once the scope function
	// placed it; empty before, and when it refused.
	Scope string
	// Status is the status answered (refusals, replays) or the handler's
	// status (EventStored, EventReleased, EventLeaseLost and EventUnavailable
	// after the handler); zero for EventClaimed, EventFailOpen, and a panic.
	Status int
	// Token is the fencing token of the claim, or of the claim whose response
	// was replayed; zero when there is none.
	Token int64
	// Attempt and Recovered describe the claim (see Claim); zero and false
	// when there is none.
	Attempt   int
	Recovered bool
	// RetryAfter is the delay the Retry-After header of a 409 announced
	// (EventConflict): the hint of WithRetryAfter, or the lease left if
	// shorter, in whole seconds; zero otherwise.
	RetryAfter time.Duration
	// LeaseLeft is the time left on the other request's lease
	// (EventConflict); zero otherwise.
	LeaseLeft time.Duration
	// Err is the error behind the outcome, if any: the store's error, the
	// lease loss, the invalid key, the error of a scope or key function
	// that refused the request, or a note that the handler panicked.
	Err error
}

// errPanicked is the Err of the EventReleased of a panicking handler.
var errPanicked = errors.New("idem: the handler panicked; the key was released")
