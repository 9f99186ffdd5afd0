package httpapi_test

// The admin API apart (issue 14): served on its own listener only, with
// inputs as strict as the public API's. Real Redis, the real handlers.

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// adminRoutes are every admin operation, each with a body it accepts.
var adminRoutes = []struct{ method, path, body string }{
	{"GET", "/admin/v1/pause", ""},
	{"POST", "/admin/v1/pause", `{"reason":"test"}`},
	{"POST", "/admin/v1/resume", ""},
	{"POST", "/admin/v1/extend", `{"within":"1m","by":"1m"}`},
	{"GET", "/admin/v1/orders/ORD-1", ""},
	{"GET", "/admin/v1/dead", ""},
	{"POST", "/admin/v1/dead/requeue", `{"all":true}`},
	{"POST", "/admin/v1/dead/purge", `{"older_than":"1h"}`},
	{"POST", "/admin/v1/queues/jobs/dead/requeue", `{"all":true}`},
	{"POST", "/admin/v1/queues/jobs/dead/purge", `{"all":true}`},
	{"POST", "/admin/v1/queues/jobs/pause", `{"reason":"test"}`},
	{"POST", "/admin/v1/queues/jobs/resume", ""},
}

// TestAdminAPIOnlyOnTheAdminListener: no admin operation is served on the
// API's listener (whatever the token), every one is on the admin listener,
// and the admin listener serves nothing else.
func TestAdminAPIOnlyOnTheAdminListener(t *testing.T) {
	e := newOpsAPI(t, true)
	ctx := context.Background()
	for _, rt := range adminRoutes {
		for _, tok := range []string{opsAdminToken, opsProducerToken} {
			r := rawCall(t, e.url, tok, rt.method, rt.path, rt.body)
			if r.code != http.StatusNotFound {
				t.Errorf("API listener: %s %s (token %.8s…) = %d %s, want 404: the admin API is not served there", rt.method, rt.path, tok, r.code, r.raw)
			}
		}
		// Where the task operations were before they moved.
		if old, ok := strings.CutPrefix(rt.path, "/admin"); ok && strings.HasPrefix(old, "/v1/queues/") {
			r := rawCall(t, e.url, opsProducerToken, rt.method, old, rt.body)
			if r.code != http.StatusNotFound || !strings.Contains(r.raw, "admin listener") {
				t.Errorf("API listener: %s %s = %d %s, want 404 naming the admin listener (moved there)", rt.method, old, r.code, r.raw)
			}
		}
	}
	// Nothing the refused calls could have done happened.
	if n, _ := e.rdb.Exists(ctx, e.orders.Paused, e.jobs.Paused).Result(); n != 0 {
		t.Fatalf("%d pause keys set through the API listener", n)
	}
	for _, rt := range adminRoutes {
		r := rawCall(t, e.adminURL, opsAdminToken, rt.method, rt.path, rt.body)
		if r.code != http.StatusOK {
			t.Errorf("admin listener: %s %s = %d %s, want 200", rt.method, rt.path, r.code, r.raw)
		}
		if r := rawCall(t, e.adminURL, "", rt.method, rt.path, rt.body); r.code != http.StatusUnauthorized {
			t.Errorf("admin listener without a token: %s %s = %d, want 401", rt.method, rt.path, r.code)
		}
	}
	for _, p := range []string{"/v1/timeouts/ORD-1", "/metrics", "/healthz", "/readyz", "/v1/queues"} {
		for _, tok := range []string{opsAdminToken, opsProducerToken} {
			if r := rawCall(t, e.adminURL, tok, http.MethodGet, p, ""); r.code != http.StatusNotFound {
				t.Errorf("admin listener: GET %s = %d %s, want 404: it serves the admin API only", p, r.code, r.raw)
			}
		}
	}
}

