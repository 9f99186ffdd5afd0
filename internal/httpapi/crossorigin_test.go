package httpapi_test

import (
	"net/http"
	"testing"
)

// TestCrossOriginBrowserRequestsRefused: without a token (protected mode on
// loopback, or ORDERDELAY_API_AUTH=none) /v1 takes any request, and a web
// page the operator visits can make the browser send one: a POST with a
// text/plain body is a "simple" request, sent without a CORS preflight. So
// the API refuses a state-changing request a browser marks as cross-origin
// (Sec-Fetch-Site, or an Origin other than the Host), with a 403 problem,
// and writes nothing. Requests without those headers (curl, SDKs) and
// same-origin ones pass.
func TestCrossOriginBrowserRequestsRefused(t *testing.T) {
	e := newProduceAPI(t, false)
	body := `{"after":"1h","payload":{"x":1}}`
	refused := []struct {
		name   string
		header []string
	}{
		{"fetch from another site", []string{"Content-Type", "text/plain", "Origin", "https://evil.example", "Sec-Fetch-Site", "cross-site"}},
		{"older browser, Origin only", []string{"Content-Type", "text/plain", "Origin", "https://evil.example"}},
		{"sandboxed frame", []string{"Content-Type", "text/plain", "Origin", "null"}},
	}
	for _, tt := range refused {
		t.Run(tt.name, func(t *testing.T) {
			rec := e.post(t, "/v1/queues/plain/tasks", body, tt.header...)
			if rec.Code != http.StatusForbidden {
				t.Errorf("POST from %s: %d %s, want 403", tt.name, rec.Code, rec.Body)
			}
			if ct := rec.Header().Get("Content-Type"); ct != "application/problem+json" {
				t.Errorf("Content-Type %q, want application/problem+json", ct)
			}
		})
	}
	if n := e.count(t, e.plain); n != 0 {
		t.Fatalf("%d tasks written by cross-origin requests", n)
	}
	for _, header := range [][]string{
		nil, // curl, an SDK
		{"Origin", "http://example.com", "Sec-Fetch-Site", "same-origin"},
	} {
		if rec := e.post(t, "/v1/queues/plain/tasks", body, header...); rec.Code != http.StatusCreated {
			t.Errorf("POST with %q: %d %s, want 201", header, rec.Code, rec.Body)
		}
	}
}
