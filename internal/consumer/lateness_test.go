package consumer

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// taskMetrics gives e a task queue's metrics (the daemon's families) and
// returns a reader of orderdelay_task_lateness_seconds{queue="q"}.
func (e *env) taskMetrics() func() (count uint64, sum float64) {
	reg := prometheus.NewRegistry()
	e.m = metrics.NewTaskFamilies(reg, e.m).For("q")
	return func() (uint64, float64) {
		e.T.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			e.T.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "orderdelay_task_lateness_seconds" {
				h := mf.GetMetric()[0].GetHistogram()
				return h.GetSampleCount(), h.GetSampleSum()
			}
		}
		e.T.Fatal("no orderdelay_task_lateness_seconds")
		return 0, 0
	}
}

// putLate puts a task due late before Redis's now.
func (e *env) putLate(id string, late time.Duration) {
	e.T.Helper()
	if _, _, err := e.cl.PutTask(context.Background(), id, json.RawMessage(`{}`), e.RedisNow().Add(-late), client.Create); err != nil {
		e.T.Fatal(err)
	}
}

// TestTaskLatenessObservedForEveryAction: the lateness histogram gets one
// observation per task, whatever the action: at forwarding for stream and
// list (plain and reliable) queues, at the action's success for sql,
// webhook and durable queues (they share processTasks), at the ack for
// poll queues.
func TestTaskLatenessObservedForEveryAction(t *testing.T) {
	t.Parallel()
	check := func(t *testing.T, lateness func() (uint64, float64), atLeast float64) {
		t.Helper()
		n, sum := lateness()
		if n != 1 || sum < atLeast-0.01 || sum > atLeast+60 { // the due time is rounded up to the next ms
			t.Errorf("lateness: %d observations summing to %.3fs, want 1 of %.0fs and a little", n, sum, atLeast)
		}
	}
	for _, f := range []*Forward{
		{Kind: "stream", Queue: "q", MaxLen: 1000},
		{Kind: "list", Queue: "q"},
		{Kind: "list", Queue: "q", Reliable: true},
	} {
		name := f.Kind
		if f.Reliable {
			name = "reliable list"
		}
		t.Run(name, func(t *testing.T) {
			e := newRedisEnv(t)
			lateness := e.taskMetrics()
			e.putLate("t-1", 2*time.Second)
			if res := e.forwardOnce(Config{MaxAttempts: 3, Forward: f}); res.forwarded != 1 {
				t.Fatalf("forwarded %d, want 1", res.forwarded)
			}
			check(t, lateness, 2)
		})
	}
	t.Run("action (sql, webhook, durable)", func(t *testing.T) {
		e := newRedisEnv(t)
		lateness := e.taskMetrics()
		e.putLate("t-1", 2*time.Second)
		c := e.consumer(Config{Lease: time.Minute, MaxAttempts: 3,
			Process: func(_ context.Context, ts []Task) []error { return make([]error, len(ts)) }})
		stop := runConsumer(t, c)
		eventually(t, "task done", 20*time.Second, func() bool { n, _ := lateness(); return n > 0 })
		stop()
		check(t, lateness, 2)
	})
	t.Run("poll ack", func(t *testing.T) {
		e := newRedisEnv(t)
		e.taskMetrics()
		e.putLate("t-1", 3*time.Second)
		got, tok, err := pollTasks(context.Background(), e.RDB, e.Keys, 10, 0, time.Minute, 3)
		if err != nil || len(got) != 1 {
			t.Fatalf("poll: %v, %d tasks", err, len(got))
		}
		missed, late, err := queue.NewStore(e.RDB, e.Keys).AckTasks(context.Background(), tok, []string{"t-1", "never-polled"})
		if err != nil {
			t.Fatal(err)
		}
		if len(missed) != 1 || missed[0] != "never-polled" {
			t.Errorf("missed %v, want [never-polled]", missed)
		}
		if len(late) != 1 || late[0] < 3*time.Second-10*time.Millisecond || late[0] > time.Minute {
			t.Errorf("lateness at ack %v, want one of 3 s and a little", late)
		}
	})
}
