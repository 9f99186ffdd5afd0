package httpapi_test

// Producing tasks as users expect (issue 12, item 3): ids made by the
// service, Idempotency-Key, batch create, on plain and durable queues.
// Real Redis and PostgreSQL, the real handler.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/oklog/ulid/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/httpapi"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// produceEnv serves "plain" (webhook, its consumer not running) and, with a
// database, "durable" (sql, durable, its consumer not running).
type produceEnv struct {
	h       http.Handler
	api     *httpapi.Server
	rdb     *redis.Client
	db      *sqlx.DB
	plain   queue.Keys
	durable queue.Keys
}

func newProduceAPI(t *testing.T, withDB bool) *produceEnv {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	prefix := strings.TrimSuffix(keys.Queue, ":order")
	e := &produceEnv{rdb: rdb, plain: queue.NewKeys(prefix + ":plain"), durable: queue.NewKeys(prefix + ":durable")}
	yaml := fmt.Sprintf("queues:\n  - {name: plain, key: %q, action: {type: poll}}\n", e.plain.Queue)
	if withDB {
		e.db, _ = testenv.Postgres(t)
		yaml += fmt.Sprintf("  - {name: durable, key: %q, durable: true, window: 5m, action: {type: sql, statement: \"SELECT unnest($1::text[])\"}}\n", e.durable.Queue)
	}
	t.Cleanup(func() {
		testenv.DeleteQueue(rdb, e.plain)
		testenv.DeleteQueue(rdb, e.durable)
	})
	f, err := tasks.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "t", "t")
	mgr, err := tasks.NewManager(f, rdb, e.db, metrics.NewTaskFamilies(reg, m), zap.NewNop(), "test")
	if err != nil {
		t.Fatal(err)
	}
	c, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	api := httpapi.New(httpapi.Config{}, producer.New(c, m, time.Now), m, reg, zap.NewNop())
	api.EnableTasks(mgr)
	e.h, e.api = api.Handler(), api
	return e
}

type created struct {
	code     int
	raw      string
	location string
	Detail   string    `json:"detail"`
	ID       string    `json:"id"`
	Result   string    `json:"result"`
	Deadline time.Time `json:"deadline"`
}

func (e *produceEnv) post(t *testing.T, path, body string, header ...string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	rec := httptest.NewRecorder()
	e.h.ServeHTTP(rec, req)
	return rec
}

func (e *produceEnv) create(t *testing.T, q, body string, header ...string) created {
	t.Helper()
	rec := e.post(t, "/v1/queues/"+q+"/tasks", body, header...)
	c := created{code: rec.Code, raw: rec.Body.String(), location: rec.Header().Get("Location")}
	if err := json.Unmarshal(rec.Body.Bytes(), &c); err != nil {
		t.Fatalf("POST %s: %d %q: %v", q, rec.Code, c.raw, err)
	}
	return c
}

func (e *produceEnv) payload(t *testing.T, k queue.Keys, id string) string {
	t.Helper()
	p, err := e.rdb.HGet(context.Background(), k.Payload, id).Result()
	if err != nil {
		t.Fatalf("payload of %s: %v", id, err)
	}
	return p
}

