package e2e

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/tasks"
)

const durableConfirmQueue = `
queues:
  - name: confirm
    key: PREFIX:confirm
    durable: true
    window: 10s
    action:
      type: sql
      statement: "UPDATE receipts SET hits = hits + 1 WHERE id = ANY($1) RETURNING id"
`

// `orderdelay task put|get|delete` on a durable queue go through the
// durable tier, exactly as the HTTP API does: put writes the row (and the
// task runs), get shows the row, delete cancels the row too, so the loader
// never brings the task back. Before, delete printed "deleted 1 of 1
// tasks" and the task ran anyway (its row stayed SCHEDULED and the loader
// re-added it), and put said "created" for a task that had no row and so
// never ran.
func TestCLIDurableQueueGoesThroughTheDurableTier(t *testing.T) {
	t.Parallel()
	tw := newTaskWorld(t, durableConfirmQueue)
	if _, err := tw.db.Exec(`CREATE TABLE receipts (id text PRIMARY KEY, hits int NOT NULL DEFAULT 0);
		INSERT INTO receipts (id) VALUES ('c-1'), ('c-2'), ('c-3'), ('c-4')`); err != nil {
		t.Fatal(err)
	}
	d := tw.start()
	flags := []string{"--queues-file", tw.file}
	task := func(args ...string) string { return tw.cli(append(append([]string{"task"}, args...), flags...)...) }
	state := func(id string) string {
		var s string
		if err := tw.db.Get(&s, `SELECT state FROM orderdelay_tasks WHERE queue = 'confirm' AND id = $1`, id); err != nil {
			return "no row (" + err.Error() + ")"
		}
		return s
	}
	// The queue is paused while c-1 is deleted and c-3 is read back, so
	// neither races its task's run however slow the machine (before, a
	// CLI that took longer than c-1's 3 s found it executed already).
	task("pause", "confirm", "--reason", "test")
	// c-1 and c-2 are due in 3 s: within the window, so in Redis too.
	for _, id := range []string{"c-1", "c-2"} {
		if code := d.call(http.MethodPut, "/v1/queues/confirm/tasks/"+id, "", `{"after":"3s","payload":{"n":1}}`, nil); code != http.StatusCreated {
			t.Fatalf("PUT %s: %d", id, code)
		}
	}
	// Delete through the CLI: the row is cancelled, at once.
	out := task("delete", "confirm", "c-1")
	if !strings.Contains(out, "deleted 1 of 1") {
		t.Errorf("task delete said %q, want it to delete c-1", strings.TrimSpace(out))
	}
	if got := state("c-1"); got != tasks.StateCancelled {
		t.Fatalf("after `task delete` (%q) c-1 is %s, want CANCELLED", strings.TrimSpace(out), got)
	}
	// Put through the CLI: a row, and (once the queue is resumed) the task
	// runs.
	out = task("put", "confirm", "c-3", "--after", "4s", "--payload", `{"n":3}`)
	if !strings.Contains(out, "created") {
		t.Errorf("task put said %q", out)
	}
	if got := state("c-3"); got != tasks.StateScheduled {
		t.Fatalf("after `task put` c-3 is %s, want SCHEDULED", got)
	}
	var row tasks.Row
	if err := json.Unmarshal([]byte(task("get", "confirm", "c-3")), &row); err != nil || row.State != tasks.StateScheduled ||
		!strings.Contains(string(row.Payload), "3") {
		t.Errorf("task get: %+v, %v; want the row, SCHEDULED, with its payload", row, err)
	}
	task("resume", "confirm")
	// c-4 is due well after c-1: once it ran, the loader has passed c-1's
	// due time several times (every 1 s with a 10 s window).
	task("put", "confirm", "c-4", "--after", "7s")
	waitFor(t, "c-2, c-3 and c-4 executed", 60*time.Second, func() bool {
		return tw.count(`SELECT count(*) FROM orderdelay_tasks WHERE queue = 'confirm' AND state = 'EXECUTED'`) == 3
	})
	if n := tw.count(`SELECT hits FROM receipts WHERE id = 'c-1'`); n != 0 {
		t.Errorf("c-1, deleted through the CLI, ran %d times", n)
	}
	if got := state("c-1"); got != tasks.StateCancelled {
		t.Errorf("c-1 ends %s, want CANCELLED", got)
	}
	if n := tw.count(`SELECT count(*) FROM receipts WHERE id <> 'c-1' AND hits <> 1`); n != 0 {
		t.Errorf("%d of c-2, c-3, c-4 did not run exactly once", n)
	}
	d.stop()
}

// A daemon killed between a durable task's action and its settle (a real
// SIGKILL: the webhook receiver has the delivery, the daemon never sees the
// answer) leaves the row SCHEDULED; the next daemon runs the task again once
// the lease expires (at least once) and settles it once: one EXECUTED log
// row, no error.
func TestDurableTaskRunsAgainAfterAKillBetweenActionAndSettle(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var deliveries int
	var first *daemon
	firstSeen := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		deliveries++
		n, victim := deliveries, first
		mu.Unlock()
		if n == 1 {
			victim.kill() // the side effect happened; its settle never will
			close(firstSeen)
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	tw := newTaskWorld(t, `
queues:
  - name: hook
    key: PREFIX:hook
    durable: true
    window: 10s
    lease: 3s
    action: {type: webhook, url: `+srv.URL+`, timeout: 2s, secret_env: OD_TEST_SECRET}
`)
	d := tw.start()
	mu.Lock()
	first = d
	mu.Unlock()
	if code := d.call(http.MethodPut, "/v1/queues/hook/tasks/k-1", "", `{"after":"1s","payload":{"n":1}}`, nil); code != http.StatusCreated {
		t.Fatalf("PUT: %d", code)
	}
	select {
	case <-firstSeen:
	case <-time.After(60 * time.Second):
		t.Fatal("the task was never delivered")
	}
	if got := tw.count(`SELECT count(*) FROM orderdelay_tasks WHERE queue = 'hook' AND id = 'k-1' AND state = 'SCHEDULED'`); got != 1 {
		t.Fatalf("after the kill the row is not SCHEDULED")
	}
	second := tw.start()
	waitFor(t, "k-1 executed by the second daemon", 60*time.Second, func() bool {
		return tw.count(`SELECT count(*) FROM orderdelay_tasks WHERE queue = 'hook' AND id = 'k-1' AND state = 'EXECUTED'`) == 1
	})
	mu.Lock()
	if deliveries != 2 {
		t.Errorf("%d deliveries, want 2 (the killed one, then once more)", deliveries)
	}
	mu.Unlock()
	if n := tw.count(`SELECT count(*) FROM orderdelay_task_log WHERE queue = 'hook' AND task_id = 'k-1' AND state = 'EXECUTED'`); n != 1 {
		t.Errorf("%d EXECUTED log rows, want 1", n)
	}
	second.stop()
	for _, line := range strings.Split(second.Output(), "\n") {
		if strings.Contains(line, "recording outcomes failed") || strings.Contains(line, `"level":"error"`) {
			t.Errorf("second daemon: %s", line)
		}
	}
}
