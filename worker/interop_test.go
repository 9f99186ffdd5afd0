package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Handlers never run more at once than a queue's Concurrency, nor more in
// all than MaxConcurrency.
func TestConcurrencyBoundNeverExceeded(t *testing.T) {
	e1, e2 := newEnv(t), newEnv(t)
	const perQueue, total, tasks = 3, 4, 30
	w := newWorker(t, e1.rdb, Config{MaxConcurrency: total})
	var curAll, maxAll atomic.Int32
	var maxQ [2]atomic.Int32
	var done atomic.Int32
	bump := func(c, m *atomic.Int32) {
		n := c.Add(1)
		for {
			old := m.Load()
			if n <= old || m.CompareAndSwap(old, n) {
				return
			}
		}
	}
	for i, e := range []*env{e1, e2} {
		q := e.queue(5 * time.Second)
		q.Name = fmt.Sprintf("q%d", i)
		q.Concurrency = perQueue
		cq := new(atomic.Int32)
		if err := w.Handle(q, func(ctx context.Context, t *Task) error {
			bump(cq, &maxQ[i])
			bump(&curAll, &maxAll)
			time.Sleep(5 * time.Millisecond) // work, so that runs overlap
			curAll.Add(-1)
			cq.Add(-1)
			done.Add(1)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		for j := range tasks / 2 {
			e.put(fmt.Sprintf("t%d", j), `{}`)
		}
	}
	start(t, w)
	eventually(t, "every task done", func() bool { return done.Load() == tasks })
	t.Logf("most at once: %d in all, %d and %d per queue", maxAll.Load(), maxQ[0].Load(), maxQ[1].Load())
	if maxAll.Load() > total || maxQ[0].Load() > perQueue || maxQ[1].Load() > perQueue {
		t.Fatalf("most at once: %d in all (bound %d), %d and %d per queue (bound %d)",
			maxAll.Load(), total, maxQ[0].Load(), maxQ[1].Load(), perQueue)
	}
}

// A task an HTTP poll leased and never acked goes to a worker after the
// lease, with one more attempt; a task a worker retries is claimed by a
// poll when its backoff ends, and the poll's ack completes it.
func TestInteropWithPoll(t *testing.T) {
	e := newEnv(t)
	q := e.queue(time.Second)
	e.put("p1", `{"via":"poll"}`)
	ts, tok := e.poll(10, time.Second, 10)
	if len(ts) != 1 || !queue.ValidPollToken(tok) {
		t.Fatalf("poll got %d tasks, token %q", len(ts), tok)
	}

	got := make(chan *Task, 4)
	w := newWorker(t, e.rdb, Config{})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		got <- t
		if t.ID == "w1" {
			return RetryAfter(500*time.Millisecond, errors.New("later"))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	stop, wait := start(t, w)
	tk := <-got
	if tk.ID != "p1" || tk.Attempts != 1 {
		t.Fatalf("worker got %s with attempts %d, want p1 after the poll's lease, attempts 1", tk.ID, tk.Attempts)
	}
	eventually(t, "p1 acked by the worker", func() bool {
		_, err := e.get("p1")
		return errors.Is(err, client.ErrNotFound)
	})
	// The poll's late ack no longer completes anything.
	if missed, _, err := queue.NewStore(e.rdb, e.keys).AckTasks(context.Background(), tok, []string{"p1"}); err != nil || len(missed) != 1 {
		t.Fatalf("stale poll ack: missed %v, %v; want p1 missed", missed, err)
	}

	// Worker retries w1; stop the worker, and a poll takes it after the
	// backoff.
	e.put("w1", `{}`)
	if tk := <-got; tk.ID != "w1" {
		t.Fatalf("worker got %s, want w1", tk.ID)
	}
	eventually(t, "w1 backing off", func() bool {
		tk, err := e.get("w1")
		return err == nil && tk.State == client.StateBackoff
	})
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	var pts []queue.Task
	eventually(t, "a poll to take w1 after its backoff", func() bool {
		pts, tok = e.poll(10, time.Second, 10)
		return len(pts) == 1
	})
	if pts[0].ID != "w1" || pts[0].Attempts != 1 {
		t.Fatalf("poll got %s with attempts %d, want w1 with attempts 1", pts[0].ID, pts[0].Attempts)
	}
	if missed, _, err := queue.NewStore(e.rdb, e.keys).AckTasks(context.Background(), tok, []string{"w1"}); err != nil || len(missed) != 0 {
		t.Fatalf("poll ack of w1: missed %v, %v", missed, err)
	}
}

// A producer that reschedules or deletes a task a handler is running takes
// the lease away: the handler's context ends with ErrLeaseLost, and its
// result neither acks the rescheduled task nor brings back the deleted one.
func TestProducerTakesLeaseFromHandler(t *testing.T) {
	e := newEnv(t)
	q := e.queue(time.Second)
	e.put("moved", `{"v":1}`)
	e.put("deleted", `{}`)
	causes := make(chan string, 2)
	started := make(chan string, 2)
	w := newWorker(t, e.rdb, Config{})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		started <- t.ID
		<-ctx.Done()
		if errors.Is(context.Cause(ctx), ErrLeaseLost) {
			causes <- t.ID
		}
		return nil // would ack, were the lease still ours
	}); err != nil {
		t.Fatal(err)
	}
	start(t, w)
	<-started
	<-started
	later := time.Now().Add(time.Hour)
	if _, _, err := e.cl.PutTask(context.Background(), "moved", json.RawMessage(`{"v":2}`), later, client.Reschedule); err != nil {
		t.Fatal(err)
	}
	if _, err := e.cl.DeleteTasks(context.Background(), "deleted"); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for range 2 {
		select {
		case id := <-causes:
			seen[id] = true
		case <-time.After(30 * time.Second):
			t.Fatalf("handlers cancelled with ErrLeaseLost: %v, want moved and deleted", seen)
		}
	}
	eventually(t, "lease losses counted", func() bool { return testutil.ToFloat64(w.m.lost.WithLabelValues("jobs")) == 2 })
	tk, err := e.get("moved")
	if err != nil || tk.State != client.StateQueued || tk.Deadline.Before(later.Add(-time.Second)) || string(tk.Payload) != `{"v":2}` {
		t.Fatalf("moved: %+v, %v; want queued an hour ahead with the new payload", tk, err)
	}
	if _, err := e.get("deleted"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("deleted: %v, want not found", err)
	}
}

func TestConfigErrors(t *testing.T) {
	e := newEnv(t)
	ok := func(ctx context.Context, t *Task) error { return nil }
	cases := []struct {
		name string
		q    Queue
		want string
	}{
		{"no name", Queue{}, "Name must be"},
		{"bad name", Queue{Name: "Jobs!"}, "Name must be"},
		{"brace key", Queue{Name: "j", Key: "a{b}"}, "Key:"},
		{"order key", Queue{Name: "j", Key: "delaytask:order"}, "order queue"},
		{"short lease", Queue{Name: "j", Lease: 500 * time.Millisecond}, "Lease 500ms is below 1s"},
		{"negative concurrency", Queue{Name: "j", Concurrency: -1}, "Concurrency -1"},
		{"negative attempts", Queue{Name: "j", MaxAttempts: -2}, "MaxAttempts -2"},
		{"zero backoff", Queue{Name: "j", Retry: Retry{Backoff: []time.Duration{0}}}, "Retry.Backoff[0]"},
		{"max below initial", Queue{Name: "j", Retry: Retry{Initial: time.Minute, Max: time.Second}}, "Initial <= Max"},
		{"multiplier", Queue{Name: "j", Retry: Retry{Multiplier: 0.5}}, "Multiplier 0.5"},
	}
	w := newWorker(t, e.rdb, Config{})
	for _, c := range cases {
		err := w.Handle(c.q, ok)
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want ErrConfig mentioning %q", c.name, err, c.want)
		}
	}
	if err := w.Handle(Queue{Name: "j"}, nil); !errors.Is(err, ErrConfig) {
		t.Errorf("nil handler: %v", err)
	}
	if err := w.Handle(Queue{Name: "j"}, ok); err != nil {
		t.Fatal(err)
	}
	if err := w.Handle(Queue{Name: "j"}, ok); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "twice") {
		t.Errorf("same queue twice: %v", err)
	}
	if _, err := New(nil, Config{}); !errors.Is(err, ErrConfig) {
		t.Errorf("New(nil): %v", err)
	}
	for _, cfg := range []Config{{MaxConcurrency: -1}, {ShutdownTimeout: -1}, {PollInterval: -1}} {
		if _, err := New(e.rdb, cfg); !errors.Is(err, ErrConfig) {
			t.Errorf("New(%+v): %v, want ErrConfig", cfg, err)
		}
	}
	empty := newWorker(t, e.rdb, Config{})
	if err := empty.Run(context.Background()); !errors.Is(err, ErrConfig) {
		t.Errorf("Run with no queue: %v", err)
	}
}

func TestFromQueuesFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("good.yaml", `
queues:
  - name: emails
    lease: 30s
    action: {type: poll}
    retry: {backoff: [1s, 5s], max_attempts: 4}
  - name: exports
    action: {type: stream}
`)
	q, err := FromQueuesFile(good, "emails")
	if err != nil {
		t.Fatal(err)
	}
	if q.Name != "emails" || q.Key != "delaytask:emails" || q.Lease != 30*time.Second || q.MaxAttempts != 4 ||
		fmt.Sprint(q.Retry.Backoff) != "[1s 5s]" {
		t.Fatalf("queue %+v", q)
	}
	if _, err := q.withDefaults(); err != nil {
		t.Fatalf("a queue from the file is refused: %v", err)
	}
	bad := write("bad.yaml", "queues:\n  - name: emails\n    leese: 30s\n    action: {type: poll}\n")
	for _, c := range []struct{ path, name, want string }{
		{good, "exports", `action "stream"`},
		{good, "nope", `no queue "nope"`},
		{bad, "emails", "leese"},
		{filepath.Join(dir, "missing.yaml"), "emails", "no such file"},
	} {
		if _, err := FromQueuesFile(c.path, c.name); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("FromQueuesFile(%s, %s): %v, want ErrConfig mentioning %q", filepath.Base(c.path), c.name, err, c.want)
		}
	}
}

