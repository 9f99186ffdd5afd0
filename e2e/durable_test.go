package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// Seeds 001 and 002: the database is the source of truth; Redis holds only
// the near future. Tasks due in a week cost Redis nothing until their window
// opens, and then all fire on time; cancel works in both tiers; an executed
// task re-added to Redis does not run twice.
func TestSeed002DurableQueueLoadsOnlyTheNearFuture(t *testing.T) {
	t.Parallel()
	tw := newTaskWorld(t, `
queues:
  - name: confirm
    key: PREFIX:confirm
    durable: true
    window: 10s
    action:
      type: sql
      statement: "UPDATE receipts SET hits = hits + 1, confirmed_at = coalesce(confirmed_at, now()) WHERE id = ANY($1) RETURNING id"
`)
	// ORDERDELAY_DURABLE_TASKS=1000000 runs the full-size version (rows
	// beyond the first 1,000 are inserted in SQL, as a bulk import would).
	n := 1000
	if v, err := strconv.Atoi(os.Getenv("ORDERDELAY_DURABLE_TASKS")); err == nil && v > n {
		n = v
	}
	if _, err := tw.db.Exec(`CREATE TABLE receipts (id text PRIMARY KEY, hits int NOT NULL DEFAULT 0, confirmed_at timestamptz)`); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.db.Exec(`INSERT INTO receipts (id) SELECT 'r-' || g FROM generate_series(1, $1::int) g`, n); err != nil {
		t.Fatal(err)
	}
	if n > 1000 {
		if _, err := tw.db.Exec(`INSERT INTO orderdelay_tasks (queue, id, due_at, payload)
			SELECT 'confirm', 'r-' || g, now() + interval '7 days', jsonb_build_object('receipt', 'r-' || g)
			FROM generate_series(1001, $1::int) g`, n); err != nil {
			t.Fatal(err)
		}
	}
	d := tw.start()
	ctx := context.Background()
	k := tw.keys("confirm")
	// 1,000 tasks due in a week, through the API, 16 at a time.
	inParallel(1000, 16, func(i int) {
		i++ // r-1 … r-1000
		body := fmt.Sprintf(`{"after":"168h","payload":{"receipt":"r-%d"}}`, i)
		if code := d.call(http.MethodPut, fmt.Sprintf("/v1/queues/confirm/tasks/r-%d", i), "", body, nil); code != http.StatusCreated {
			t.Errorf("PUT r-%d: %d", i, code)
		}
	})
	if n, _ := tw.rdb.Exists(ctx, k.Queue, k.Payload).Result(); n != 0 {
		t.Fatalf("tasks due in a week already cost Redis %d keys", n)
	}
	if got := tw.count("SELECT count(*) FROM orderdelay_tasks WHERE queue = 'confirm' AND state = 'SCHEDULED'"); got != n {
		t.Fatalf("%d scheduled rows, want %d", got, n)
	}
	// Cancelled while only in PostgreSQL: it never runs.
	if code := d.call(http.MethodDelete, "/v1/queues/confirm/tasks/r-1", "", "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE: %d", code)
	}
	// The window opens: move the data, not the clock. r-2 is overdue
	// already (the seeds' compensation: picked up at once).
	if _, err := tw.db.Exec(`UPDATE orderdelay_tasks SET due_at = now() + interval '3 seconds' WHERE queue = 'confirm' AND id <> 'r-2';
		UPDATE orderdelay_tasks SET due_at = now() - interval '1 hour' WHERE queue = 'confirm' AND id = 'r-2'`); err != nil {
		t.Fatal(err)
	}
	opened := time.Now()
	waitFor(t, "all fired and recorded", 60*time.Second+time.Duration(n/1000)*time.Second, func() bool {
		return tw.count("SELECT count(*) FROM orderdelay_tasks WHERE queue = 'confirm' AND state = 'EXECUTED'") == n-1
	})
	t.Logf("%d tasks executed %s after their window was opened", n-1, time.Since(opened).Round(time.Millisecond))
	if n := tw.count("SELECT count(*) FROM receipts WHERE hits <> 1 AND id <> 'r-1'"); n != 0 {
		t.Errorf("%d tasks ran more or less than once", n)
	}
	if n := tw.count("SELECT count(*) FROM receipts r JOIN orderdelay_tasks t ON t.id = r.id AND t.queue = 'confirm' WHERE r.confirmed_at < t.due_at"); n != 0 {
		t.Errorf("%d tasks fired before they were due", n)
	}
	var p99 float64
	tw.db.Get(&p99, `SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM r.confirmed_at - t.due_at))
		FROM receipts r JOIN orderdelay_tasks t ON t.id = r.id AND t.queue = 'confirm' WHERE t.id <> 'r-2' AND r.confirmed_at IS NOT NULL`)
	t.Logf("%d tasks whose window opened fired with lateness p99 %.0f ms", n-2, p99*1000)
	if st := tw.count("SELECT count(*) FROM orderdelay_tasks WHERE queue = 'confirm' AND id = 'r-1' AND state = 'CANCELLED'"); st != 1 {
		t.Errorf("r-1 is not CANCELLED")
	}
	if n := tw.count("SELECT count(*) FROM orderdelay_task_log WHERE queue = 'confirm' AND task_id = 'r-5'"); n != 2 {
		t.Errorf("r-5 has %d log rows, want 2 (SCHEDULED, EXECUTED)", n)
	}
	// The loader (or a stale copy) re-adds an executed task: no second run.
	if _, err := tw.rdb.ZAdd(ctx, k.Queue, redisZ("r-3", time.Now().Add(-time.Second))).Result(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "stale entry dropped", 30*time.Second, func() bool { n, _ := tw.rdb.ZCard(ctx, k.Queue).Result(); return n == 0 })
	if n := tw.count("SELECT hits FROM receipts WHERE id = 'r-3'"); n != 1 {
		t.Errorf("an executed task ran again: hits %d", n)
	}
	d.stop()
}

func redisZ(member string, at time.Time) redis.Z {
	return redis.Z{Score: float64(queue.DeadlineMillis(at)), Member: member}
}
