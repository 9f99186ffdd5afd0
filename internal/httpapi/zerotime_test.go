package httpapi_test

import (
	"net/http"
	"strings"
	"testing"
)

// TestZeroAtIsNamed: {"at":"0001-01-01T00:00:00Z"} is what a Go producer
// sends when it marshals an unset time.Time. It was read as no "at" at all and answered
// "give after or at", though the body gives at. Each body with an "at"
// names the field and says it is the zero time; nothing is written.
func TestZeroAtIsNamed(t *testing.T) {
	e := newOpsAPI(t, true)
	const zero = `{"at":"0001-01-01T00:00:00Z"}`
	for _, c := range []struct{ method, path, body string }{
		{http.MethodPut, "/v1/timeouts/zero-1", zero},
		{http.MethodPut, "/v1/queues/jobs/tasks/zero-2", zero},
		{http.MethodPost, "/v1/queues/jobs/tasks", zero},
		{http.MethodPost, "/v1/queues/jobs/tasks/batch", `{"tasks":[` + zero + `]}`},
	} {
		r := e.call(t, opsProducerToken, c.method, c.path, c.body)
		if r.code != http.StatusBadRequest || !strings.Contains(r.raw, "at") || !strings.Contains(r.raw, "zero time") {
			t.Errorf("%s %s %s: %d %s, want 400 naming at as the zero time", c.method, c.path, c.body, r.code, r.raw)
		}
	}
}
