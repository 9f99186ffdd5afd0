package httpapi_test

// Operating task queues over HTTP (issue 12): list tasks and dead letters,
// requeue and purge, stats, pause and resume. Real Redis, the real handler.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/admin"
	"github.com/orderdelay/orderdelay/internal/httpapi"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

const (
	opsProducerToken = "producer-token-0123456789"
	opsAdminToken    = "admin-token-0123456789abc"
)

type opsEnv struct {
	url      string // the API's listener (Server.Handler)
	adminURL string // the admin listener (Server.AdminHandler)
	rdb      *redis.Client
	jobs     queue.Keys
	cl       *client.Client
	orders   queue.Keys     // the order queue
	oc       *client.Client // on the order queue
}

// newOpsAPI serves "jobs" (poll) and "confirm" (sql, not running) with a
// producer token and, if withAdmin, an admin token.
func newOpsAPI(t *testing.T, withAdmin bool) *opsEnv {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	prefix := strings.TrimSuffix(keys.Queue, ":order")
	f, err := tasks.Parse([]byte(fmt.Sprintf(`queues:
  - {name: jobs, key: %q, lease: 1m, action: {type: poll}, retry: {max_attempts: 3}}
  - {name: confirm, key: %q, action: {type: sql, statement: "SELECT unnest($1::text[])"}}
`, prefix+":jobs", prefix+":confirm")))
	if err != nil {
		t.Fatal(err)
	}
	e := &opsEnv{rdb: rdb, jobs: queue.NewKeys(prefix + ":jobs"), orders: keys}
	t.Cleanup(func() {
		testenv.DeleteQueue(rdb, e.jobs)
		testenv.DeleteQueue(rdb, queue.NewKeys(prefix+":confirm"))
	})
	if e.cl, err = client.New(rdb, e.jobs.Queue); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "t", "t")
	mgr, err := tasks.NewManager(f, rdb, nil, metrics.NewTaskFamilies(reg, m), zap.NewNop(), "test")
	if err != nil {
		t.Fatal(err)
	}
	if e.oc, err = client.New(rdb, keys.Queue); err != nil {
		t.Fatal(err)
	}
	api := httpapi.New(httpapi.Config{Tokens: []string{opsProducerToken}}, producer.New(e.oc, m, time.Now), m, reg, zap.NewNop())
	if withAdmin {
		tools, err := admin.New(rdb, keys.Queue, nil)
		if err != nil {
			t.Fatal(err)
		}
		api.EnableAdmin(httpapi.AdminConfig{Tokens: []string{opsAdminToken}, Tools: tools})
	}
	api.EnableTasks(mgr)
	srv := httptest.NewServer(api.Handler())
	t.Cleanup(srv.Close)
	e.url = srv.URL
	adm := httptest.NewServer(api.AdminHandler())
	t.Cleanup(adm.Close)
	e.adminURL = adm.URL
	return e
}

// call sends a request to the API's listener, or to the admin listener for
// a path under /admin/.
func (e *opsEnv) call(t *testing.T, token, method, path, body string) reply {
	t.Helper()
	base := e.url
	if strings.HasPrefix(path, "/admin/") {
		base = e.adminURL
	}
	return e.callAt(t, base, token, method, path, body)
}

// callAt sends a request to the listener at base.
func (e *opsEnv) callAt(t *testing.T, base, token, method, path, body string) reply {
	t.Helper()
	var h []string
	if token != "" {
		h = []string{"Authorization", "Bearer " + token}
	}
	return do(t, method, base+path, body, h...)
}

// put puts tasks on jobs with payload {"n":i}, due at due.
func (e *opsEnv) put(t *testing.T, due time.Time, ids ...string) {
	t.Helper()
	for i, id := range ids {
		if _, _, err := e.cl.PutTask(context.Background(), id, json.RawMessage(fmt.Sprintf(`{"n":%d}`, i)), due, client.Create); err != nil {
			t.Fatal(err)
		}
	}
}

// kill dead-letters queued tasks of jobs as a failed action does: out of
// the queue, into the dead set with a record, payload kept.
func (e *opsEnv) kill(t *testing.T, ids ...string) { kill(t, e.rdb, e.jobs, ids...) }

