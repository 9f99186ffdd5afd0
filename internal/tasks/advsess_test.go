package tasks

import (
	"strings"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Adversarial review (advsess) of 82024e8, on the path it left as it was:
// a sql action's statement that ends its own session on one task's row (a
// shop's function that terminates or crashes its backend) answers "bad
// connection", which sqlRun.failed takes for the database's
// (orders.Transient): the whole batch is retried Unavailable after the
// dependency backoff, never split, on every claim. Its batch-mates, due
// with it and claimed with it again every time, are never done — the
// order path's bug before 82024e8 (TestAdvWholeSessionEndingPoisonDoes-
// NotHoldItsBatchMates), with the database answering every other statement.
// Contract ("poison never blocks"): the batch-mates are done; the task
// whose statement ends its session is the only one retried.
func TestAdvSessSQLTaskEndingItsSessionDoesNotHoldItsBatch(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ids := []string{"a", "b", "c", "kill", "d"}
	sqlFixture(t, db, ids...)
	if _, err := db.Exec(`CREATE FUNCTION kill_item(id text) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN
			IF id = 'kill' THEN PERFORM pg_terminate_backend(pg_backend_pid()); END IF;
			RETURN true;
		END $$;`); err != nil {
		t.Fatal(err)
	}
	q := startSQLQueue(t, db, `UPDATE items SET done = true WHERE id = ANY($1) AND kill_item(id) RETURNING id`, nil, ids...)
	// Isolating one task among five by halves takes four statements, in
	// the first batch; before, every batch failed whole, and the wait
	// below timed out.
	waitUntil(t, "the batch-mates done and gone from the queue", 60*time.Second, func() bool {
		if len(doneRows(t, db)) != len(ids)-1 {
			return false
		}
		for _, id := range ids {
			if _, ok := q.task(id); ok && id != "kill" {
				return false
			}
		}
		return true
	})
	if got := strings.Join(doneRows(t, db), ","); got != "a,b,c,d" {
		t.Errorf("rows done after %d batches: %q, want every one but the task whose statement ends its session", q.calls.Load(), got)
	}
	for _, id := range ids {
		if tk, ok := q.task(id); ok && id != "kill" {
			t.Errorf("task %s still in the queue (%s, %d attempts, last error %q): held back by its batch-mate's statement ending its session",
				id, tk.State, tk.Attempts, tk.LastError)
		}
	}
}
