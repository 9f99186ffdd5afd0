package consumer

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// gatherTask scrapes reg and returns every task queue gauge as
// "name{queue}" -> value.
func gatherTask(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			q := ""
			for _, l := range m.GetLabel() {
				if l.GetName() == "queue" {
					q = l.GetValue()
				}
			}
			out[fmt.Sprintf("%s{%s}", mf.GetName(), q)] = m.GetGauge().GetValue()
		}
	}
	return out
}

// taskQueue is a task queue of the test's own on the shared Redis.
func taskQueue(t *testing.T, rdb *redis.Client, name string) (*client.Client, queue.Keys) {
	t.Helper()
	k := queue.NewKeys("test:" + testenv.Name(t) + ":" + name)
	t.Cleanup(func() { testenv.DeleteQueue(rdb, k) })
	cl, err := client.New(rdb, k.Queue)
	if err != nil {
		t.Fatal(err)
	}
	return cl, k
}

func (e *env) putTask(cl *client.Client, id string, due time.Time) {
	e.T.Helper()
	if _, _, err := cl.PutTask(context.Background(), id, json.RawMessage(`{"id":"`+id+`"}`), due, client.Reschedule); err != nil {
		e.T.Fatalf("put %s: %v", id, err)
	}
}

// TestTaskStatsGaugesOnAKnownQueue fills a polled task queue through the
// real paths (PutTask, a poll's claim, the claim's dead-lettering of
// seconds-for-milliseconds scores) and checks every gauge; a second, empty
// queue reports zeros, not nothing.
func TestTaskStatsGaugesOnAKnownQueue(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	cl, k := taskQueue(t, e.RDB, "jobs")
	_, empty := taskQueue(t, e.RDB, "idle")

	// Two raw producers' mistakes: seconds instead of milliseconds. The
	// poll's claim dead-letters them.
	secs := float64(time.Now().Unix())
	if err := e.RDB.ZAdd(ctx, k.Queue, redis.Z{Score: secs, Member: "secs-1"}, redis.Z{Score: secs, Member: "secs-2"}).Err(); err != nil {
		t.Fatal(err)
	}
	if got, _, err := pollTasks(ctx, e.RDB, k, 10, 0, time.Minute, 3); err != nil || len(got) != 0 {
		t.Fatalf("claim of the bad scores: %v, %d tasks, want none", err, len(got))
	}
	// Whole milliseconds: a deadline is rounded up to the next one, and
	// leased-1 would read 2.999 s overdue within the same millisecond.
	now := e.RedisNow().Truncate(time.Millisecond)
	e.putTask(cl, "leased-1", now.Add(-3*time.Second))
	e.putTask(cl, "wait-1", now.Add(-2*time.Second))
	e.putTask(cl, "wait-2", now.Add(-time.Second))
	e.putTask(cl, "future-1", now.Add(time.Hour))
	e.putTask(cl, "future-2", now.Add(time.Hour))
	got, tok, err := pollTasks(ctx, e.RDB, k, 1, 0, time.Minute, 3)
	if err != nil || len(got) != 1 || got[0].ID != "leased-1" || tok == "" {
		t.Fatalf("poll: %v, %+v, want leased-1 under a token", err, got)
	}

	reg := prometheus.NewRegistry()
	var failed []string
	reg.MustRegister(NewTaskStatsCollector(e.RDB, []NamedKeys{{"jobs", k}, {"idle", empty}}, func(q string, err error) {
		failed = append(failed, q+": "+err.Error())
	}))
	m := gatherTask(t, reg)
	if len(failed) > 0 {
		t.Fatalf("reads failed: %v", failed)
	}
	for name, want := range map[string]float64{
		"orderdelay_task_queue_depth{jobs}":                  5, // leased-1, wait-1, wait-2, future-1, future-2
		"orderdelay_task_queue_overdue{jobs}":                3, // leased-1 (leased ones count), wait-1, wait-2
		"orderdelay_task_queue_dead_letters{jobs}":           2,
		"orderdelay_task_queue_leased{jobs}":                 1,
		"orderdelay_task_queue_depth{idle}":                  0,
		"orderdelay_task_queue_overdue{idle}":                0,
		"orderdelay_task_queue_dead_letters{idle}":           0,
		"orderdelay_task_queue_leased{idle}":                 0,
		"orderdelay_task_queue_oldest_overdue_seconds{idle}": 0,
	} {
		if v, ok := m[name]; !ok || v != want {
			t.Errorf("%s = %v (exported: %v), want %v", name, v, ok, want)
		}
	}
	// leased-1 is the oldest, leased or not: its true deadline counts.
	if v := m["orderdelay_task_queue_oldest_overdue_seconds{jobs}"]; v < 3 || v > 60 {
		t.Errorf("oldest overdue %vs, want leased-1's age, 3 s and a little", v)
	}
	if len(m) != 10 {
		t.Errorf("%d series, want 5 gauges x 2 queues: %v", len(m), m)
	}
}

// TestTaskStatsReportOnlyTheQueuesOfTheFile: a queue removed from the
// queues file leaves no series behind after the restart that applies the
// file, though its keys (and their gauges) are still in Redis.
func TestTaskStatsReportOnlyTheQueuesOfTheFile(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	cla, a := taskQueue(t, e.RDB, "kept")
	clb, b := taskQueue(t, e.RDB, "removed")
	now := e.RedisNow()
	e.putTask(cla, "a-1", now.Add(-time.Second))
	e.putTask(clb, "b-1", now.Add(-time.Second))

	before := prometheus.NewRegistry()
	before.MustRegister(NewTaskStatsCollector(e.RDB, []NamedKeys{{"kept", a}, {"removed", b}}, nil))
	if m := gatherTask(t, before); m["orderdelay_task_queue_depth{removed}"] != 1 {
		t.Fatalf("before: %v, want removed's depth 1", m)
	}
	after := prometheus.NewRegistry() // the restarted daemon's
	after.MustRegister(NewTaskStatsCollector(e.RDB, []NamedKeys{{"kept", a}}, nil))
	for name := range gatherTask(t, after) {
		if strings.HasSuffix(name, "{removed}") {
			t.Errorf("series %s of a queue no longer in the file", name)
		}
	}
}

// TestTaskStatsLint: the gauges follow Prometheus's naming and help
// conventions (promlint), as the order queue's do.
func TestTaskStatsLint(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	_, k := taskQueue(t, e.RDB, "lint")
	problems, err := testutil.CollectAndLint(NewTaskStatsCollector(e.RDB, []NamedKeys{{"lint", k}}, nil))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("%s: %s", p.Metric, p.Text)
	}
}
