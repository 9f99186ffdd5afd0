package worker

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"

	"github.com/prometheus/client_golang/prometheus"
)

// No goroutine of a Worker outlives Run (handlers abandoned at a
// shutdown timeout end when the tests release them).
func TestMain(m *testing.M) { testenv.VerifyNoLeaks(m) }

// env is one test's queue on the shared Redis.
type env struct {
	t    *testing.T
	rdb  *redis.Client
	keys queue.Keys
	cl   *client.Client
}

func newEnv(t *testing.T) *env {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	cl, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, rdb: rdb, keys: keys, cl: cl}
}

// queue returns a Queue on the test's key.
func (e *env) queue(lease time.Duration) Queue {
	return Queue{Name: "jobs", Key: e.keys.Queue, Lease: lease}
}

// put adds a task due a second ago (due now on Redis's clock too).
func (e *env) put(id string, payload string) {
	e.t.Helper()
	if _, _, err := e.cl.PutTask(context.Background(), id, json.RawMessage(payload), time.Now().Add(-time.Second), client.Create); err != nil {
		e.t.Fatalf("put %s: %v", id, err)
	}
}

// get reads a task as GET /v1/queues/{q}/tasks/{id} does.
func (e *env) get(id string) (client.Task, error) {
	return e.cl.GetTask(context.Background(), id)
}

// poll claims due tasks the way POST /v1/queues/{q}/poll does.
func (e *env) poll(limit int, lease time.Duration, maxAttempts int) ([]queue.Task, string) {
	e.t.Helper()
	p, err := queue.NewStore(e.rdb, e.keys).PollTasks(context.Background(), queue.PollArgs{Limit: limit, Lease: lease, MaxAttempts: maxAttempts})
	if err != nil {
		e.t.Fatalf("poll: %v", err)
	}
	return p.Tasks, p.Token
}

// start runs w until the returned stop is called; stop returns Run's
// error.
func start(t *testing.T, w *Worker) (cancel func(), wait func() error) {
	t.Helper()
	ctx, c := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var err error
	finished := false
	wait = func() error {
		if !finished {
			select {
			case err = <-done:
			case <-time.After(time.Minute):
				t.Fatal("Run did not return within a minute of its context ending")
			}
			finished = true
		}
		return err
	}
	t.Cleanup(func() { c(); wait() })
	return c, wait
}

func newWorker(t *testing.T, rdb redis.UniversalClient, cfg Config) *Worker {
	t.Helper()
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 20 * time.Millisecond
	}
	if cfg.Registerer == nil {
		cfg.Registerer = prometheus.NewRegistry()
	}
	w, err := New(rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// eventually polls cond every 10 ms until it holds or a generous deadline
// passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
