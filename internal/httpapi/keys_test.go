package httpapi_test

import (
	"context"
	"net/http"
	"testing"
)

// TestBodiesRefuseRepeatedAndMiscasedKeys: encoding/json takes the last
// of repeated keys and matches field names case-insensitively, so
// {"after":"1h","AFTER":"9999h"} was accepted as 9999h, and {"After":..}
// though the document names "after" only. A proxy or validator that reads
// the first key, or holds the body to the document, then sees another
// request than the daemon runs. Every body, public and admin, now refuses
// a key given twice in one object (payloads included: which one a consumer
// would read is anyone's guess) and a field name in another case, with a
// 400 naming the body, and nothing is written. Keys that repeat in
// different objects, and payload keys in any case, are fine.
func TestBodiesRefuseRepeatedAndMiscasedKeys(t *testing.T) {
	e := newOpsAPI(t, true)
	const p, a = opsProducerToken, opsAdminToken
	refused := []struct{ token, method, path, body string }{
		{p, http.MethodPut, "/v1/timeouts/dup-1", `{"after":"1h","after":"2h"}`},
		{p, http.MethodPut, "/v1/timeouts/dup-2", `{"after":"1h","AFTER":"9999h"}`},
		{p, http.MethodPut, "/v1/timeouts/dup-3", `{"After":"1h"}`},
		{p, http.MethodPut, "/v1/queues/jobs/tasks/dup-4", `{"after":"1h","payload":{"n":1,"n":2}}`},
		{p, http.MethodPost, "/v1/queues/jobs/tasks", `{"after":"1h","payload":{"a":[{"n":1,"n":2}]}}`},
		{p, http.MethodPost, "/v1/queues/jobs/tasks", `{"after":"1h","At":"2030-01-01T00:00:00Z"}`},
		{p, http.MethodPost, "/v1/queues/jobs/tasks/batch", `{"tasks":[{"id":"dup-5","after":"1h","after":"2h"}]}`},
		{p, http.MethodPost, "/v1/queues/jobs/tasks/batch", `{"Tasks":[{"id":"dup-6","after":"1h"}]}`},
		{p, http.MethodPost, "/v1/queues/jobs/ack", `{"token":"x","ids":["a"],"ids":["b"]}`},
		{a, http.MethodPost, "/admin/v1/extend", `{"within":"1h","by":"15m","by":"1h"}`},
		{a, http.MethodPost, "/admin/v1/pause", `{"Reason":"x"}`},
	}
	for _, c := range refused {
		r := e.call(t, c.token, c.method, c.path, c.body)
		if r.code != http.StatusBadRequest {
			t.Errorf("%s %s %s: %d %s, want 400", c.method, c.path, c.body, r.code, r.raw)
			continue
		}
		if got := wantProblem(t, r, http.StatusBadRequest, "https://github.com/orderdelay/orderdelay/blob/main/docs/api.md#invalid-request"); got.Field != "body" {
			t.Errorf("%s %s %s: field %q, want body", c.method, c.path, c.body, got.Field)
		}
	}
	if n, err := e.rdb.ZCard(context.Background(), e.jobs.Queue).Result(); err != nil || n != 0 {
		t.Errorf("jobs holds %d tasks (%v), want none", n, err)
	}
	if n, err := e.rdb.ZCard(context.Background(), e.orders.Queue).Result(); err != nil || n != 0 {
		t.Errorf("the order queue holds %d entries (%v), want none", n, err)
	}
	if r := e.call(t, a, http.MethodGet, "/admin/v1/pause", ""); r.code != http.StatusOK || r.raw == "" || r.raw[:len(`{"paused":false`)] != `{"paused":false` {
		t.Errorf("pause state %d %s, want not paused", r.code, r.raw)
	}

	for _, c := range []struct{ path, body string }{
		{"/v1/queues/jobs/tasks", `{"after":"1h","payload":{"n":{"n":1},"N":[{"n":1},{"n":2}]}}`},
		{"/v1/queues/jobs/tasks/batch", `{"tasks":[{"id":"ok-1","after":"1h"},{"id":"ok-2","after":"1h"}]}`},
	} {
		if r := e.call(t, p, http.MethodPost, c.path, c.body); r.code != http.StatusCreated && r.code != http.StatusOK {
			t.Errorf("POST %s %s: %d %s, want it created", c.path, c.body, r.code, r.raw)
		}
	}
}
