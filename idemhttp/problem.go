package idemhttp

import (
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/idemkit/idem"
)

// The problem types of the middleware's own answers: the "type" member of
// their RFC 9457 application/problem+json bodies. Clients can match on them.
const (
	// ProblemKeyMissing (400): a guarded request without the key header,
	// while the key is required.
	ProblemKeyMissing = "https://github.com/idemkit/idem/problems/key-missing"
	// ProblemKeyInvalid (400): the key is empty, longer than MaxKeyLen bytes,
	// holds control characters, is a malformed quoted string, or the header
	// appears more than once.
	ProblemKeyInvalid = "https://github.com/idemkit/idem/problems/key-invalid"
	// ProblemBodyUnreadable (400): the request body could not be read.
	ProblemBodyUnreadable = "https://github.com/idemkit/idem/problems/body-unreadable"
	// ProblemBodyTooLarge (413): the request body is larger than the limit
	// read to fingerprint it.
	ProblemBodyTooLarge = "https://github.com/idemkit/idem/problems/body-too-large"
	// ProblemInProgress (409): another request with the key is still being
	// handled; Retry-After says when to ask again (see WithRetryAfter).
	ProblemInProgress = "https://github.com/idemkit/idem/problems/in-progress"
	// ProblemMismatch (422): the key was first used with another request
	// (another fingerprint).
	ProblemMismatch = "https://github.com/idemkit/idem/problems/key-reused"
	// ProblemUnavailable (503): the store could not be reached; the handler
	// did not run.
	ProblemUnavailable = "https://github.com/idemkit/idem/problems/store-unavailable"
	// ProblemResultExpired (410): a request with the key ran and completed,
	// and its response is no longer kept: all that is left of it is the
	// fact (idem.ErrResultExpired, a marker past the retention), or it was
	// completed with nothing to replay (a consumer's message under the same
	// key). The handler did not run again; send a new key for a new request.
	ProblemResultExpired = "https://github.com/idemkit/idem/problems/result-expired"
	// ProblemCorrupt (500): the record of the key cannot be read; nothing was
	// run or overwritten.
	ProblemCorrupt = "https://github.com/idemkit/idem/problems/record-corrupt"
	// ProblemCanceled (499, StatusClientClosedRequest): the request was
	// cancelled (its client went away) before its key could be checked; the
	// handler did not run.
	ProblemCanceled = "https://github.com/idemkit/idem/problems/request-canceled"
	// ProblemScopeRefused (the status the error names, default 400): the
	// scope function refused the request (WithScope), for example because it
	// has no tenant; the handler did not run.
	ProblemScopeRefused = "https://github.com/idemkit/idem/problems/scope-refused"
	// ProblemKeyRefused (the status the error names, default 400): the key
	// function refused the request (WithKeyFunc), for example because its
	// signature does not verify; the handler did not run.
	ProblemKeyRefused = "https://github.com/idemkit/idem/problems/key-refused"
	// ProblemBodyNotKept (the stored status): a replay of a response whose
	// body was too large to keep or was streamed. The stored status and
	// headers are replayed; the body is this problem (with WithErrorWriter,
	// what the writer writes).
	ProblemBodyNotKept = "https://github.com/idemkit/idem/problems/body-not-kept"
	// ProblemExecutionFailed (500): the handler called ExecutionBegan, then
	// panicked, or returned without an answer after its client went away.
	// This answer is stored in place of its response and replayed to every
	// retry with the key; the handler is not run again.
	ProblemExecutionFailed = "https://github.com/idemkit/idem/problems/execution-failed"
)

// Refusal is one answer the middleware gives itself in place of the
// handler's: a request it refused (a missing or unusable key, a body over
// the limit, a key in progress or reused, a store it cannot reach, a record
// it cannot read, a scope or key function's refusal, a client gone), or the
// body of a replay whose response body was not kept (ProblemBodyNotKept),
// or the 500 stored for a handler that failed after ExecutionBegan
// (ProblemExecutionFailed, Result idem.ResultDone).
// The error writer (WithErrorWriter) renders it; WriteProblem, the default,
// renders it as RFC 9457 application/problem+json.
type Refusal struct {
	// Status is the HTTP status the middleware chose: 400, 409, 410, 413,
	// 422, 499 (StatusClientClosedRequest), 500, 503, or the status a
	// *RefusedError names; for ProblemBodyNotKept, the replayed response's
	// stored status, which may be a success (201) or allow no body (204,
	// 304).
	Status int
	// Type is the kind of answer: one of the Problem constants. Several
	// results share one type (ProblemInProgress is answered for
	// idem.ResultInProgress and for idem.ResultLeaseLost).
	Type string
	// Title is a short summary of Type, the same for every answer of a
	// type ("Request in progress").
	Title string
	// Detail says, in English, what happened to this request and what the
	// client should do; it never holds the text of a scope or key
	// function's error other than a *RefusedError's Detail.
	Detail string
	// Result is what the request came to, as the Keeper's Observer is
	// told of it (idem.ResultMismatch, idem.ResultInProgress, ...;
	// idem.ResultReplayed for ProblemBodyNotKept).
	Result idem.Result
	// Err is the cause, for logs: the store's error, the scope function's,
	// idem.ErrMismatch, ...; nil when there is none (a missing key, a
	// replay). Its text is not meant for the client.
	Err error
}

// WriteProblem is the default error writer (see WithErrorWriter): it
// answers ref as an RFC 9457 application/problem+json body with type,
// title, status and detail, and X-Content-Type-Options: nosniff, with
// ref.Status; a status that allows no body (1xx, 204, 304) is answered
// with no body and no Content-Type. The headers already on w (Retry-After,
// a replay's) are kept. An error writer may call it for the answers it
// does not render itself.
func WriteProblem(w http.ResponseWriter, r *http.Request, ref Refusal) {
	writeProblem(w, problem{Type: ref.Type, Title: ref.Title, Status: ref.Status, Detail: ref.Detail})
}

// problem is an RFC 9457 problem details object.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
}

// writeProblem answers p as application/problem+json with p.Status.
func writeProblem(w http.ResponseWriter, p problem) {
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("X-Content-Type-Options", "nosniff")
	if !bodyAllowed(p.Status) {
		h.Del("Content-Type")
		w.WriteHeader(p.Status)
		return
	}
	body, _ := json.Marshal(p) // strings and an int: cannot fail
	body = append(body, '\n')
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(p.Status)
	_, _ = w.Write(body)
}

// answerWriter is the ResponseWriter given to an error writer of the user's:
// a body written without a status answers status, never an implicit 200.
type answerWriter struct {
	http.ResponseWriter
	status int  // the Refusal's
	wrote  bool // a final status was written
}

func (a *answerWriter) WriteHeader(status int) {
	if status >= 200 {
		a.wrote = true
	}
	a.ResponseWriter.WriteHeader(status)
}

func (a *answerWriter) Write(b []byte) (int, error) {
	if !a.wrote {
		a.WriteHeader(a.status)
	}
	return a.ResponseWriter.Write(b)
}

// Unwrap gives http.ResponseController the ResponseWriter underneath.
func (a *answerWriter) Unwrap() http.ResponseWriter { return a.ResponseWriter }
