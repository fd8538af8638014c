package idemhttp

import (
	"encoding/json"
	"net/http"
	"strconv"
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
	// headers are replayed; the body is this problem.
	ProblemBodyNotKept = "https://github.com/idemkit/idem/problems/body-not-kept"
)

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