// A worker whose heartbeats did not land in time (a pause, a partition;
// simulated by moving its lease expiry into the past) loses the task to a
// poll: its next heartbeat finds the poll's token, cancels the handler
// with ErrLeaseLost, and the handler's success acks nothing; the poll's
// ack completes the task.
func TestStaleWorkerLosesTaskToPoll(t *testing.T) {
	e := newEnv(t)
	q := e.queue(time.Second)
	e.put("s", `{}`)
	started, cause := make(chan struct{}), make(chan error, 1)
	w := newWorker(t, e.rdb, Config{})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		close(started)
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	start(t, w)
	<-started
	if err := e.rdb.ZAdd(context.Background(), e.keys.Inflight, redis.Z{Score: 1, Member: "s"}).Err(); err != nil {
		t.Fatal(err)
	}
	ts, tok := e.poll(10, time.Minute, 10)
	if len(ts) != 1 || ts[0].Attempts != 1 {
		t.Fatalf("poll got %+v, want s with attempts 1", ts)
	}
	select {
	case err := <-cause:
		if !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("handler context ended with %v, want ErrLeaseLost", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the handler was not cancelled after the poll took its task")
	}
	tk, err := e.get("s")
	if err != nil || tk.State != client.StateLeased || tk.Owner != tok {
		t.Fatalf("s: %+v, %v; want leased by the poll", tk, err)
	}
	if missed, _, err := queue.NewStore(e.rdb, e.keys).AckTasks(context.Background(), tok, []string{"s"}); err != nil || len(missed) != 0 {
		t.Fatalf("poll ack: missed %v, %v", missed, err)
	}
}

// A worker cut off from Redis cannot extend its leases: once a lease has
// run out on its clock it cancels the handler (ErrLeaseLost), and the
// task goes to whoever claims next, with one more attempt.
func TestRedisOutageCancelsHandlerAfterLease(t *testing.T) {
	e := newEnv(t)
	o, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.NewProxy(t, o.Addr)
	o.Addr = proxy.Addr()
	o.MaxRetries = -1
	cut := redis.NewClient(o)
	t.Cleanup(func() { cut.Close() })

	q := e.queue(time.Second)
	e.put("o", `{}`)
	started, cause := make(chan struct{}), make(chan error, 1)
	w := newWorker(t, cut, Config{})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		close(started)
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	stop, wait := start(t, w)
	<-started
	proxy.Down()
	select {
	case err := <-cause:
		if !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("handler context ended with %v, want ErrLeaseLost", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the handler ran on through a Redis outage longer than its lease")
	}
	var ts []queue.Task
	eventually(t, "a poll to take the task", func() bool {
		ts, _ = e.poll(10, time.Minute, 10)
		return len(ts) == 1
	})
	if ts[0].ID != "o" || ts[0].Attempts != 1 {
		t.Fatalf("poll got %+v, want o with attempts 1", ts[0])
	}
	proxy.Up()
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
}
