package httpapi_test

// Every operation and every status the OpenAPI document declares, driven
// against real servers (real Redis and PostgreSQL), each request and
// response validated against the document as served, with kin-openapi in
// its OpenAPI 3.1 mode (schemas checked as JSON Schema 2020-12).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/gorillamux"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/httpapi"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// contract drives servers and checks each exchange against the document.
type contract struct {
	t      *testing.T
	doc    *openapi3.T
	router routers.Router
	seen   map[string]map[int]bool // operationId -> statuses validated
	// admin maps a server's API listener to its admin listener, where
	// requests to /admin/ paths go.
	admin map[string]string
	// requests: validated and conforming; refused: malformed on purpose and
	// refused by the document too; past: malformed on purpose, accepted by
	// the document (a rule it cannot express, such as a deadline's range).
	requests, refused, past, responses int
}

// call is one exchange: a request and the status it must get.
type call struct {
	url, token, method, path, body string
	header                         []string
	want                           int
	// bad marks a request malformed on purpose: the server must refuse it;
	// the document may or may not (counted either way).
	bad bool
}

func bearer(_ context.Context, in *openapi3filter.AuthenticationInput) error {
	if h := in.RequestValidationInput.Request.Header.Get("Authorization"); !strings.HasPrefix(h, "Bearer ") || len(h) == len("Bearer ") {
		return errors.New("no bearer token")
	}
	return nil
}

func (c *contract) newRequest(cl call) *http.Request {
	c.t.Helper()
	var body io.Reader
	if cl.body != "" {
		body = strings.NewReader(cl.body)
	}
	req, err := http.NewRequest(cl.method, cl.url+cl.path, body)
	if err != nil {
		c.t.Fatal(err)
	}
	if cl.body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if cl.token != "" {
		req.Header.Set("Authorization", "Bearer "+cl.token)
	}
	for i := 0; i+1 < len(cl.header); i += 2 {
		req.Header.Add(cl.header[i], cl.header[i+1])
	}
	return req
}