// TestAdminBodiesStrict: the admin API decodes bodies like the public API
// (one JSON value, no unknown fields, nothing after it, size-limited) and
// a refused body changes nothing.
func TestAdminBodiesStrict(t *testing.T) {
	e := newOpsAPI(t, true)
	ctx := context.Background()
	// One dead-lettered order, and one due in 30 minutes.
	e.rdb.ZAdd(ctx, e.orders.Dead, redis.Z{Member: "D-1", Score: float64(time.Now().UnixMilli())})
	due := time.Now().Add(30 * time.Minute).Truncate(time.Millisecond)
	if _, _, err := e.oc.Enqueue(ctx, "ORD-1", due, client.Create); err != nil {
		t.Fatal(err)
	}
	big := `{"reason":"` + strings.Repeat("x", 20<<10) + `"}`
	cases := []struct {
		name, path, body string
		code             int
		says             string
	}{
		{"requeue trailing garbage", "/admin/v1/dead/requeue", `{"serials":["D-1"]} garbage`, 400, "after the JSON value"},
		{"requeue two values", "/admin/v1/dead/requeue", `{"serials":["D-1"]}{"all":true}`, 400, "after the JSON value"},
		{"requeue stray bracket", "/admin/v1/dead/requeue", `{"all":true}]`, 400, "after the JSON value"},
		{"requeue unknown field", "/admin/v1/dead/requeue", `{"serials":["D-1"],"force":true}`, 400, "force"},
		{"requeue ids, not serials", "/admin/v1/dead/requeue", `{"ids":["D-1"]}`, 400, "ids"},
		{"requeue not an object", "/admin/v1/dead/requeue", `["D-1"]`, 400, "body"},
		{"requeue too large", "/admin/v1/dead/requeue", `{"serials":["` + strings.Repeat("D", 20<<10) + `"]}`, 413, "bytes"},
		{"pause trailing garbage", "/admin/v1/pause", `{"reason":"x"} x`, 400, "after the JSON value"},
		{"pause unknown field", "/admin/v1/pause", `{"why":"x"}`, 400, "why"},
		{"pause too large", "/admin/v1/pause", big, 413, "bytes"},
		{"resume with a body", "/admin/v1/resume", `{"reason":"x"}`, 400, "reason"},
		{"extend trailing garbage", "/admin/v1/extend", `{"within":"1h","by":"15m"} {}`, 400, "after the JSON value"},
		{"extend unknown field", "/admin/v1/extend", `{"within":"1h","by":"15m","rows":true}`, 400, "rows"},
		{"extend by a number", "/admin/v1/extend", `{"within":"1h","by":900}`, 400, "by"},
		{"resync trailing garbage", "/admin/v1/resync", `{"page":10} 1`, 400, "after the JSON value"},
		{"purge trailing garbage", "/admin/v1/dead/purge", `{"older_than":"1s"} x`, 400, "after the JSON value"},
		{"purge unknown field", "/admin/v1/dead/purge", `{"older":"1s"}`, 400, "older"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := e.call(t, opsAdminToken, http.MethodPost, c.path, c.body)
			wantAnyProblem(t, r, c.code)
			if !strings.Contains(r.raw, c.says) {
				t.Errorf("%s: %s does not say %q", c.path, r.raw, c.says)
			}
		})
	}
	// Nothing changed: D-1 still dead, closing not paused, ORD-1 not moved.
	if _, err := e.rdb.ZScore(ctx, e.orders.Dead, "D-1").Result(); err != nil {
		t.Errorf("D-1 no longer dead-lettered after refused requests: %v", err)
	}
	if n, _ := e.rdb.Exists(ctx, e.orders.Paused).Result(); n != 0 {
		t.Error("closing paused by a refused request")
	}
	if s, err := e.rdb.ZScore(ctx, e.orders.Queue, "ORD-1").Result(); err != nil || int64(s) != queue.DeadlineMillis(due) {
		t.Errorf("ORD-1 score %v %v after refused requests, want %d", s, err, queue.DeadlineMillis(due))
	}
}

// TestAdminExtendBounded: extend refuses a window plus extension past the
// furthest deadline the queue accepts (queue.MaxAhead), which used to move
// orders out of range and have them dead-lettered, and names the bound.
func TestAdminExtendBounded(t *testing.T) {
	e := newOpsAPI(t, true)
	ctx := context.Background()
	due := time.Now().Add(30 * time.Minute).Truncate(time.Millisecond)
	if _, _, err := e.oc.Enqueue(ctx, "ORD-1", due, client.Create); err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{
		`{"within":"1h","by":"100000h"}`,
		`{"within":"87600h","by":"1ms"}`,
		`{"within":"43800h","by":"43801h"}`,
		`{"within":"100000h","by":"1m"}`,
	} {
		r := e.call(t, opsAdminToken, http.MethodPost, "/admin/v1/extend", body)
		wantAnyProblem(t, r, http.StatusBadRequest)
		if !strings.Contains(r.raw, "87600h") {
			t.Errorf("extend %s: %s does not name the bound (87600h)", body, r.raw)
		}
	}
	if s, err := e.rdb.ZScore(ctx, e.orders.Queue, "ORD-1").Result(); err != nil || int64(s) != queue.DeadlineMillis(due) {
		t.Fatalf("ORD-1 score %v %v after refused extends, want %d", s, err, queue.DeadlineMillis(due))
	}
	// At the bound it is accepted (within + by = 87600h).
	r := e.call(t, opsAdminToken, http.MethodPost, "/admin/v1/extend", `{"within":"1h","by":"87599h"}`)
	if r.code != http.StatusOK || !strings.Contains(r.raw, `"moved":1`) {
		t.Fatalf("extend at the bound: %d %s, want 200 and ORD-1 moved", r.code, r.raw)
	}
	if s, _ := e.rdb.ZScore(ctx, e.orders.Queue, "ORD-1").Result(); int64(s) != queue.DeadlineMillis(due.Add(87599*time.Hour)) {
		t.Errorf("ORD-1 score %d after extending by 87599h, want %d", int64(s), queue.DeadlineMillis(due.Add(87599*time.Hour)))
	}
}

// rawReply is a response whose body is kept as it came (an admin reply may
// be an array, which reply cannot hold).
type rawReply struct {
	code int
	raw  string
}

func rawCall(t *testing.T, base, token, method, path, body string) rawReply {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, base+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return rawReply{code: resp.StatusCode, raw: string(b)}
}

// TestPutTaskBodyStrict: PUT of a task decodes with the same strict decoder
// as every other body (it stopped at the first value and took what followed).
func TestPutTaskBodyStrict(t *testing.T) {
	e := newOpsAPI(t, false)
	for _, body := range []string{`{"after":"1m"} garbage`, `{"after":"1m"}}`, `{"after":"1m"}{"after":"2m"}`} {
		r := e.call(t, opsProducerToken, http.MethodPut, "/v1/queues/jobs/tasks/T-1", body)
		wantAnyProblem(t, r, http.StatusBadRequest)
		if !strings.Contains(r.raw, "after the JSON value") {
			t.Errorf("PUT %s: %s does not say what is wrong", body, r.raw)
		}
	}
	if _, err := e.cl.GetTask(context.Background(), "T-1"); err == nil {
		t.Error("T-1 was created by a refused PUT")
	}
}