func (e *produceEnv) count(t *testing.T, k queue.Keys) int64 {
	t.Helper()
	n, err := e.rdb.ZCard(context.Background(), k.Queue).Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// POST without an id: the service names each task with a ULID, ids made
// one after another sort in that order, and Location leads to the task.
func TestCreateTaskNamesItWithTimeOrderedIDs(t *testing.T) {
	e := newProduceAPI(t, false)
	var got []string
	for i := range 20 {
		c := e.create(t, "plain", fmt.Sprintf(`{"after":"5m","payload":{"n":%d}}`, i))
		if c.code != http.StatusCreated || c.Result != "created" {
			t.Fatalf("POST %d: %d %s, want 201 created", i, c.code, c.raw)
		}
		if _, err := ulid.ParseStrict(c.ID); err != nil {
			t.Fatalf("id %q is not a ULID: %v", c.ID, err)
		}
		if c.location != "/v1/queues/plain/tasks/"+c.ID {
			t.Errorf("Location = %q, want /v1/queues/plain/tasks/%s", c.location, c.ID)
		}
		if p := e.payload(t, e.plain, c.ID); p != fmt.Sprintf(`{"n":%d}`, i) {
			t.Errorf("task %s payload %s, want {\"n\":%d}", c.ID, p, i)
		}
		got = append(got, c.ID)
	}
	if !slices.IsSorted(got) || len(slices.Compact(slices.Clone(got))) != len(got) {
		t.Errorf("ids in creation order %v: want strictly increasing", got)
	}
	rec := httptest.NewRecorder()
	e.h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/v1/queues/plain/tasks/"+got[3], nil))
	if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), `"payload":{"n":3}`) {
		t.Errorf("GET Location: %d %s, want the task with payload {\"n\":3}", rec.Code, rec.Body)
	}
	if n := e.count(t, e.plain); n != 20 {
		t.Errorf("queue holds %d tasks, want 20", n)
	}
}

// An Idempotency-Key makes a retried POST find the task its first attempt
// made; the same key with another payload is 409 and changes nothing.
func TestCreateTaskWithIdempotencyKey(t *testing.T) {
	e := newProduceAPI(t, true)
	for _, q := range []string{"plain", "durable"} {
		t.Run(q, func(t *testing.T) {
			first := e.create(t, q, `{"after":"1m","payload":{"a":1,"b":[1,2]}}`, "Idempotency-Key", "order-7-confirm")
			if first.code != http.StatusCreated {
				t.Fatalf("first POST: %d %s, want 201", first.code, first.raw)
			}
			// A retry, its payload spelled differently (jsonb keeps no bytes).
			again := e.create(t, q, `{"after":"2m","payload":{"b":[1,2], "a":1}}`, "Idempotency-Key", "order-7-confirm")
			if again.code != http.StatusOK || again.ID != first.ID || again.Result != "unchanged" ||
				!again.Deadline.Equal(first.Deadline) || again.location != first.location {
				t.Errorf("retry: %d %s (Location %q), want 200 unchanged, id %s, deadline %s, same Location",
					again.code, again.raw, again.location, first.ID, first.Deadline)
			}
			other := e.create(t, q, `{"after":"1m","payload":{"a":2}}`, "Idempotency-Key", "order-7-confirm")
			if other.code != http.StatusConflict || other.ID != first.ID || other.Detail == "" {
				t.Errorf("same key, other payload: %d %s, want 409 naming %s", other.code, other.raw, first.ID)
			}
			otherKey := e.create(t, q, `{"after":"1m","payload":{"a":1,"b":[1,2]}}`, "Idempotency-Key", "order-8-confirm")
			if otherKey.code != http.StatusCreated || otherKey.ID == first.ID {
				t.Errorf("another key: %d %s, want 201 with an id other than %s", otherKey.code, otherKey.raw, first.ID)
			}
		})
	}
	if p := e.payload(t, e.plain, idOf(t, e, "plain", "order-7-confirm")); p != `{"a":1,"b":[1,2]}` {
		t.Errorf("plain task payload after the 409: %s, want the first one", p)
	}
	var n int
	var p string
	if err := e.db.QueryRow(`SELECT count(*), min(payload::text) FROM orderdelay_tasks WHERE queue = 'durable'`).Scan(&n, &p); err != nil {
		t.Fatal(err)
	}
	if n != 2 || p != `{"a": 1, "b": [1, 2]}` {
		t.Errorf("durable rows: %d, payload %s; want 2 rows (two keys), the first payload kept", n, p)
	}
}