// do sends cl, validates the request and the response against the
// document, and returns the response body.
func (c *contract) do(cl call) []byte {
	c.t.Helper()
	name := fmt.Sprintf("%s %s", cl.method, cl.path)
	if strings.HasPrefix(cl.path, "/admin/") {
		cl.url = c.admin[cl.url]
	}
	req := c.newRequest(cl)
	route, params, err := c.router.FindRoute(req)
	if err != nil {
		c.t.Errorf("%s: no operation of the document: %v", name, err)
		return nil
	}
	opts := &openapi3filter.Options{AuthenticationFunc: bearer, IncludeResponseStatus: true, MultiError: true}
	in := &openapi3filter.RequestValidationInput{Request: req, PathParams: params, Route: route, Options: opts}
	reqErr := openapi3filter.ValidateRequest(context.Background(), in)
	switch {
	case !cl.bad && reqErr != nil:
		c.t.Errorf("%s: the request does not conform to the document: %v", name, reqErr)
	case !cl.bad:
		c.requests++
	case reqErr != nil:
		c.refused++
	default:
		c.past++
		c.t.Logf("malformed, and only the server can tell: %s %.80s", name, cl.body)
	}
	resp, err := http.DefaultClient.Do(c.newRequest(cl))
	if err != nil {
		c.t.Fatalf("%s: %v", name, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	if resp.StatusCode != cl.want {
		c.t.Errorf("%s (%s): status %d %s, want %d", name, route.Operation.OperationID, resp.StatusCode, b, cl.want)
	}
	out := &openapi3filter.ResponseValidationInput{RequestValidationInput: in, Status: resp.StatusCode, Header: resp.Header, Options: opts}
	out.SetBodyBytes(b)
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		c.t.Errorf("%s: response %d %.300s does not conform to the document: %v", name, resp.StatusCode, b, err)
		return b
	}
	c.responses++
	op := route.Operation.OperationID
	if c.seen[op] == nil {
		c.seen[op] = map[int]bool{}
	}
	c.seen[op][resp.StatusCode] = true
	return b
}

// sample is a well-formed request of each operation, for the checks that
// every operation makes (401 with a wrong token, 503 with Redis down, 413
// with a body past its limit): paths, queries and bodies the document
// accepts.
var sample = map[string]call{
	"healthz":         {method: "GET", path: "/healthz"},
	"readyz":          {method: "GET", path: "/readyz"},
	"metrics":         {method: "GET", path: "/metrics"},
	"getOpenAPI":      {method: "GET", path: "/v1/openapi.json"},
	"putTimeout":      {method: "PUT", path: "/v1/timeouts/s-1", body: `{"after":"30m"}`},
	"getTimeout":      {method: "GET", path: "/v1/timeouts/s-1"},
	"deleteTimeout":   {method: "DELETE", path: "/v1/timeouts/s-1"},
	"adminPauseState": {method: "GET", path: "/admin/v1/pause"},
	"adminPause":      {method: "POST", path: "/admin/v1/pause", body: `{"reason":"r"}`},
	"adminResume":     {method: "POST", path: "/admin/v1/resume"},
	"adminExtend":     {method: "POST", path: "/admin/v1/extend", body: `{"within":"1h","by":"15m"}`},
	"adminResync":     {method: "POST", path: "/admin/v1/resync", body: `{}`},
	"adminOrder":      {method: "GET", path: "/admin/v1/orders/s-1"},
	"adminDead":       {method: "GET", path: "/admin/v1/dead"},
	"adminRequeue":    {method: "POST", path: "/admin/v1/dead/requeue", body: `{"serials":["s-1"]}`},
	"adminPurge":      {method: "POST", path: "/admin/v1/dead/purge", body: `{"older_than":"168h"}`},
	"listQueues":      {method: "GET", path: "/v1/queues"},
	"queueStats":      {method: "GET", path: "/v1/queues/jobs/stats"},
	"listTasks":       {method: "GET", path: "/v1/queues/jobs/tasks"},
	"createTask":      {method: "POST", path: "/v1/queues/jobs/tasks", body: `{"after":"1h"}`},
	"createTasks":     {method: "POST", path: "/v1/queues/jobs/tasks/batch", body: `{"tasks":[{"after":"1h"}]}`},
	"putTask":         {method: "PUT", path: "/v1/queues/jobs/tasks/t-9", body: `{"after":"1h"}`},
	"getTask":         {method: "GET", path: "/v1/queues/jobs/tasks/t-9"},
	"deleteTask":      {method: "DELETE", path: "/v1/queues/jobs/tasks/t-9"},
	"deleteTasks":     {method: "POST", path: "/v1/queues/jobs/batch-delete", body: `{"ids":["t-9"]}`},
	"poll":            {method: "POST", path: "/v1/queues/jobs/poll"},
	"ack":             {method: "POST", path: "/v1/queues/jobs/ack", body: `{"token":"poll.` + strings.Repeat("A", 26) + `","ids":["t-9"]}`},
	"requeueTasks":    {method: "POST", path: "/admin/v1/queues/jobs/dead/requeue", body: `{"ids":["t-9"]}`},
	"purgeTasks":      {method: "POST", path: "/admin/v1/queues/jobs/dead/purge", body: `{"ids":["t-9"]}`},
	"pauseQueue":      {method: "POST", path: "/admin/v1/queues/jobs/pause", body: `{}`},
	"resumeQueue":     {method: "POST", path: "/admin/v1/queues/jobs/resume"},
}

// unprovoked are the declared responses this test cannot provoke, with why.
var unprovoked = map[string]string{}

// Every operation of the document, and every status it declares, against
// real servers, each with its API and its admin listener: one with real
// Redis and PostgreSQL, one whose Redis is down (503s). Each request and
// response is validated against the document as served.
func TestOpenAPIContract(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	db, _ := testenv.Postgres(t)
	prefix := strings.TrimSuffix(keys.Queue, ":order")
	names := []string{"jobs", "confirm", "durable", "full"}
	qk := map[string]queue.Keys{}
	for _, n := range names {
		qk[n] = queue.NewKeys(prefix + ":" + n)
	}
	t.Cleanup(func() {
		for _, k := range qk {
			testenv.DeleteQueue(rdb, k)
		}
	})
	plainYAML := fmt.Sprintf(`queues:
  - {name: jobs, key: %q, lease: 1m, action: {type: poll}}
  - {name: confirm, key: %q, action: {type: sql, statement: "SELECT unnest($1::text[])"}}
  - {name: full, key: %q, max_pending: 1, action: {type: poll}}
`, qk["jobs"].Queue, qk["confirm"].Queue, qk["full"].Queue)
	fullYAML := plainYAML + fmt.Sprintf("  - {name: durable, key: %q, durable: true, window: 5m, action: {type: sql, statement: \"SELECT unnest($1::text[])\"}}\n", qk["durable"].Queue)
	f, err := tasks.Parse([]byte(fullYAML))
	if err != nil {
		t.Fatal(err)
	}
	if err := tasks.WriteMeta(context.Background(), rdb, f); err != nil {
		t.Fatal(err)
	}
	admins := map[string]string{}
	serveIt := func(api *httpapi.Server) string {
		srv := httptest.NewServer(api.Handler())
		t.Cleanup(srv.Close)
		adm := httptest.NewServer(api.AdminHandler())
		t.Cleanup(adm.Close)
		admins[srv.URL] = adm.URL
		return srv.URL
	}
	main := serveIt(contractServer(t, contractConfig{rdb: rdb, db: db, key: keys.Queue, yaml: fullYAML, admin: true,
		cfg: httpapi.Config{Ping: func(ctx context.Context) error { return rdb.Ping(ctx).Err() }}}))
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	downRDB := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(port), MaxRetries: -1, DialTimeout: time.Second, DialerRetries: 1})
	t.Cleanup(func() { downRDB.Close() })
	down := serveIt(contractServer(t, contractConfig{rdb: downRDB, yaml: plainYAML, admin: true, cfg: httpapi.Config{
		Live: func() error { return errors.New("no scan for 2m") },
		Ping: func(ctx context.Context) error { return downRDB.Ping(ctx).Err() }}}))

	resp, err := http.Get(main + "/v1/openapi.json")
	if err != nil {
		t.Fatal(err)
	}
	served, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /v1/openapi.json: %d %v", resp.StatusCode, err)
	}
	for _, secret := range []string{contractProducer, contractAdmin, prefix, "127.0.0.1"} {
		if strings.Contains(string(served), secret) {
			t.Errorf("the served document holds %q: it must not depend on the deployment", secret)
		}
	}
	doc := loadDoc(t, served)
	router, err := gorillamux.NewRouter(doc)
	if err != nil {
		t.Fatal(err)
	}
	c := &contract{t: t, doc: doc, router: router, seen: map[string]map[int]bool{}, admin: admins}
	const p, a = contractProducer, contractAdmin
	big := func(n int) string { return strings.Repeat(" ", n) }
	tok26 := "poll." + strings.Repeat("A", 26)

	// Probes and the document.
	for _, op := range []string{"healthz", "readyz", "metrics", "getOpenAPI"} {
		cl := sample[op]
		cl.url, cl.want = main, 200
		c.do(cl)
		if op == "healthz" || op == "readyz" {
			cl.url, cl.want = down, 503
			c.do(cl)
		}
	}

	// Order timeouts.
	for _, cl := range []call{
		{method: "PUT", path: "/v1/timeouts/ord-1", body: `{"after":"30m"}`, want: 201},
		{method: "PUT", path: "/v1/timeouts/ord-1", body: `{"at":"2030-01-02T15:04:05Z"}`, want: 200},
		{method: "PUT", path: "/v1/timeouts/ord-1", body: `{"after":"45m","reschedule":true}`, want: 200},
		{method: "GET", path: "/v1/timeouts/ord-1", want: 200},
		{method: "DELETE", path: "/v1/timeouts/ord-1", want: 204},
		{method: "GET", path: "/v1/timeouts/ord-1", want: 404},
		{method: "DELETE", path: "/v1/timeouts/ord-1", want: 404},
		{method: "PUT", path: "/v1/timeouts/ord-1", body: `{"after":"soon"}`, want: 400, bad: true},
		{method: "PUT", path: "/v1/timeouts/ord-1", body: `{"after":"30m","reschedule":true,"only_later":true}`, want: 400, bad: true},
		{method: "PUT", path: "/v1/timeouts/ord-1", body: `{"after":"100000h"}`, want: 400, bad: true},
		{method: "PUT", path: "/v1/timeouts/ord-1", body: `{"after":"30m"}` + big(httpapi.MaxBodyBytes), want: 413, bad: true},
		{method: "GET", path: "/v1/timeouts/" + strings.Repeat("s", 129), want: 400, bad: true},
		{method: "DELETE", path: "/v1/timeouts/" + strings.Repeat("s", 129), want: 400, bad: true},
		{method: "PUT", path: "/v1/timeouts/ord-1", body: `{"after":"30m"}`, want: 401, bad: true, token: "-"}, // no token at all
	} {
		cl.url = main
		if cl.token == "" {
			cl.token = p
		} else if cl.token == "-" {
			cl.token = ""
		}
		c.do(cl)
	}

	// The admin API.
	ctx := context.Background()
	oc, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"ord-2", "ord-dead"} {
		if _, _, err := oc.EnqueueAfter(ctx, s, time.Hour, client.Create); err != nil {
			t.Fatal(err)
		}
	}
	kill(t, rdb, keys, "ord-dead")
	for _, cl := range []call{
		{method: "GET", path: "/admin/v1/pause", want: 200},
		{method: "POST", path: "/admin/v1/pause", body: `{"reason":"INC-1"}`, want: 200},
		{method: "POST", path: "/admin/v1/pause", body: `{`, want: 400, bad: true},
		{method: "POST", path: "/admin/v1/resume", want: 200},
		{method: "POST", path: "/admin/v1/extend", body: `{"within":"1h","by":"15m","move_rows":false}`, want: 200},
		{method: "POST", path: "/admin/v1/extend", body: `{"within":"1h"}`, want: 400, bad: true},
		{method: "POST", path: "/admin/v1/resync", body: `{"page":100}`, want: 200},
		{method: "POST", path: "/admin/v1/resync", body: `{"page":-1}`, want: 400, bad: true},
		{method: "GET", path: "/admin/v1/orders/ord-2", want: 200},
		{method: "GET", path: "/admin/v1/orders/nope", want: 404},
		{method: "GET", path: "/admin/v1/orders/" + strings.Repeat("s", 129), want: 400, bad: true},
		{method: "GET", path: "/admin/v1/dead?limit=5", want: 200},
		{method: "GET", path: "/admin/v1/dead?limit=0", want: 400, bad: true},
		{method: "POST", path: "/admin/v1/dead/requeue", body: `{"serials":["ord-dead"]}`, want: 200},
		{method: "POST", path: "/admin/v1/dead/requeue", body: `{"serials":["nope"]}`, want: 404},
		{method: "POST", path: "/admin/v1/dead/requeue", body: `{"serials":["x"],"all":true}`, want: 400, bad: true},
		{method: "POST", path: "/admin/v1/dead/purge", body: `{"older_than":"168h","keep_max":10}`, want: 200},
		{method: "POST", path: "/admin/v1/dead/purge", body: `{}`, want: 400, bad: true},
	} {
		cl.url, cl.token = main, a
		c.do(cl)
	}

	// Tasks: put, get, delete, create, batch, poll and ack.
	var created struct {
		ID string `json:"id"`
	}
	type polled struct {
		Token string `json:"token"`
	}
	var pl polled
	for _, cl := range []call{
		{method: "PUT", path: "/v1/queues/jobs/tasks/t-1", body: `{"after":"1h","payload":{"n":1}}`, want: 201},
		{method: "PUT", path: "/v1/queues/jobs/tasks/t-1", body: `{"after":"2h","payload":{"n":1},"only_later":true}`, want: 200},
		{method: "PUT", path: "/v1/queues/jobs/tasks/t-1", body: `{"after":"x"}`, want: 400, bad: true},
		{method: "PUT", path: "/v1/queues/nope/tasks/t-1", body: `{"after":"1h"}`, want: 404},
		{method: "PUT", path: "/v1/queues/jobs/tasks/t-1", body: `{"after":"1h","payload":"` + strings.Repeat("x", client.MaxPayloadBytes+httpapi.MaxBodyBytes) + `"}`, want: 413, bad: true},
		{method: "PUT", path: "/v1/queues/full/tasks/f-1", body: `{"after":"1h"}`, want: 201},
		{method: "PUT", path: "/v1/queues/full/tasks/f-2", body: `{"after":"1h"}`, want: 507},
		{method: "GET", path: "/v1/queues/jobs/tasks/t-1", want: 200},
		{method: "GET", path: "/v1/queues/jobs/tasks/nope", want: 404},
		{method: "GET", path: "/v1/queues/jobs/tasks/" + strings.Repeat("s", 129), want: 400, bad: true},
		{method: "PUT", path: "/v1/queues/durable/tasks/d-1", body: `{"after":"1h","payload":{"d":1}}`, want: 201},
		{method: "GET", path: "/v1/queues/durable/tasks/d-1", want: 200},
		{method: "DELETE", path: "/v1/queues/jobs/tasks/t-1", want: 204},
		{method: "DELETE", path: "/v1/queues/jobs/tasks/t-1", want: 404},
		{method: "DELETE", path: "/v1/queues/jobs/tasks/" + strings.Repeat("s", 129), want: 400, bad: true},
		{method: "POST", path: "/v1/queues/jobs/batch-delete", body: `{"ids":["t-1","t-2"]}`, want: 200},
		{method: "POST", path: "/v1/queues/jobs/batch-delete", body: `{"ids":[]}`, want: 400, bad: true},
		{method: "POST", path: "/v1/queues/nope/batch-delete", body: `{"ids":["t-1"]}`, want: 404},
		{method: "POST", path: "/v1/queues/full/tasks", body: `{"after":"1h"}`, want: 507},
		{method: "POST", path: "/v1/queues/jobs/tasks", body: `{"after":"1h","payload":{"a":1}}`, want: 201},
		{method: "POST", path: "/v1/queues/jobs/tasks", body: `{"after":"1h","payload":{"a":1}}`, header: []string{"Idempotency-Key", "k-1"}, want: 201},
		{method: "POST", path: "/v1/queues/jobs/tasks", body: `{"after":"1h","payload":{"a":1}}`, header: []string{"Idempotency-Key", "k-1"}, want: 200},
		{method: "POST", path: "/v1/queues/jobs/tasks", body: `{"after":"1h","payload":{"a":2}}`, header: []string{"Idempotency-Key", "k-1"}, want: 409},
		{method: "POST", path: "/v1/queues/jobs/tasks", body: `{"after":"1h"}`, header: []string{"Idempotency-Key", ""}, want: 400, bad: true},
		{method: "POST", path: "/v1/queues/jobs/tasks", body: `{"id":"x","after":"1h"}`, want: 400, bad: true},
		{method: "POST", path: "/v1/queues/jobs/tasks", body: `{"after":"1h","payload":"` + strings.Repeat("x", client.MaxPayloadBytes+httpapi.MaxBodyBytes) + `"}`, want: 413, bad: true},
		{method: "POST", path: "/v1/queues/nope/tasks", body: `{"after":"1h"}`, want: 404},
		{method: "POST", path: "/v1/queues/jobs/tasks/batch", body: `{"tasks":[{"id":"b-1","after":"1h"},{"after":"2h","payload":[1]}]}`, want: 200},
		{method: "POST", path: "/v1/queues/jobs/tasks/batch", body: `{"tasks":[{"id":"b-1","after":"1h"}]}`, header: []string{"Idempotency-Key", "k-2"}, want: 200},
		{method: "POST", path: "/v1/queues/jobs/tasks/batch", body: `{"tasks":[]}`, want: 400, bad: true},
		{method: "POST", path: "/v1/queues/jobs/tasks/batch", body: `{"tasks":[{"after":"1h"},{"after":"x"}]}`, want: 400, bad: true},
		{method: "POST", path: "/v1/queues/jobs/tasks/batch", body: `{"tasks":[{"after":"1h"}]}` + big(httpapi.MaxBatchBytes), want: 413, bad: true},
		{method: "POST", path: "/v1/queues/full/tasks/batch", body: `{"tasks":[{"id":"f-1","after":"1h"},{"id":"f-3","after":"1h"}]}`, want: 507},
		{method: "POST", path: "/v1/queues/nope/tasks/batch", body: `{"tasks":[{"after":"1h"}]}`, want: 404},
		{method: "PUT", path: "/v1/queues/jobs/tasks/due-1", body: `{"at":"2020-01-01T00:00:00Z","payload":{"due":1}}`, want: 201},
	} {
		cl.url, cl.token = main, p
		b := c.do(cl)
		if cl.want == 201 && cl.method == "POST" {
			_ = json.Unmarshal(b, &created)
		}
	}
	if created.ID == "" {
		t.Error("no task id from the creates")
	}
	_ = json.Unmarshal(c.do(call{url: main, token: p, method: "POST", path: "/v1/queues/jobs/poll?max=10&wait=1s", want: 200}), &pl)
	if pl.Token == "" {
		t.Fatal("the poll leased nothing; due-1 was due")
	}
	for _, cl := range []call{
		{method: "POST", path: "/v1/queues/jobs/ack", body: `{"token":"` + pl.Token + `","ids":["due-1"]}`, want: 200},
		{method: "POST", path: "/v1/queues/jobs/ack", body: `{"token":"` + pl.Token + `","ids":["due-1"]}`, want: 409},
		{method: "POST", path: "/v1/queues/jobs/ack", body: `{"token":"-","ids":["due-1"]}`, want: 400, bad: true},
		{method: "POST", path: "/v1/queues/confirm/ack", body: `{"token":"` + tok26 + `","ids":["c-1"]}`, want: 409},
		{method: "POST", path: "/v1/queues/nope/ack", body: `{"token":"` + tok26 + `","ids":["c-1"]}`, want: 404},
		{method: "POST", path: "/v1/queues/jobs/poll?max=0", want: 400, bad: true},
		{method: "POST", path: "/v1/queues/jobs/poll?wait=1m", want: 400, bad: true},
		{method: "POST", path: "/v1/queues/confirm/poll", want: 409},
		{method: "POST", path: "/v1/queues/nope/poll", want: 404},
	} {
		cl.url, cl.token = main, p
		c.do(cl)
	}

	// Operating task queues.
	var page struct {
		Next string `json:"next"`
	}
	_ = json.Unmarshal(c.do(call{url: main, token: p, method: "GET", path: "/v1/queues/jobs/tasks?state=pending&limit=1", want: 200}), &page)
	if page.Next == "" {
		t.Fatal("a page of 1 of several pending tasks has no next")
	}
	jc, err := client.New(rdb, qk["jobs"].Queue)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := jc.PutTask(ctx, "k-1", json.RawMessage(`{"k":1}`), time.Now().Add(time.Hour), client.Create); err != nil {
		t.Fatal(err)
	}
	kill(t, rdb, qk["jobs"], "k-1")
	for _, cl := range []call{
		{method: "GET", path: "/v1/queues", want: 200},
		{method: "GET", path: "/v1/queues/jobs/stats", want: 200},
		{method: "GET", path: "/v1/queues/nope/stats", want: 404},
		{method: "GET", path: "/v1/queues/jobs/tasks?state=pending&limit=1&after=" + page.Next, want: 200},
		{method: "GET", path: "/v1/queues/jobs/tasks?state=dead&payload=true", want: 200},
		{method: "GET", path: "/v1/queues/jobs/tasks?state=bogus", want: 400, bad: true},
		{method: "GET", path: "/v1/queues/jobs/tasks?after=garbage", want: 400, bad: true},
		{method: "GET", path: "/v1/queues/nope/tasks", want: 404},
	} {
		cl.url, cl.token = main, p
		c.do(cl)
	}
	for _, cl := range []call{
		{method: "POST", path: "/admin/v1/queues/jobs/dead/requeue", body: `{"ids":["k-1","nope"]}`, want: 200},
		{method: "POST", path: "/admin/v1/queues/jobs/dead/requeue", body: `{"all":true}`, want: 200},
		{method: "POST", path: "/admin/v1/queues/jobs/dead/requeue", body: `{"ids":["x"],"all":true}`, want: 400, bad: true},
		{method: "POST", path: "/admin/v1/queues/nope/dead/requeue", body: `{"all":true}`, want: 404},
		{method: "POST", path: "/admin/v1/queues/jobs/dead/purge", body: `{"all":true}`, want: 200},
		{method: "POST", path: "/admin/v1/queues/jobs/dead/purge", body: `{}`, want: 400, bad: true},
		{method: "POST", path: "/admin/v1/queues/nope/dead/purge", body: `{"all":true}`, want: 404},
		{method: "POST", path: "/admin/v1/queues/jobs/pause", body: `{"reason":"INC-2"}`, want: 200},
		{method: "POST", path: "/admin/v1/queues/jobs/pause", body: `{"reason":1}`, want: 400, bad: true},
		{method: "POST", path: "/admin/v1/queues/nope/pause", want: 404},
		{method: "POST", path: "/admin/v1/queues/jobs/resume", want: 200},
		{method: "POST", path: "/admin/v1/queues/nope/resume", want: 404},
	} {
		cl.url, cl.token = main, a
		c.do(cl)
	}

	// What every operation declares alike: 401 with a wrong token, 503 with
	// Redis down, 413 with a body past its limit.
	for op, cl := range sample {
		codes := declared(doc, op)
		if codes[401] {
			cl := cl
			cl.url, cl.token, cl.want = main, "not-a-token", 401
			c.do(cl)
		}
		if codes[413] && !c.seen[op][413] {
			cl := cl
			cl.url, cl.token, cl.want, cl.bad = main, p, 413, true
			if sec := route(doc, op).Security; sec != nil && len(*sec) > 0 {
				cl.token = a
			}
			if cl.body == "" {
				cl.body = "{}"
			}
			cl.body += big(httpapi.MaxBodyBytes)
			c.do(cl)
		}
		if codes[503] && op != "healthz" && op != "readyz" {
			cl := cl
			cl.url, cl.token, cl.want = down, p, 503
			if sec := route(doc, op).Security; sec != nil && len(*sec) > 0 {
				cl.token = a
			}
			c.do(cl)
		}
	}

	// Every operation, every declared status.
	ops, pairs := 0, 0
	for path, item := range doc.Paths.Map() {
		for method, op := range item.Operations() {
			ops++
			id := op.OperationID
			if _, ok := sample[id]; !ok {
				t.Errorf("%s %s (%s) has no sample request in this test", method, path, id)
			}
			for code := range declared(doc, id) {
				pairs++
				if c.seen[id][code] {
					continue
				}
				if why, ok := unprovoked[fmt.Sprintf("%s %d", id, code)]; ok {
					t.Logf("%s %d not provoked: %s", id, code, why)
					continue
				}
				t.Errorf("%s %s (%s): declared status %d was never seen", method, path, id, code)
			}
		}
	}
	var seenPairs []string
	for id, codes := range c.seen {
		for code := range codes {
			seenPairs = append(seenPairs, id+" "+strconv.Itoa(code))
		}
	}
	sort.Strings(seenPairs)
	t.Logf("OpenAPI contract: %d operations, %d of %d declared responses seen; %d responses validated, "+
		"%d conforming requests validated, %d malformed requests refused by the document too, %d malformed requests only the server refuses",
		len(c.seen), len(seenPairs), pairs, c.responses, c.requests, c.refused, c.past)
	if len(c.seen) != ops {
		t.Errorf("%d of %d operations exercised", len(c.seen), ops)
	}
}

// declared returns the statuses operation id declares.
func declared(doc *openapi3.T, id string) map[int]bool {
	out := map[int]bool{}
	op := route(doc, id)
	if op == nil {
		return out
	}
	for k := range op.Responses.Map() {
		n, err := strconv.Atoi(k)
		if err == nil {
			out[n] = true
		}
	}
	return out
}

// route returns the operation with id (Security nil: the document's).
func route(doc *openapi3.T, id string) *openapi3.Operation {
	for _, item := range doc.Paths.Map() {
		for _, op := range item.Operations() {
			if op.OperationID == id {
				return op
			}
		}
	}
	return nil
}
