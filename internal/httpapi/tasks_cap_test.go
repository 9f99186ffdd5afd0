package httpapi_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sort"
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

// A PUT of a new task on a queue holding its max_pending pending tasks is
// 507 with a JSON error naming the queue and the cap, and stores nothing;
// a leased (polled) task still counts as pending; a re-PUT or reschedule of
// an existing task goes through.
// capServer serves one poll queue "jobs" with max_pending maxPending, its
// meta written as the daemon writes it at start.
func capServer(t *testing.T, maxPending string) (*httptest.Server, *redis.Client, queue.Keys) {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	f, err := tasks.Parse([]byte("queues:\n  - name: jobs\n    key: '" + keys.Queue + "'\n    max_pending: " + maxPending + "\n    action: {type: poll}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if err := tasks.WriteMeta(context.Background(), rdb, f); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "t", "t")
	mgr, err := tasks.NewManager(f, rdb, nil, metrics.NewTaskFamilies(reg, m), zap.NewNop(), "t")
	if err != nil {
		t.Fatal(err)
	}
	oc, err := client.New(rdb, keys.Queue+":orders")
	if err != nil {
		t.Fatal(err)
	}
	api := httpapi.New(httpapi.Config{}, producer.New(oc, m, nil), m, reg, zap.NewNop())
	api.EnableTasks(mgr)
	srv := httptest.NewServer(api.Handler())
	t.Cleanup(srv.Close)
	return srv, rdb, keys
}

func TestPutTaskBeyondMaxPendingIs507(t *testing.T) {
	srv, rdb, keys := capServer(t, "2")
	ctx := context.Background()
	put := func(id, body string) reply { return do(t, http.MethodPut, srv.URL+"/v1/queues/jobs/tasks/"+id, body) }
	// Due already (a deadline "1ms" ahead may still lie ahead when the
	// poll below runs within the same millisecond).
	past := time.Now().Add(-time.Second).UTC().Format(time.RFC3339Nano)
	if r := put("j-1", `{"at":"`+past+`"}`); r.code != http.StatusCreated {
		t.Fatalf("j-1: %d %s", r.code, r.raw)
	}
	if r := put("j-2", `{"after":"1h"}`); r.code != http.StatusCreated {
		t.Fatalf("j-2: %d %s", r.code, r.raw)
	}
	full := func(id string) {
		t.Helper()
		r := put(id, `{"after":"1h"}`)
		wantJSONError(t, r, http.StatusInsufficientStorage)
		var b struct {
			Queue      string `json:"queue"`
			MaxPending int64  `json:"max_pending"`
		}
		if err := json.Unmarshal([]byte(r.raw), &b); err != nil || b.Queue != "jobs" || b.MaxPending != 2 ||
			!strings.Contains(r.body.Error, "jobs") {
			t.Errorf("507 body %s: want the queue jobs and max_pending 2", r.raw)
		}
		if n, _ := rdb.ZScore(ctx, keys.Queue, id).Result(); n != 0 {
			t.Errorf("refused %s is in the queue", id)
		}
	}
	full("j-3")
	// j-1 is due: a poll leases it (inflight), and it still counts.
	if r := do(t, http.MethodPost, srv.URL+"/v1/queues/jobs/poll?max=1", ""); r.code != http.StatusOK || !strings.Contains(r.raw, "j-1") {
		t.Fatalf("poll: %d %s", r.code, r.raw)
	}
	full("j-3")
	if r := put("j-2", `{"after":"1h"}`); r.code != http.StatusOK {
		t.Errorf("idempotent re-PUT at the cap: %d %s, want 200", r.code, r.raw)
	}
	if r := put("j-1", `{"after":"2h","reschedule":true}`); r.code != http.StatusOK {
		t.Errorf("reschedule of a leased task at the cap: %d %s, want 200", r.code, r.raw)
	}
}

// A batch create straddling the cap: 507, one result per task in order:
// "created" while there was room, "exists" for a task already there (never
// refused), "refused" (nothing written) for new tasks after the queue
// filled up.
func TestBatchCreateStraddlingMaxPendingIs507(t *testing.T) {
	srv, rdb, keys := capServer(t, "3")
	ctx := context.Background()
	for _, id := range []string{"j-1", "j-2"} {
		if r := do(t, http.MethodPut, srv.URL+"/v1/queues/jobs/tasks/"+id, `{"after":"1h"}`); r.code != http.StatusCreated {
			t.Fatalf("%s: %d %s", id, r.code, r.raw)
		}
	}
	r := do(t, http.MethodPost, srv.URL+"/v1/queues/jobs/tasks/batch",
		`{"tasks":[{"id":"b-1","after":"1h"},{"id":"j-2","after":"2h"},{"id":"b-2","after":"1h"},{"id":"b-3","after":"1h"}]}`)
	wantJSONError(t, r, http.StatusInsufficientStorage)
	var b struct {
		MaxPending int64 `json:"max_pending"`
		Tasks      []struct {
			Index  int    `json:"index"`
			ID     string `json:"id"`
			Result string `json:"result"`
		} `json:"tasks"`
	}
	if err := json.Unmarshal([]byte(r.raw), &b); err != nil {
		t.Fatal(err)
	}
	want := []string{"b-1 created", "j-2 exists", "b-2 refused", "b-3 refused"}
	var got []string
	for i, x := range b.Tasks {
		if x.Index != i {
			t.Errorf("result %d has index %d", i, x.Index)
		}
		got = append(got, x.ID+" "+x.Result)
	}
	if strings.Join(got, ", ") != strings.Join(want, ", ") || b.MaxPending != 3 {
		t.Errorf("results %v (max_pending %d); want %v (3)", got, b.MaxPending, want)
	}
	members, err := rdb.ZRange(ctx, keys.Queue, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(members)
	if strings.Join(members, ",") != "b-1,j-1,j-2" {
		t.Errorf("queue holds %v; want b-1, j-1, j-2", members)
	}
	for _, id := range []string{"b-2", "b-3"} {
		if ok, _ := rdb.HExists(ctx, keys.Payload, id).Result(); ok {
			t.Errorf("refused %s has a payload", id)
		}
	}
}