// idOf is the id a POST with key made on q (a retry answers it).
func idOf(t *testing.T, e *produceEnv, q, key string) string {
	t.Helper()
	c := e.create(t, q, `{"after":"1m","payload":{"a":1,"b":[1,2]}}`, "Idempotency-Key", key)
	return c.ID
}

// Every malformed POST is refused with a JSON error and writes nothing.
func TestCreateTaskRefusesMalformedRequests(t *testing.T) {
	e := newProduceAPI(t, false)
	deep := strings.Repeat("[", client.MaxPayloadDepth+1) + strings.Repeat("]", client.MaxPayloadDepth+1)
	for _, tc := range []struct {
		name, body string
		header     []string
		code       int
	}{
		{"not json", `{"after":`, nil, 400},
		{"unknown field", `{"after":"1m","reschedule":true}`, nil, 400},
		{"an id", `{"id":"x","after":"1m"}`, nil, 400},
		{"trailing data", `{"after":"1m"} {}`, nil, 400},
		{"no due time", `{"payload":{}}`, nil, 400},
		{"after and at", `{"after":"1m","at":"2030-01-01T00:00:00Z"}`, nil, 400},
		{"negative after", `{"after":"-1m"}`, nil, 400},
		{"bad at", `{"at":"tomorrow"}`, nil, 400},
		{"at too far", `{"at":"2999-01-01T00:00:00Z"}`, nil, 400},
		{"payload not json", `{"after":"1m","payload":nope}`, nil, 400},
		{"payload too deep", `{"after":"1m","payload":` + deep + `}`, nil, 400},
		{"payload too large", `{"after":"1m","payload":"` + strings.Repeat("x", client.MaxPayloadBytes) + `"}`, nil, 400},
		{"body too large", `{"after":"1m","payload":"` + strings.Repeat("x", client.MaxPayloadBytes+httpapi.MaxBodyBytes) + `"}`, nil, 413},
		{"empty key", `{"after":"1m"}`, []string{"Idempotency-Key", ""}, 400},
		{"key too long", `{"after":"1m"}`, []string{"Idempotency-Key", strings.Repeat("k", 256)}, 400},
		{"key not ascii", `{"after":"1m"}`, []string{"Idempotency-Key", "schlüssel"}, 400},
		{"two keys", `{"after":"1m"}`, []string{"Idempotency-Key", "a", "Idempotency-Key", "b"}, 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := e.post(t, "/v1/queues/plain/tasks", tc.body, tc.header...)
			var b struct{ Detail string }
			if rec.Code != tc.code || json.Unmarshal(rec.Body.Bytes(), &b) != nil || b.Detail == "" {
				t.Errorf("%d %.200s, want %d with a problem", rec.Code, rec.Body, tc.code)
			}
		})
	}
	if n := e.count(t, e.plain); n != 0 {
		t.Errorf("queue holds %d tasks after refused requests, want 0", n)
	}
	if rec := e.post(t, "/v1/queues/nope/tasks", `{"after":"1m"}`); rec.Code != http.StatusNotFound {
		t.Errorf("unknown queue: %d, want 404", rec.Code)
	}
}

type batchAnswer struct {
	code    int
	raw     string
	Detail  string `json:"detail"`
	Invalid []struct {
		Index int    `json:"index"`
		Error string `json:"error"`
	} `json:"invalid"`
	Tasks []struct {
		Index    int       `json:"index"`
		ID       string    `json:"id"`
		Result   string    `json:"result"`
		Deadline time.Time `json:"deadline"`
	} `json:"tasks"`
}

func (e *produceEnv) batch(t *testing.T, q, body string, header ...string) batchAnswer {
	t.Helper()
	rec := e.post(t, "/v1/queues/"+q+"/tasks/batch", body, header...)
	a := batchAnswer{code: rec.Code, raw: rec.Body.String()}
	if err := json.Unmarshal(rec.Body.Bytes(), &a); err != nil {
		t.Fatalf("batch %s: %d %.300q: %v", q, rec.Code, a.raw, err)
	}
	return a
}

