package httpapi_test

import (
	"net/http"
	"testing"
)

// TestWrongMethodOnARouteIs405: POST /v1/timeouts/X, DELETE
// /v1/queues/Q/poll or PUT /admin/v1/pause named an endpoint that exists
// with another method, yet answered 404 "no such endpoint" (the /v1/ and
// /admin/ catch-alls matched first), so a client could not tell a typo in
// the path from a wrong method. They answer 405 with an Allow header, after
// the token check, like the probes do; unknown paths stay 404.
func TestWrongMethodOnARouteIs405(t *testing.T) {
	e := newOpsAPI(t, true)
	const p, a = opsProducerToken, opsAdminToken
	for _, c := range []struct{ token, method, path, allow string }{
		{p, http.MethodPost, "/v1/timeouts/ORD-1", "DELETE, GET, HEAD, PUT"},
		{p, http.MethodDelete, "/v1/queues/jobs/poll", "POST"},
		{p, http.MethodGet, "/v1/queues/jobs/ack", "POST"},
		{a, http.MethodPut, "/admin/v1/pause", "GET, HEAD, POST"},
		{a, http.MethodGet, "/admin/v1/extend", "POST"},
		{a, http.MethodGet, "/admin/v1/queues/jobs/pause", "POST"},
	} {
		r := e.call(t, c.token, c.method, c.path, "")
		wantProblem(t, r, http.StatusMethodNotAllowed, "about:blank")
		if got := r.header.Get("Allow"); got != c.allow {
			t.Errorf("%s %s: Allow %q, want %q", c.method, c.path, got, c.allow)
		}
	}
	for _, c := range []struct{ token, method, path string }{
		{p, http.MethodGet, "/v1/timeout/ORD-1"},
		{a, http.MethodGet, "/admin/v1/nothing"},
	} {
		wantProblem(t, e.call(t, c.token, c.method, c.path, ""), http.StatusNotFound, "about:blank")
	}
	// The token check comes first: no route is revealed without one.
	wantProblem(t, e.call(t, "", http.MethodPut, "/admin/v1/pause", ""), http.StatusUnauthorized, "about:blank")
}
