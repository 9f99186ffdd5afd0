package httpapi_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestBodyLimitsHoldWithoutContentLength (a regression test; it passed when
// written): a chunked body, whose size the server learns only by reading
// it, is cut at the limit with a 413 problem like a declared one, on the
// public and the admin listener; numbers out of range, NaN and nesting past
// encoding/json's bound are 400 problems naming the body.
func TestBodyLimitsHoldWithoutContentLength(t *testing.T) {
	e := newOpsAPI(t, true)
	const p, a = opsProducerToken, opsAdminToken
	chunked := func(base, token, method, path string, body io.Reader) reply {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, method, base+path, io.MultiReader(body)) // no length known
		if err != nil {
			t.Fatal(err)
		}
		if req.ContentLength != 0 {
			t.Fatalf("request has a length (%d): it would not be sent chunked", req.ContentLength)
		}
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return reply{code: resp.StatusCode, header: resp.Header, raw: string(b)}
	}
	huge := strings.NewReader(`{"reason":"` + strings.Repeat("x", 1<<20) + `"}`)
	if r := chunked(e.adminURL, a, http.MethodPost, "/admin/v1/pause", huge); r.code != http.StatusRequestEntityTooLarge ||
		r.header.Get("Content-Type") != "application/problem+json" {
		t.Errorf("admin pause, 1 MiB chunked: %d %q %.200s, want a 413 problem", r.code, r.header.Get("Content-Type"), r.raw)
	}
	huge = strings.NewReader(`{"after":"1h","x":"` + strings.Repeat("x", 1<<20) + `"}`)
	if r := chunked(e.url, p, http.MethodPut, "/v1/timeouts/ORD-BIG", huge); r.code != http.StatusRequestEntityTooLarge ||
		r.header.Get("Content-Type") != "application/problem+json" {
		t.Errorf("PUT timeout, 1 MiB chunked: %d %q %.200s, want a 413 problem", r.code, r.header.Get("Content-Type"), r.raw)
	}
	for _, c := range []struct{ token, path, body string }{
		{a, "/admin/v1/resync", `{"page":1,"per_second":1e999}`},
		{a, "/admin/v1/resync", `{"page":1e3}`},
		{a, "/admin/v1/dead/purge", `{"keep_max":99999999999999999999}`},
		{a, "/admin/v1/resync", `{"page":1,"per_second":NaN}`},
		{a, "/admin/v1/dead/requeue", strings.Repeat("[", 10001)},
		{p, "/v1/queues/jobs/tasks", `{"after":"1h","payload":` + strings.Repeat("[", 10001) + `}`},
	} {
		r := e.call(t, c.token, http.MethodPost, c.path, c.body)
		if got := wantProblem(t, r, http.StatusBadRequest, "https://github.com/orderdelay/orderdelay/blob/main/docs/api.md#invalid-request"); got.Field != "body" {
			t.Errorf("POST %s %.60s: field %q, want body", c.path, c.body, got.Field)
		}
	}
}