// A batch creates each task in order, named or not, and answers per task;
// a retried batch finds what the first made (ids given or derived from the
// Idempotency-Key), on plain and durable queues.
func TestBatchCreate(t *testing.T) {
	e := newProduceAPI(t, true)
	for _, q := range []string{"plain", "durable"} {
		t.Run(q, func(t *testing.T) {
			body := `{"tasks":[{"id":"named-1","after":"1m","payload":{"n":0}},{"after":"2m","payload":{"n":1}},{"at":"2030-01-01T00:00:00Z"}]}`
			a := e.batch(t, q, body)
			if a.code != http.StatusOK || len(a.Tasks) != 3 {
				t.Fatalf("batch: %d %s, want 200 with 3 results", a.code, a.raw)
			}
			for i, r := range a.Tasks {
				if r.Index != i || r.Result != "created" {
					t.Errorf("result %d: %+v, want index %d created", i, r, i)
				}
			}
			if a.Tasks[0].ID != "named-1" {
				t.Errorf("ids %+v: want named-1 first", a.Tasks)
			}
			if _, err := ulid.ParseStrict(a.Tasks[1].ID); err != nil || a.Tasks[2].ID <= a.Tasks[1].ID {
				t.Errorf("made ids %q, %q: want increasing ULIDs (%v)", a.Tasks[1].ID, a.Tasks[2].ID, err)
			}
			if !a.Tasks[2].Deadline.Equal(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)) {
				t.Errorf("deadline of the third: %s", a.Tasks[2].Deadline)
			}
			again := e.batch(t, q, body)
			if again.code != http.StatusOK || again.Tasks[0].Result != "exists" || !again.Tasks[0].Deadline.Equal(a.Tasks[0].Deadline) {
				t.Errorf("retried batch: %d %s, want named-1 to exist with its first deadline %s", again.code, again.raw, a.Tasks[0].Deadline)
			}

			keyed := `{"tasks":[{"after":"1m","payload":{"k":0}},{"after":"1m","payload":{"k":1}}]}`
			k1 := e.batch(t, q, keyed, "Idempotency-Key", "batch-42")
			k2 := e.batch(t, q, keyed, "Idempotency-Key", "batch-42")
			if k1.code != 200 || k2.code != 200 || k1.Tasks[0].ID == k1.Tasks[1].ID ||
				k2.Tasks[0].ID != k1.Tasks[0].ID || k2.Tasks[1].ID != k1.Tasks[1].ID ||
				k1.Tasks[1].Result != "created" || k2.Tasks[1].Result != "exists" {
				t.Errorf("keyed batch twice: %s then %s, want the same two ids, created then exists", k1.raw, k2.raw)
			}
		})
	}
	// named-1, two made by the first batch, two by the second, two keyed.
	if n := e.count(t, e.plain); n != 2+2+2+1 {
		t.Errorf("plain queue holds %d tasks, want 7", n)
	}
	var n int
	if err := e.db.Get(&n, `SELECT count(*) FROM orderdelay_tasks WHERE queue = 'durable'`); err != nil || n != 7 {
		t.Errorf("durable rows: %d (%v), want 7", n, err)
	}
	var inRedis int64
	inRedis, _ = e.rdb.ZCard(context.Background(), e.durable.Queue).Result()
	if inRedis != 5 {
		t.Errorf("durable queue in Redis: %d tasks, want the 5 due within the window", inRedis)
	}
}

