package httpapi

import (
	"encoding/json"
	"net/http"
)

// Every error the API answers is an RFC 9457 problem details object,
// served as application/problem+json:
//
//	{"type":"about:blank","title":"Not Found","status":404,"detail":"no timeout for that serial"}
//
// type is about:blank when the status says all there is to say (its title
// is then the status text), or one of the Problem* URIs below, each with
// its own title and extension members; detail is for people. Clients
// branch on status and type, never on detail's wording.

// ProblemTypeBase starts the URI of each problem type the API defines;
// the fragment names the section of docs/api.md that explains it.
const ProblemTypeBase = "https://github.com/orderdelay/orderdelay/blob/main/docs/api.md#"

// The problem types beyond about:blank, with their extension members.
const (
	// ProblemInvalidRequest: 400, the request is malformed; "field" names
	// the body field, query parameter or header at fault when one is
	// ("body" for the body as a whole).
	ProblemInvalidRequest = ProblemTypeBase + "invalid-request"
	// ProblemInvalidTasks: 400, a batch create with invalid tasks; nothing
	// was written. "invalid" lists each by index with its error.
	ProblemInvalidTasks = ProblemTypeBase + "invalid-tasks"
	// ProblemQueueFull: 507, the queue holds its max_pending of pending
	// tasks; "queue", "max_pending", and for a batch "tasks" with each
	// task's result.
	ProblemQueueFull = ProblemTypeBase + "queue-full"
	// ProblemNotPolled: 409, a poll or an ack of a queue whose action is
	// not poll; "queue".
	ProblemNotPolled = ProblemTypeBase + "not-polled"
	// ProblemLeaseLost: 409, an ack of tasks no longer leased under the
	// token; the others were acked: "acked", "expired", "expired_ids".
	ProblemLeaseLost = ProblemTypeBase + "lease-lost"
	// ProblemIdempotencyKeyReused: 409, an Idempotency-Key used before on
	// the queue with a different payload; "id" is the task it made.
	ProblemIdempotencyKeyReused = ProblemTypeBase + "idempotency-key-reused"
	// ProblemBatchInterrupted: 503, a batch create cut short by Redis or
	// PostgreSQL; "tasks" are those written before.
	ProblemBatchInterrupted = ProblemTypeBase + "batch-interrupted"
)

var problemTitles = map[string]string{
	ProblemInvalidRequest:       "Invalid request",
	ProblemInvalidTasks:         "Invalid tasks in the batch",
	ProblemQueueFull:            "Queue full",
	ProblemNotPolled:            "Queue not polled",
	ProblemLeaseLost:            "Lease lost",
	ProblemIdempotencyKeyReused: "Idempotency-Key reused with a different payload",
	ProblemBatchInterrupted:     "Batch interrupted",
}

// writeProblem answers status code with a problem of type typ ("" for
// about:blank), detail and the extension members ext.
func writeProblem(w http.ResponseWriter, code int, typ, detail string, ext map[string]any) {
	title := problemTitles[typ]
	if typ == "" || title == "" {
		typ, title = "about:blank", http.StatusText(code)
	}
	body := make(map[string]any, len(ext)+4)
	for k, v := range ext {
		body[k] = v
	}
	body["type"], body["title"], body["status"], body["detail"] = typ, title, code, detail
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body) // the client went away; nothing to do
}

// writeError answers a problem with no extension members: an invalid
// request for 400, about:blank for any other status.
func writeError(w http.ResponseWriter, code int, msg string) {
	typ := ""
	if code == http.StatusBadRequest {
		typ = ProblemInvalidRequest
	}
	writeProblem(w, code, typ, msg, nil)
}

// writeInvalid answers 400 for a request whose field (a body field, query
// parameter or header; "body" for the body as a whole) is at fault.
func writeInvalid(w http.ResponseWriter, field, msg string) {
	writeProblem(w, http.StatusBadRequest, ProblemInvalidRequest, msg, map[string]any{"field": field})
}

// fieldError is an input error caused by one named part of the request;
// its message starts with that name, as every 400's detail does.
type fieldError struct {
	field string
	err   error
}

func (e *fieldError) Error() string { return e.field + ": " + e.err.Error() }
func (e *fieldError) Unwrap() error { return e.err }

// muxProblems serves mux, answering as problems what the ServeMux answers
// by itself in plain text: 404 for a path no route has (an unclean path
// whose clean form no route has too), 405 (with its Allow header) for a
// route's path with another method. Under /v1/ and
// /admin/ the catch-all routes answer first, after the token check: 405
// the same way, or 404 (notFound).
func muxProblems(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h, pattern := mux.Handler(r)
		if pattern != "" { // a route, or a redirect to the clean path
			mux.ServeHTTP(w, r)
			return
		}
		var rec statusOnly
		h.ServeHTTP(&rec, r)
		code, detail := rec.code, "no such endpoint: "+r.Method+" "+r.URL.Path
		if allow := rec.Header().Get("Allow"); code == http.StatusMethodNotAllowed && allow != "" {
			w.Header().Set("Allow", allow)
			detail = r.Method + " is not allowed on " + r.URL.Path + "; allowed: " + allow
		} else {
			// Anything else is a 404: the ServeMux's own one, or its
			// redirect of an unclean path ("//admin/v1/pause") to a clean
			// form no route has (pattern ""), which would land on a 404.
			code = http.StatusNotFound
		}
		writeProblem(w, code, "", detail, nil)
	})
}

// statusOnly keeps a handler's status and headers, and drops its body.
type statusOnly struct {
	header http.Header
	code   int
}

func (s *statusOnly) Header() http.Header {
	if s.header == nil {
		s.header = http.Header{}
	}
	return s.header
}
func (s *statusOnly) WriteHeader(code int)        { s.code = code }
func (s *statusOnly) Write(b []byte) (int, error) { return len(b), nil }