// kill dead-letters queued entries of the queue with keys k (tasks or
// orders) as a failed action does.
func kill(t *testing.T, rdb *redis.Client, k queue.Keys, ids ...string) {
	t.Helper()
	ctx := context.Background()
	for _, id := range ids {
		d, err := rdb.ZScore(ctx, k.Queue, id).Result()
		if err != nil {
			t.Fatal(err)
		}
		rdb.ZRem(ctx, k.Queue, id)
		rdb.ZAdd(ctx, k.Dead, redis.Z{Member: id, Score: float64(time.Now().UnixMilli())})
		rdb.HSet(ctx, k.DeadInfo, id, fmt.Sprintf("failed|3|%d|webhook https://x.example: status 503", int64(d)))
	}
}

type listReply struct {
	Tasks []struct {
		ID        string          `json:"id"`
		State     string          `json:"state"`
		Due       time.Time       `json:"due"`
		Attempts  int             `json:"attempts"`
		Until     *time.Time      `json:"until"`
		Reason    string          `json:"reason"`
		LastError string          `json:"last_error"`
		DeadAt    *time.Time      `json:"dead_lettered_at"`
		Payload   json.RawMessage `json:"payload"`
	} `json:"tasks"`
	Next string `json:"next"`
}

func decode[T any](t *testing.T, r reply, code int) T {
	t.Helper()
	var v T
	if r.code != code {
		t.Fatalf("status %d (%s), want %d", r.code, r.raw, code)
	}
	if err := json.Unmarshal([]byte(r.raw), &v); err != nil {
		t.Fatalf("%s: %v", r.raw, err)
	}
	return v
}

func TestListTasksPagesEveryStateWithCursors(t *testing.T) {
	e := newOpsAPI(t, false)
	due := time.Now().Add(-time.Minute).Truncate(time.Millisecond)
	e.put(t, due, "a", "b", "c", "d", "e")
	// Page through pending tasks two at a time.
	var got []string
	path := "/v1/queues/jobs/tasks?state=pending&limit=2"
	for range 10 {
		l := decode[listReply](t, e.call(t, opsProducerToken, http.MethodGet, path, ""), http.StatusOK)
		for _, tk := range l.Tasks {
			got = append(got, tk.ID)
			if tk.State != "queued" || !tk.Due.Equal(due) || tk.Payload != nil {
				t.Errorf("pending %+v: want queued, due %v, no payload unless asked", tk, due)
			}
		}
		if l.Next == "" {
			break
		}
		path = "/v1/queues/jobs/tasks?state=pending&limit=2&after=" + url.QueryEscape(l.Next)
	}
	if strings.Join(got, ",") != "a,b,c,d,e" {
		t.Errorf("paged %v, want a..e once each in due order", got)
	}
	l := decode[listReply](t, e.call(t, opsProducerToken, http.MethodGet, "/v1/queues/jobs/tasks?payload=true&limit=1", ""), http.StatusOK)
	if len(l.Tasks) != 1 || string(l.Tasks[0].Payload) != `{"n":0}` || l.Next == "" {
		t.Errorf("default state with payload: %+v, want a's payload and a next cursor", l)
	}

	// A poll leases three: they are inflight, with the lease's end.
	if r := e.call(t, opsProducerToken, http.MethodPost, "/v1/queues/jobs/poll?max=3", ""); r.code != http.StatusOK {
		t.Fatalf("poll: %d %s", r.code, r.raw)
	}
	l = decode[listReply](t, e.call(t, opsProducerToken, http.MethodGet, "/v1/queues/jobs/tasks?state=inflight", ""), http.StatusOK)
	if len(l.Tasks) != 3 || l.Next != "" {
		t.Fatalf("inflight: %+v, want the 3 polled and no next page", l)
	}
	for _, tk := range l.Tasks {
		if tk.State != "leased" || tk.Until == nil || !tk.Until.After(time.Now()) || !tk.Due.Equal(due) {
			t.Errorf("inflight %+v: want leased until after now, true due time %v", tk, due)
		}
	}

	// Dead letters carry reason, attempts and last error.
	e.kill(t, "d")
	l = decode[listReply](t, e.call(t, opsProducerToken, http.MethodGet, "/v1/queues/jobs/tasks?state=dead&payload=1", ""), http.StatusOK)
	if len(l.Tasks) != 1 {
		t.Fatalf("dead: %+v, want d", l)
	}
	if d := l.Tasks[0]; d.ID != "d" || d.State != "dead" || d.Reason != "failed" || d.Attempts != 3 ||
		!strings.Contains(d.LastError, "503") || d.DeadAt == nil || !d.Due.Equal(due) || string(d.Payload) != `{"n":3}` {
		t.Errorf("dead letter %+v", d)
	}
}

