package tasks

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Two replicas' loaders on the same database and Redis: while one holds
// the loader lock the other loads nothing and returns at once; the holder
// loads every due task, each once.
func TestDurableLoadersTakeTurns(t *testing.T) {
	t.Parallel()
	a, _ := newTestDurable(t)
	o, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	other := redis.NewClient(o) // the other replica's connection
	t.Cleanup(func() { other.Close() })
	b, err := NewDurable(a.DB, Queue{Name: a.Queue, Key: a.Client.Keys().Queue, Window: Duration(a.Window)}, other, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.DB.Exec(`INSERT INTO orderdelay_tasks (queue, id, due_at) SELECT $1, 't-' || g, now() FROM generate_series(1, 50) g`, a.Queue); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	locked, release := make(chan struct{}), make(chan struct{})
	a.lockedHook = func() { close(locked); <-release }
	done := make(chan error, 1)
	var added int
	go func() {
		var err error
		added, err = a.Load(ctx)
		done <- err
	}()
	<-locked
	if n, err := b.Load(ctx); n != 0 || err != nil {
		t.Errorf("second loader while the first holds the lock: %d added, %v; want 0, nil", n, err)
	}
	if _, err := a.Client.GetTask(ctx, "t-1"); err == nil {
		t.Errorf("a task reached Redis while only the blocked loader held the lock")
	}
	close(release)
	if err := <-done; err != nil || added != 50 {
		t.Fatalf("first loader: %d added, %v; want 50", added, err)
	}
	if n, err := b.Load(ctx); n != 0 || err != nil {
		t.Errorf("second loader once the first finished: %d added, %v; want 0 (all there already)", n, err)
	}
}

// Several replicas, each with its loader and executor, on one database and
// one Redis: every task a bulk import scheduled runs, none is lost, and
// none runs twice (no replica dies here, so at-least-once is exactly once).
func TestDurableReplicasRunEveryTaskOnce(t *testing.T) {
	t.Parallel()
	rdb, keys := testenv.Redis(t)
	db, _ := testenv.Postgres(t)
	if _, err := db.Exec(`CREATE TABLE hits (id text PRIMARY KEY, n int NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	const n = 600
	// Due over the next 3 s, none in Redis: the loaders bring them in.
	if _, err := db.Exec(`INSERT INTO orderdelay_tasks (queue, id, due_at) SELECT 'jobs', 't-' || g, now() + (g % 30) * interval '100 milliseconds'
		FROM generate_series(1, $1::int) g`, n); err != nil {
		t.Fatal(err)
	}
	f, err := Parse([]byte(fmt.Sprintf(`queues:
  - name: jobs
    key: '%s'
    durable: true
    window: 2s
    lease: 5s
    batch_size: 20
    action: {type: sql, statement: "INSERT INTO hits (id, n) SELECT unnest($1::text[]), 1 ON CONFLICT (id) DO UPDATE SET n = hits.n + 1 RETURNING id"}
`, keys.Queue)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := range 3 {
		reg := prometheus.NewRegistry()
		m, err := NewManager(f, rdb, db, metrics.NewTaskFamilies(reg, metrics.New(reg, "t", "t")), zaptest.NewLogger(t), fmt.Sprintf("replica-%d", i))
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); m.Run(ctx) }()
	}
	defer func() { cancel(); wg.Wait() }()
	deadline := time.Now().Add(90 * time.Second)
	for {
		var executed int
		if err := db.Get(&executed, `SELECT count(*) FROM orderdelay_tasks WHERE queue = 'jobs' AND state = 'EXECUTED'`); err != nil {
			t.Fatal(err)
		}
		if executed == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d tasks executed", executed, n)
		}
		time.Sleep(50 * time.Millisecond) // polling a condition
	}
	var ran int
	if err := db.Get(&ran, `SELECT count(*) FROM hits`); err != nil || ran != n {
		t.Errorf("the action saw %d distinct tasks (%v), want %d", ran, err, n)
	}
	var wrong []string
	if err := db.Select(&wrong, `SELECT id || ':' || n FROM hits WHERE n <> 1`); err != nil {
		t.Fatal(err)
	}
	if len(wrong) > 0 {
		t.Errorf("tasks that did not run exactly once (id:runs): %v", wrong)
	}
	var logged int
	if err := db.Get(&logged, `SELECT count(*) FROM orderdelay_task_log WHERE queue = 'jobs' AND state = 'EXECUTED'`); err != nil || logged != n {
		t.Errorf("%d EXECUTED log rows (%v), want %d", logged, err, n)
	}
}
