package httpapi_test

import (
	"encoding/json"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/orderdelay/orderdelay/internal/httpapi"
)

// problem is an RFC 9457 problem details body, with the extension members
// the API uses.
type problem struct {
	Type       string `json:"type"`
	Title      string `json:"title"`
	Status     int    `json:"status"`
	Detail     string `json:"detail"`
	Field      string `json:"field"`
	Queue      string `json:"queue"`
	MaxPending *int   `json:"max_pending"`
	ID         string `json:"id"`
	Acked      *int   `json:"acked"`
	Expired    *int   `json:"expired"`
	Invalid    []any  `json:"invalid"`
	Tasks      []any  `json:"tasks"`
}

// wantProblem checks that r is an RFC 9457 problem (application/problem+json)
// with status code, problem type typ (about:blank: title is the status
// text) and a non-empty detail, and returns it.
func wantProblem(t *testing.T, r reply, code int, typ string) problem {
	t.Helper()
	var p problem
	if r.code != code {
		t.Errorf("status = %d (body %s), want %d", r.code, r.raw, code)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("Content-Type = %q, want application/problem+json", ct)
	}
	var members map[string]json.RawMessage
	if err := json.Unmarshal([]byte(r.raw), &members); err != nil {
		t.Fatalf("body %q is not a JSON object: %v", r.raw, err)
	}
	for _, m := range []string{"type", "title", "status", "detail"} {
		if _, ok := members[m]; !ok {
			t.Errorf("body %s has no %q member", r.raw, m)
		}
	}
	if err := json.Unmarshal([]byte(r.raw), &p); err != nil {
		t.Fatalf("body %q: %v", r.raw, err)
	}
	if p.Status != r.code {
		t.Errorf("status member %d, response status %d", p.Status, r.code)
	}
	if p.Type != typ {
		t.Errorf("type = %q, want %q (body %s)", p.Type, typ, r.raw)
	}
	if p.Type == "about:blank" && p.Title != http.StatusText(code) {
		t.Errorf("about:blank title = %q, want the status text %q", p.Title, http.StatusText(code))
	}
	if p.Title == "" || p.Detail == "" {
		t.Errorf("body %s: want a title and a detail", r.raw)
	}
	return p
}

// Every error is one shape, RFC 9457 problem details: the status again,
// a type (about:blank when the status says it all), a title, the detail,
// and extension members where the client can act on them, such as the
// field a 400 refuses.
func TestErrorsAreProblemDetails(t *testing.T) {
	e := newOpsAPI(t, true)
	const p, a = opsProducerToken, opsAdminToken
	cases := []struct {
		name, token, method, path, body string
		code                            int
		typ, field                      string
	}{
		{"bad duration", p, http.MethodPut, "/v1/timeouts/ord", `{"after":"soon"}`, 400, httpapi.ProblemInvalidRequest, "after"},
		{"bad JSON", p, http.MethodPut, "/v1/timeouts/ord", `{"after":`, 400, httpapi.ProblemInvalidRequest, "body"},
		{"bad limit", p, http.MethodGet, "/v1/queues/jobs/tasks?limit=0", "", 400, httpapi.ProblemInvalidRequest, "limit"},
		{"bad wait", p, http.MethodPost, "/v1/queues/jobs/poll?wait=forever", "", 400, httpapi.ProblemInvalidRequest, "wait"},
		{"admin bad JSON", a, http.MethodPost, "/admin/v1/pause", `{`, 400, httpapi.ProblemInvalidRequest, "body"},
		{"no token", "", http.MethodGet, "/v1/timeouts/ord", "", 401, "about:blank", ""},
		{"producer token on admin", p, http.MethodGet, "/admin/v1/pause", "", 401, "about:blank", ""},
		{"unknown serial", p, http.MethodGet, "/v1/timeouts/ord", "", 404, "about:blank", ""},
		{"unknown endpoint", p, http.MethodGet, "/v1/nothing", "", 404, "about:blank", ""},
		{"unknown queue", p, http.MethodGet, "/v1/queues/nope/stats", "", 404, "about:blank", ""},
		{"unknown path outside the API", "", http.MethodGet, "/nothing", "", 404, "about:blank", ""},
		{"wrong method on a probe", "", http.MethodPost, "/healthz", "", 405, "about:blank", ""},
		{"oversized", p, http.MethodPut, "/v1/timeouts/ord", `{"after":"30m"}` + strings.Repeat(" ", httpapi.MaxBodyBytes), 413, "about:blank", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := wantProblem(t, e.call(t, c.token, c.method, c.path, c.body), c.code, c.typ)
			if got.Field != c.field {
				t.Errorf("field = %q, want %q", got.Field, c.field)
			}
		})
	}
	t.Run("405 says what is allowed", func(t *testing.T) {
		if allow := e.call(t, "", http.MethodPost, "/healthz", "").header.Get("Allow"); !strings.Contains(allow, "GET") {
			t.Errorf("Allow = %q, want GET in it", allow)
		}
	})
	t.Run("not polled", func(t *testing.T) {
		got := wantProblem(t, e.call(t, p, http.MethodPost, "/v1/queues/confirm/poll", ""), 409, httpapi.ProblemNotPolled)
		if got.Queue != "confirm" {
			t.Errorf("queue = %q, want confirm", got.Queue)
		}
	})
	t.Run("lease lost", func(t *testing.T) {
		body := `{"token":"poll.` + strings.Repeat("A", 26) + `","ids":["x-1"]}`
		got := wantProblem(t, e.call(t, p, http.MethodPost, "/v1/queues/jobs/ack", body), 409, httpapi.ProblemLeaseLost)
		if got.Acked == nil || *got.Acked != 0 || got.Expired == nil || *got.Expired != 1 {
			t.Errorf("acked %v, expired %v; want 0 and 1", got.Acked, got.Expired)
		}
	})
}

// Each problem type's URI leads to its own section of docs/api.md, and the
// OpenAPI document gives each a schema.
func TestProblemTypesAreDocumented(t *testing.T) {
	docs, err := os.ReadFile("../../docs/api.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, typ := range []string{httpapi.ProblemInvalidRequest, httpapi.ProblemInvalidTasks, httpapi.ProblemQueueFull,
		httpapi.ProblemNotPolled, httpapi.ProblemLeaseLost, httpapi.ProblemIdempotencyKeyReused, httpapi.ProblemBatchInterrupted} {
		name, ok := strings.CutPrefix(typ, httpapi.ProblemTypeBase)
		if !ok || !strings.HasPrefix(httpapi.ProblemTypeBase, "https://github.com/orderdelay/orderdelay/blob/main/docs/api.md#") {
			t.Fatalf("%s is not under docs/api.md", typ)
		}
		if !strings.Contains(string(docs), "\n### "+name+"\n") {
			t.Errorf("docs/api.md has no section %q for %s", "### "+name, typ)
		}
		if !strings.Contains(string(httpapi.OpenAPIYAML()), "const: "+typ+"\n") {
			t.Errorf("openapi.yaml has no schema for %s", typ)
		}
	}
}