func TestTaskOpsRefuseMalformedInput(t *testing.T) {
	e := newOpsAPI(t, true)
	e.put(t, time.Now().Add(time.Hour), "x")
	cases := []struct {
		name, token, method, path, body string
		code                            int
	}{
		{"bad state", opsProducerToken, "GET", "/v1/queues/jobs/tasks?state=done", "", 400},
		{"limit 0", opsProducerToken, "GET", "/v1/queues/jobs/tasks?limit=0", "", 400},
		{"limit huge", opsProducerToken, "GET", "/v1/queues/jobs/tasks?limit=1001", "", 400},
		{"limit not a number", opsProducerToken, "GET", "/v1/queues/jobs/tasks?limit=ten", "", 400},
		{"bad cursor", opsProducerToken, "GET", "/v1/queues/jobs/tasks?after=%25%25", "", 400},
		{"cursor without id", opsProducerToken, "GET", "/v1/queues/jobs/tasks?after=MTIz", "", 400},
		{"bad payload flag", opsProducerToken, "GET", "/v1/queues/jobs/tasks?payload=maybe", "", 400},
		{"unknown queue list", opsProducerToken, "GET", "/v1/queues/nope/tasks", "", 404},
		{"unknown queue stats", opsProducerToken, "GET", "/v1/queues/nope/stats", "", 404},
		{"unknown queue requeue", opsAdminToken, "POST", "/admin/v1/queues/nope/dead/requeue", `{"all":true}`, 404},
		{"unknown queue pause", opsAdminToken, "POST", "/admin/v1/queues/nope/pause", "", 404},
		{"requeue empty body", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", "", 400},
		{"requeue empty object", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{}`, 400},
		{"requeue both", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"ids":["x"],"all":true}`, 400},
		{"requeue no ids", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"ids":[]}`, 400},
		{"requeue bad id", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"ids":[""]}`, 400},
		{"requeue control char", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"ids":["a\u0001"]}`, 400},
		{"requeue too many", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"ids":[` + strings.Repeat(`"a",`, 1000) + `"a"]}`, 400},
		{"requeue unknown field", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"serials":["x"]}`, 400},
		{"requeue not JSON", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `ids=x`, 400},
		{"purge empty body", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/purge", "", 400},
		{"purge two selectors", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/purge", `{"all":true,"older_than":"1h"}`, 400},
		{"purge bad duration", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/purge", `{"older_than":"a week"}`, 400},
		{"purge negative duration", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/purge", `{"older_than":"-1h"}`, 400},
		{"purge no ids", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/purge", `{"ids":[]}`, 400},
		{"pause unknown field", opsAdminToken, "POST", "/admin/v1/queues/jobs/pause", `{"why":"x"}`, 400},
		// Strict JSON, like the public API's: nothing after the value.
		{"requeue trailing garbage", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"ids":["zz"]} garbage`, 400},
		{"requeue two values", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"all":true}{"all":true}`, 400},
		{"requeue stray brace", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"all":true}}`, 400},
		{"purge trailing garbage", opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/purge", `{"all":true} x`, 400},
		{"pause trailing garbage", opsAdminToken, "POST", "/admin/v1/queues/jobs/pause", `{"reason":"x"} x`, 400},
		{"resume with a body", opsAdminToken, "POST", "/admin/v1/queues/jobs/resume", `{"reason":"x"}`, 400},
		// Auth: destructive operations need the admin token; reads a producer's.
		{"requeue producer token", opsProducerToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"all":true}`, 401},
		{"purge producer token", opsProducerToken, "POST", "/admin/v1/queues/jobs/dead/purge", `{"all":true}`, 401},
		{"pause producer token", opsProducerToken, "POST", "/admin/v1/queues/jobs/pause", ``, 401},
		{"resume producer token", opsProducerToken, "POST", "/admin/v1/queues/jobs/resume", ``, 401},
		{"pause no token", "", "POST", "/admin/v1/queues/jobs/pause", ``, 401},
		{"list no token", "", "GET", "/v1/queues/jobs/tasks", ``, 401},
		{"queues no token", "", "GET", "/v1/queues", ``, 401},
		{"stats admin token", opsAdminToken, "GET", "/v1/queues/jobs/stats", ``, 401},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			wantAnyProblem(t, e.call(t, c.token, c.method, c.path, c.body), c.code)
		})
	}
	// Nothing changed: x is still queued, the queue not paused.
	if n, _ := e.rdb.ZCard(context.Background(), e.jobs.Queue).Result(); n != 1 {
		t.Errorf("%d queued after refused requests, want 1", n)
	}
	if n, _ := e.rdb.Exists(context.Background(), e.jobs.Paused).Result(); n != 0 {
		t.Error("queue paused by a refused request")
	}
}

// Without ORDERDELAY_ADMIN_TOKEN there is no admin API (the daemon does not
// even bind its listener): its handler refuses every call with 403 whatever
// the token.
func TestTaskOpsNeedAnAdminTokenConfigured(t *testing.T) {
	e := newOpsAPI(t, false)
	for _, p := range []string{"dead/requeue", "dead/purge", "pause", "resume"} {
		r := e.call(t, opsProducerToken, http.MethodPost, "/admin/v1/queues/jobs/"+p, `{"all":true}`)
		wantAnyProblem(t, r, http.StatusForbidden)
		if !strings.Contains(r.body.Detail, "ORDERDELAY_ADMIN_TOKEN") {
			t.Errorf("%s: %q does not name ORDERDELAY_ADMIN_TOKEN", p, r.body.Detail)
		}
	}
}

func TestRequeueAndPurgeDeadLettersOverHTTP(t *testing.T) {
	e := newOpsAPI(t, true)
	ctx := context.Background()
	e.put(t, time.Now().Add(-time.Minute), "r1", "r2", "r3", "r4", "r5")
	e.kill(t, "r1", "r2", "r3", "r4", "r5")
	// r2 is put again by a producer for later: it is live.
	later := time.Now().Add(time.Hour)
	if _, _, err := e.cl.PutTask(ctx, "r2", json.RawMessage(`{"v":"live"}`), later, client.Create); err != nil {
		t.Fatal(err)
	}
	type requeued struct {
		Requeued int `json:"requeued"`
		Skipped  []struct {
			ID  string `json:"id"`
			Why string `json:"why"`
		} `json:"skipped"`
		DeadLeft *int64 `json:"dead_left"`
	}
	res := decode[requeued](t, e.call(t, opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"ids":["r1","r2","zz"]}`), 200)
	if res.Requeued != 1 || len(res.Skipped) != 2 || res.Skipped[0].ID != "r2" || res.Skipped[1].ID != "zz" {
		t.Errorf("requeue: %+v, want r1 requeued, r2 (live) and zz (not dead) skipped", res)
	}
	tk, err := e.cl.GetTask(ctx, "r1")
	if err != nil || tk.State != client.StateQueued || tk.Deadline.After(time.Now().Add(time.Second)) || string(tk.Payload) != `{"n":0}` {
		t.Errorf("r1 after requeue: %+v %v, want queued, due now, payload kept", tk, err)
	}
	tk, err = e.cl.GetTask(ctx, "r2")
	if err != nil || tk.Deadline.UnixMilli() != queue.DeadlineMillis(later) || string(tk.Payload) != `{"v":"live"}` {
		t.Errorf("live r2 after requeue: %+v %v, want its own due time and payload", tk, err)
	}

	// Purge one by id, then the rest but the live one's dead letter by age.
	pr := decode[map[string]int](t, e.call(t, opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/purge", `{"ids":["r3"]}`), 200)
	if pr["purged"] != 1 {
		t.Errorf("purge r3: %v", pr)
	}
	if ok, _ := e.rdb.HExists(ctx, e.jobs.Payload, "r3").Result(); ok {
		t.Error("purged r3 keeps its payload")
	}
	pr = decode[map[string]int](t, e.call(t, opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/purge", `{"older_than":"1h"}`), 200)
	if pr["purged"] != 0 {
		t.Errorf("purge older than 1h: %v, want none (they died just now)", pr)
	}
	res = decode[requeued](t, e.call(t, opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/requeue", `{"all":true}`), 200)
	if res.Requeued != 2 || len(res.Skipped) != 1 || res.DeadLeft == nil || *res.DeadLeft != 1 {
		t.Errorf("requeue all: %+v, want r4 and r5 requeued, r2 skipped and left", res)
	}
	pr = decode[map[string]int](t, e.call(t, opsAdminToken, "POST", "/admin/v1/queues/jobs/dead/purge", `{"all":true}`), 200)
	if pr["purged"] != 1 {
		t.Errorf("purge all: %v, want r2's dead letter", pr)
	}
	if p, _ := e.rdb.HGet(ctx, e.jobs.Payload, "r2").Result(); p != `{"v":"live"}` {
		t.Errorf("live r2's payload %q after purging its dead letter", p)
	}
}

func TestQueueStatsAndPauseOverHTTP(t *testing.T) {
	e := newOpsAPI(t, true)
	e.put(t, time.Now().Add(-time.Minute), "s1", "s2")
	e.put(t, time.Now().Add(time.Hour), "s3")
	e.kill(t, "s2")
	type stats struct {
		Queue    string  `json:"queue"`
		Action   string  `json:"action"`
		Pending  int64   `json:"pending"`
		Due      int64   `json:"due"`
		Inflight int64   `json:"inflight"`
		Dead     int64   `json:"dead"`
		Oldest   float64 `json:"oldest_overdue_seconds"`
		Paused   bool    `json:"paused"`
		Reason   string  `json:"paused_reason"`
	}
	s := decode[stats](t, e.call(t, opsProducerToken, "GET", "/v1/queues/jobs/stats", ""), 200)
	if s.Queue != "jobs" || s.Action != "poll" || s.Pending != 2 || s.Due != 1 || s.Inflight != 0 || s.Dead != 1 || s.Oldest < 59 || s.Paused {
		t.Errorf("stats %+v, want 2 pending, 1 due for about a minute, 1 dead, not paused", s)
	}
	p := decode[stats](t, e.call(t, opsAdminToken, "POST", "/admin/v1/queues/jobs/pause", `{"reason":"partner down"}`), 200)
	if !p.Paused {
		t.Errorf("pause answered %+v", p)
	}
	r := decode[polled](t, e.call(t, opsProducerToken, "POST", "/v1/queues/jobs/poll?max=10", ""), 200)
	if len(r.Tasks) != 0 {
		t.Errorf("a paused queue's poll returned %d tasks", len(r.Tasks))
	}
	all := decode[struct{ Queues []stats }](t, e.call(t, opsProducerToken, "GET", "/v1/queues", ""), 200)
	if len(all.Queues) != 2 || all.Queues[0].Queue != "jobs" || !all.Queues[0].Paused || all.Queues[0].Reason != "partner down" ||
		all.Queues[1].Queue != "confirm" || all.Queues[1].Action != "sql" || all.Queues[1].Paused {
		t.Errorf("queues %+v, want jobs (paused, with the reason) and confirm (sql)", all.Queues)
	}
	decode[stats](t, e.call(t, opsAdminToken, "POST", "/admin/v1/queues/jobs/resume", ""), 200)
	r = decode[polled](t, e.call(t, opsProducerToken, "POST", "/v1/queues/jobs/poll?max=10", ""), 200)
	if len(r.Tasks) != 1 || r.Tasks[0].ID != "s1" {
		t.Errorf("resumed poll: %+v, want s1", r.Tasks)
	}
	s = decode[stats](t, e.call(t, opsProducerToken, "GET", "/v1/queues/jobs/stats", ""), 200)
	if s.Pending != 1 || s.Inflight != 1 || s.Due != 1 || s.Paused {
		t.Errorf("stats after the poll %+v, want s3 pending, s1 inflight and still overdue", s)
	}
}
