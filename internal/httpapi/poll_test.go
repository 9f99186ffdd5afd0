package httpapi_test

// Poll and ack of task queues (issue 12): every poll's lease has a token of
// its own that only it can ack with, and a poll's answer is bounded in
// bytes. Real Redis, the real handler.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

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

// pollLimitBytes is the documented bound of a poll's answer (docs/tasks.md).
const pollLimitBytes = 1 << 20

// pollEnv serves two task queues of the test's own: "jobs" (poll) and
// "confirm" (sql; its consumer does not run here).
type pollEnv struct {
	h       http.Handler
	rdb     *redis.Client
	jobs    queue.Keys
	confirm queue.Keys
}

func newPollAPI(t *testing.T) *pollEnv {
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
	e := &pollEnv{rdb: rdb, jobs: queue.NewKeys(prefix + ":jobs"), confirm: queue.NewKeys(prefix + ":confirm")}
	t.Cleanup(func() {
		testenv.DeleteQueue(rdb, e.jobs)
		testenv.DeleteQueue(rdb, e.confirm)
	})
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "t", "t")
	mgr, err := tasks.NewManager(f, rdb, nil, metrics.NewTaskFamilies(reg, m), zap.NewNop(), "test")
	if err != nil {
		t.Fatal(err)
	}
	c, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	api := httpapi.New(httpapi.Config{}, producer.New(c, m, time.Now), m, reg, zap.NewNop())
	api.EnableTasks(mgr)
	e.h = api.Handler()
	return e
}

// putDue puts tasks on k, due a second ago.
func (e *pollEnv) putDue(t *testing.T, k queue.Keys, payload string, ids ...string) {
	t.Helper()
	c, err := client.New(e.rdb, k.Queue)
	if err != nil {
		t.Fatal(err)
	}
	items := make([]client.TaskItem, len(ids))
	for i, id := range ids {
		items[i] = client.TaskItem{ID: id, Payload: json.RawMessage(payload), Deadline: time.Now().Add(-time.Second)}
	}
	for len(items) > 0 { // pipelines of 50: payloads may be large
		n := min(50, len(items))
		if _, err := c.PutTasks(context.Background(), items[:n], client.Create); err != nil {
			t.Fatal(err)
		}
		items = items[n:]
	}
}

type polled struct {
	code   int
	raw    []byte
	Detail string `json:"detail"`
	Token  string `json:"token"`
	Tasks  []struct {
		ID       string          `json:"id"`
		Attempts int             `json:"attempts"`
		Payload  json.RawMessage `json:"payload"`
	} `json:"tasks"`
}

func (e *pollEnv) poll(t *testing.T, queueName string, max int) polled {
	t.Helper()
	rec := httptest.NewRecorder()
	e.h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/queues/"+queueName+"/poll?max="+strconv.Itoa(max), nil))
	p := polled{code: rec.Code, raw: rec.Body.Bytes()}
	if err := json.Unmarshal(p.raw, &p); err != nil {
		t.Fatalf("poll %s: %d %q: %v", queueName, rec.Code, p.raw, err)
	}
	return p
}

type acked struct {
	code    int
	raw     string
	Detail  string `json:"detail"`
	Acked   int    `json:"acked"`
	Expired int    `json:"expired"`
}

func (e *pollEnv) ack(t *testing.T, queueName, token string, ids ...string) acked {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"token": token, "ids": ids})
	rec := httptest.NewRecorder()
	e.h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/queues/"+queueName+"/ack", strings.NewReader(string(body))))
	a := acked{code: rec.Code, raw: rec.Body.String()}
	if err := json.Unmarshal(rec.Body.Bytes(), &a); err != nil {
		t.Fatalf("ack %s: %d %q: %v", queueName, rec.Code, a.raw, err)
	}
	return a
}

// leaseToken is the token in id's lease record ("" without one).
func (e *pollEnv) leaseToken(t *testing.T, k queue.Keys, id string) string {
	t.Helper()
	rec, err := e.rdb.HGet(context.Background(), k.Lease, id).Result()
	if err == redis.Nil {
		return ""
	}
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Split(rec, "|")
	if len(f) < 3 {
		t.Fatalf("lease record of %s: %q", id, rec)
	}
	return f[2]
}