// One bad task refuses the whole batch: 400 naming every bad one by index,
// nothing written. Malformed bodies and batches out of bounds, too.
func TestBatchCreateIsAllOrNothingAtTheDoor(t *testing.T) {
	e := newProduceAPI(t, true)
	deep := strings.Repeat("[", client.MaxPayloadDepth+1) + strings.Repeat("]", client.MaxPayloadDepth+1)
	for _, q := range []string{"plain", "durable"} {
		a := e.batch(t, q, `{"tasks":[{"after":"1m"},{"after":"1m","payload":`+deep+`},{"after":"1m"},{"id":"bad\u0001id","after":"1m"},{"id":""},{"id":"ok"}]}`)
		var idx []int
		for _, iv := range a.Invalid {
			idx = append(idx, iv.Index)
			if iv.Error == "" {
				t.Errorf("%s: invalid %d without a reason", q, iv.Index)
			}
		}
		if a.code != http.StatusBadRequest || !slices.Equal(idx, []int{1, 3, 4, 5}) || !strings.Contains(a.Detail, "nothing was written") {
			t.Errorf("%s: %d %s, want 400 naming tasks 1, 3, 4 and 5", q, a.code, a.raw)
		}
	}
	many := `{"tasks":[` + strings.TrimSuffix(strings.Repeat(`{"after":"1m"},`, httpapi.MaxBatchTasks+1), ",") + `]}`
	huge := `{"tasks":[` + strings.TrimSuffix(strings.Repeat(`{"after":"1m","payload":"`+strings.Repeat("x", 60<<10)+`"},`, 80), ",") + `]}`
	for _, tc := range []struct {
		name, body string
		code       int
	}{
		{"not json", `{"tasks":[`, 400},
		{"not a list", `{"tasks":{}}`, 400},
		{"unknown field", `{"tasks":[{"after":"1m"}],"mode":"x"}`, 400},
		{"unknown item field", `{"tasks":[{"after":"1m","reschedule":true}]}`, 400},
		{"no tasks", `{"tasks":[]}`, 400},
		{"too many", many, 400},
		{"too many bytes", huge, 413},
		{"trailing data", `{"tasks":[{"after":"1m"}]}]`, 400},
	} {
		a := e.batch(t, "plain", tc.body)
		if a.code != tc.code || a.Detail == "" {
			t.Errorf("%s: %d %.200s, want %d with an error", tc.name, a.code, a.raw, tc.code)
		}
	}
	if rec := e.post(t, "/v1/queues/plain/tasks/batch", `{"tasks":[{"after":"1m"}]}`, "Idempotency-Key", "\x7f"); rec.Code != 400 {
		t.Errorf("bad Idempotency-Key: %d, want 400", rec.Code)
	}
	if n := e.count(t, e.plain); n != 0 {
		t.Errorf("plain queue holds %d tasks after refused batches, want 0", n)
	}
	var n int
	if err := e.db.Get(&n, `SELECT count(*) FROM orderdelay_tasks`); err != nil || n != 0 {
		t.Errorf("durable rows after refused batches: %d (%v), want 0", n, err)
	}
}

// A batch cut short by the store answers 503 with what was written, and
// a retry finds those tasks instead of creating them twice.
func TestBatchCreateCutShortAnswers503(t *testing.T) {
	e := newProduceAPI(t, true)
	body := `{"tasks":[{"id":"a","after":"1m"},{"id":"b","after":"1m"}]}`
	if err := e.db.Close(); err != nil {
		t.Fatal(err)
	}
	a := e.batch(t, "durable", body)
	if a.code != http.StatusServiceUnavailable || a.Detail == "" || a.Tasks == nil || len(a.Tasks) != 0 {
		t.Errorf("durable batch with the database gone: %d %s, want 503 with no task written", a.code, a.raw)
	}
	if err := e.rdb.Close(); err != nil {
		t.Fatal(err)
	}
	a = e.batch(t, "plain", body)
	if a.code != http.StatusServiceUnavailable || a.Detail == "" {
		t.Errorf("plain batch with Redis gone: %d %s, want 503", a.code, a.raw)
	}
	if c := e.create(t, "plain", `{"after":"1m"}`); c.code != http.StatusServiceUnavailable {
		t.Errorf("POST with Redis gone: %d %s, want 503", c.code, c.raw)
	}
}