// expireLeases moves every lease of k into the past, as if its holder had
// been silent for the whole lease (no waiting).
func (e *pollEnv) expireLeases(t *testing.T, k queue.Keys) {
	t.Helper()
	ctx := context.Background()
	ids, err := e.rdb.ZRange(ctx, k.Inflight, 0, -1).Result()
	if err != nil || len(ids) == 0 {
		t.Fatalf("leases of %s: %v %v", k.Queue, ids, err)
	}
	for _, id := range ids {
		if err := e.rdb.ZAddXX(ctx, k.Inflight, redis.Z{Score: float64(queue.MinDeadline), Member: id}).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

var pollTokenShape = regexp.MustCompile(`^poll\.[A-Z2-7]{26}$`) // 128 random bits

// A consumer whose lease expired and whose task was polled again by
// another must not be able to ack (and so delete) it: each poll's lease has
// a token of its own, and ack is a compare-and-set on it.
func TestPollLeaseTokenIsUniqueAndAckIsCompareAndSet(t *testing.T) {
	e := newPollAPI(t)
	e.putDue(t, e.jobs, `{"n":1}`, "j-1")

	a := e.poll(t, "jobs", 10)
	if a.code != http.StatusOK || len(a.Tasks) != 1 || a.Tasks[0].ID != "j-1" || a.Tasks[0].Attempts != 0 {
		t.Fatalf("first poll: %d %s, want j-1 with 0 attempts", a.code, a.raw)
	}
	e.expireLeases(t, e.jobs)
	b := e.poll(t, "jobs", 10)
	if b.code != http.StatusOK || len(b.Tasks) != 1 || b.Tasks[0].ID != "j-1" || b.Tasks[0].Attempts != 1 {
		t.Fatalf("poll after the lease expired: %d %s, want j-1 with 1 attempt", b.code, b.raw)
	}
	for _, tok := range []string{a.Token, b.Token} {
		if !pollTokenShape.MatchString(tok) {
			t.Errorf("token %q, want poll. and 128 random bits (26 base32 characters)", tok)
		}
	}
	if a.Token == b.Token {
		t.Fatalf("two polls handed out the same token %q", a.Token)
	}

	late := e.ack(t, "jobs", a.Token, "j-1")
	if late.code != http.StatusConflict || late.Detail == "" || late.Acked != 0 {
		t.Errorf("ack with the expired lease's token: %d %s, want 409 with an error and nothing acked", late.code, late.raw)
	}
	if got := e.leaseToken(t, e.jobs, "j-1"); got != b.Token {
		t.Fatalf("after the late ack j-1 is leased under %q, want the second poll's %q", got, b.Token)
	}
	if n, _ := e.rdb.HExists(context.Background(), e.jobs.Payload, "j-1").Result(); !n {
		t.Fatal("the late ack deleted j-1's payload")
	}

	ok := e.ack(t, "jobs", b.Token, "j-1")
	if ok.code != http.StatusOK || ok.Acked != 1 || ok.Expired != 0 {
		t.Errorf("ack by the holder: %d %s, want 200 with 1 acked", ok.code, ok.raw)
	}
	if got := e.leaseToken(t, e.jobs, "j-1"); got != "" {
		t.Errorf("after the ack j-1 still has a lease under %q", got)
	}
	if n, _ := e.rdb.Exists(context.Background(), e.jobs.Payload).Result(); n != 0 {
		t.Error("the ack left j-1's payload behind")
	}
	again := e.ack(t, "jobs", b.Token, "j-1")
	if again.code != http.StatusConflict || again.Acked != 0 {
		t.Errorf("second ack of the same task: %d %s, want 409", again.code, again.raw)
	}

	seen := map[string]bool{}
	for i := range 20 {
		id := "u-" + strconv.Itoa(i)
		e.putDue(t, e.jobs, `{}`, id)
		p := e.poll(t, "jobs", 1)
		if len(p.Tasks) != 1 || seen[p.Token] {
			t.Fatalf("poll %d: %s (token seen before: %v)", i, p.raw, seen[p.Token])
		}
		seen[p.Token] = true
	}
}

// Ack takes only a token a poll handed out, and only on a poll queue: the
// retry marker "-" that every backing-off task of a sql or webhook queue
// carries must not delete those tasks.
func TestAckRefusesForeignTokensAndQueues(t *testing.T) {
	e := newPollAPI(t)
	ctx := context.Background()
	e.putDue(t, e.jobs, `{}`, "j-1")
	p := e.poll(t, "jobs", 10)
	if len(p.Tasks) != 1 {
		t.Fatalf("poll: %s", p.raw)
	}
	for _, c := range []struct {
		name, token string
		ids         []string
		code        int
	}{
		{"no token", "", []string{"j-1"}, http.StatusBadRequest},
		{"retry marker", "-", []string{"j-1"}, http.StatusBadRequest},
		{"old fixed token", "poll:1", []string{"j-1"}, http.StatusBadRequest},
		{"no ids", p.Token, nil, http.StatusBadRequest},
		{"well-formed, never handed out", "poll." + strings.Repeat("A", 26), []string{"j-1"}, http.StatusConflict},
	} {
		a := e.ack(t, "jobs", c.token, c.ids...)
		if a.code != c.code || a.Detail == "" || a.Acked != 0 {
			t.Errorf("%s: %d %s, want %d with an error", c.name, a.code, a.raw, c.code)
		}
	}
	if got := e.leaseToken(t, e.jobs, "j-1"); got != p.Token {
		t.Fatalf("after refused acks j-1 is leased under %q, want %q", got, p.Token)
	}

	// A task of the sql queue backing off after a failed attempt: out of
	// the queue key, its lease record carrying the retry marker.
	e.putDue(t, e.confirm, `{"receipt":7}`, "c-1")
	d := strconv.FormatInt(time.Now().Add(-time.Second).UnixMilli(), 10)
	pipe := e.rdb.TxPipeline()
	pipe.ZRem(ctx, e.confirm.Queue, "c-1")
	pipe.HSet(ctx, e.confirm.Lease, "c-1", d+"|1|-|statement failed")
	pipe.ZAdd(ctx, e.confirm.Inflight, redis.Z{Score: float64(time.Now().Add(time.Hour).UnixMilli()), Member: "c-1"})
	pipe.ZAdd(ctx, e.confirm.Deadlines, redis.Z{Score: float64(time.Now().Add(-time.Second).UnixMilli()), Member: "c-1"})
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	a := e.ack(t, "confirm", "-", "c-1")
	if a.code != http.StatusConflict || !strings.Contains(a.Detail, "poll") {
		t.Errorf("ack on a sql queue: %d %s, want 409 saying only poll queues take acks", a.code, a.raw)
	}
	if got := e.leaseToken(t, e.confirm, "c-1"); got != "-" {
		t.Errorf("after the refused ack c-1's lease token is %q, want the retry marker", got)
	}
	if ok, _ := e.rdb.HExists(ctx, e.confirm.Payload, "c-1").Result(); !ok {
		t.Error("the refused ack deleted c-1's payload")
	}
}

// sink is a ResponseWriter that counts the body and keeps its first 2 MiB,
// in a buffer allocated before the measurement.
type sink struct {
	header http.Header
	code   int
	n      int
	buf    []byte
}

func newSink() *sink { return &sink{header: http.Header{}, buf: make([]byte, 0, 2<<20)} }

func (s *sink) Header() http.Header { return s.header }
func (s *sink) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
}
func (s *sink) Write(p []byte) (int, error) {
	s.WriteHeader(http.StatusOK)
	s.n += len(p)
	if room := cap(s.buf) - len(s.buf); room > 0 {
		s.buf = append(s.buf, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

// One poll of 400 tasks of 63 KiB answered 25.8 MB and the daemon's RSS
// went from 21 to 137 MB. A poll's answer is capped in bytes: tasks past
// the cap are left due in the queue, untouched (no lease, no attempt), and
// the next polls take them.
func TestPollAnswerIsBoundedInBytes(t *testing.T) {
	e := newPollAPI(t)
	ctx := context.Background()
	const n = 400
	payload := `{"blob":"` + strings.Repeat("x", 63<<10-len(`{"blob":""}`)) + `"}`
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("big-%03d", i)
	}
	e.putDue(t, e.jobs, payload, ids...)

	w := newSink()
	req := httptest.NewRequest(http.MethodPost, "/v1/queues/jobs/poll?max="+strconv.Itoa(n), nil)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	e.h.ServeHTTP(w, req)
	runtime.ReadMemStats(&after)
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("poll of %d tasks of 63 KiB: answer %d bytes, %.1f MiB allocated while serving it", n, w.n, float64(alloc)/(1<<20))

	if w.code != http.StatusOK {
		t.Fatalf("poll: %d %.200s", w.code, w.buf)
	}
	if w.n > pollLimitBytes {
		t.Errorf("answer of %d bytes, want at most %d", w.n, pollLimitBytes)
	}
	if alloc > 16<<20 {
		t.Errorf("serving the poll allocated %.1f MiB, want under 16 MiB", float64(alloc)/(1<<20))
	}
	if w.n > len(w.buf) {
		t.Fatalf("answer larger than the test keeps (%d bytes)", w.n)
	}
	var p polled
	if err := json.Unmarshal(w.buf, &p); err != nil {
		t.Fatalf("answer is not JSON: %v", err)
	}
	if len(p.Tasks) == 0 || len(p.Tasks) >= n {
		t.Fatalf("poll returned %d tasks, want some but not all %d", len(p.Tasks), n)
	}
	got := map[string]bool{}
	for _, tk := range p.Tasks {
		if string(tk.Payload) != payload {
			t.Fatalf("task %s: payload of %d bytes, want the %d written", tk.ID, len(tk.Payload), len(payload))
		}
		got[tk.ID] = true
	}
	// The rest is due in the queue as it was: no lease, no attempt spent.
	for _, id := range ids {
		if got[id] {
			continue
		}
		if _, err := e.rdb.ZScore(ctx, e.jobs.Queue, id).Result(); err != nil {
			t.Fatalf("%s, not returned, is not in the queue: %v", id, err)
		}
		if tok := e.leaseToken(t, e.jobs, id); tok != "" {
			t.Fatalf("%s, not returned, is leased under %q", id, tok)
		}
	}
	// The next polls take the rest, each answer within the cap, every
	// task on its first attempt.
	for polls := 0; len(got) < n; polls++ {
		if polls == n {
			t.Fatalf("%d polls returned %d of %d tasks", polls, len(got), n)
		}
		w := newSink()
		e.h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/v1/queues/jobs/poll?max="+strconv.Itoa(n), nil))
		var p polled
		if w.n > pollLimitBytes || json.Unmarshal(w.buf[:min(w.n, len(w.buf))], &p) != nil || len(p.Tasks) == 0 {
			t.Fatalf("poll %d: %d, %d bytes, %d tasks", polls+2, w.code, w.n, len(p.Tasks))
		}
		for _, tk := range p.Tasks {
			if got[tk.ID] || tk.Attempts != 0 {
				t.Fatalf("poll %d: %s again or with %d attempts", polls+2, tk.ID, tk.Attempts)
			}
			got[tk.ID] = true
		}
	}

	// A task larger than the cap on its own (written around the API's
	// 64 KiB limit) still goes out, alone.
	huge := `"` + strings.Repeat("y", 2<<20) + `"`
	pipe := e.rdb.TxPipeline()
	pipe.HSet(ctx, e.jobs.Payload, "huge", huge)
	pipe.ZAdd(ctx, e.jobs.Queue, redis.Z{Score: float64(time.Now().Add(-time.Minute).UnixMilli()), Member: "huge"})
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	e.putDue(t, e.jobs, `{}`, "small")
	hp := e.poll(t, "jobs", 10)
	if hp.code != http.StatusOK || len(hp.Tasks) != 1 || hp.Tasks[0].ID != "huge" || len(hp.Tasks[0].Payload) != len(huge) {
		t.Fatalf("poll with a task over the cap first: %d, %d tasks, want that task alone", hp.code, len(hp.Tasks))
	}
	if sp := e.poll(t, "jobs", 10); len(sp.Tasks) != 1 || sp.Tasks[0].ID != "small" {
		t.Errorf("the next poll: %.300s, want the small task", sp.raw)
	}
}

// The byte cap applies to redeliveries too: expired leases past it stay as
// they were (their holder's token, their attempts) until a poll takes
// them, and each redelivery costs one attempt, not more.
func TestPollCapLeavesExpiredLeasesForTheNextPoll(t *testing.T) {
	e := newPollAPI(t)
	const n = 40
	payload := `"` + strings.Repeat("z", 63<<10) + `"`
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("r-%02d", i)
	}
	e.putDue(t, e.jobs, payload, ids...)
	held := map[string]string{} // id -> token of the poll holding it
	for polls := 0; len(held) < n; polls++ {
		p := e.poll(t, "jobs", n)
		if polls == n || len(p.Tasks) == 0 || len(p.Tasks) == n {
			t.Fatalf("poll %d: %d tasks of %d, want some but not all", polls+1, len(p.Tasks), n)
		}
		for _, tk := range p.Tasks {
			held[tk.ID] = p.Token
		}
	}
	e.expireLeases(t, e.jobs)
	first := e.poll(t, "jobs", n)
	if len(first.Tasks) == 0 || len(first.Tasks) == n || len(first.raw) > pollLimitBytes {
		t.Fatalf("poll after every lease expired: %d tasks, %d bytes; want some but not all, within the cap", len(first.Tasks), len(first.raw))
	}
	taken := map[string]bool{}
	for _, tk := range first.Tasks {
		taken[tk.ID] = true
		if tk.Attempts != 1 {
			t.Errorf("%s redelivered with %d attempts, want 1", tk.ID, tk.Attempts)
		}
	}
	for _, id := range ids {
		if taken[id] {
			continue
		}
		rec, err := e.rdb.HGet(context.Background(), e.jobs.Lease, id).Result()
		if err != nil {
			t.Fatal(err)
		}
		if f := strings.Split(rec, "|"); len(f) < 3 || f[1] != "0" || f[2] != held[id] {
			t.Fatalf("%s, past the cap, has the lease record %q; want it untouched (0 attempts, token %s)", id, rec, held[id])
		}
	}
	second := e.poll(t, "jobs", n)
	if len(second.Tasks) == 0 {
		t.Fatal("the next poll took none of the expired leases left")
	}
	for _, tk := range second.Tasks {
		if taken[tk.ID] || tk.Attempts != 1 {
			t.Errorf("next poll: %s (taken before: %v) with %d attempts, want a new one with 1", tk.ID, taken[tk.ID], tk.Attempts)
		}
	}
}
