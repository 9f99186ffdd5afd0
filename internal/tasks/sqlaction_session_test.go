package tasks

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A task whose statement ends its own database session (a trigger or
// extension that terminates its backend on that row): lib/pq answers
// "bad connection", which was taken for an outage — the whole batch
// retried, no attempt spent, its batch mates never done (failed before
// this change). The database answers a fresh connection at once, so the
// batch is split down to the task, which alone is retried later with no
// attempt spent (a session ended from outside looks the same), never
// dead-lettered; its batch mates are done.
func TestSQLTaskWhoseStatementEndsItsSessionIsIsolated(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ids := []string{"a", "b", "killer", "c", "d"}
	sqlFixture(t, db, ids...)
	killOn(t, db, "killer")
	const stmt = `UPDATE items SET done = true WHERE id = ANY($1) AND kill_on(id) RETURNING id`
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errs := sqlAction(db, stmt)(ctx, tasksOf(ids...))
	got := make([]string, len(errs))
	for i, err := range errs {
		got[i] = outcome(err)
	}
	if strings.Join(got, " ") != "done done later done done" {
		t.Errorf("outcomes %v (errors %v), want the killer retried later, every other task done", got, errs)
	}
	if errs[2] != nil && !strings.Contains(errs[2].Error(), "ended its database session") {
		t.Errorf("the killer's error %q does not say its statement ends its session", errs[2])
	}

	// Served by a consumer: the rest done, the killer tried again and
	// again, never an attempt, never dead-lettered.
	db2, _ := testenv.Postgres(t)
	sqlFixture(t, db2, ids...)
	killOn(t, db2, "killer")
	q := startSQLQueue(t, db2, stmt, nil, ids...)
	waitUntil(t, "the rest done and the killer tried more often than max_attempts", 60*time.Second, func() bool {
		var n int
		return len(doneRows(t, db2)) == len(ids)-1 && db2.Get(&n, `SELECT last_value FROM tries`) == nil && n > sqlTestMaxAttempts+3
	})
	if tk, ok := q.task("killer"); !ok || tk.State == client.StateDead || tk.Attempts != 0 {
		t.Errorf("killer: %+v (present %v); want it kept, no attempt spent", tk, ok)
	}
	if got := strings.Join(doneRows(t, db2), ","); got != "a,b,c,d" {
		t.Errorf("rows done: %s, want every one but the killer's", got)
	}
}

// The other side: the statement's connection is cut mid-statement and the
// database then refuses connections (an outage, at a proxy): the ping
// fails, so the task is not taken for a killer — unavailable, no attempt
// spent. A batch of one: nothing to split, so only the ping stands
// between an outage and an attempt.
func TestSQLTaskSessionCutByAnOutageSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	direct, db, _, proxy := testenv.PostgresViaProxy(t)
	ids := []string{"slow"}
	sqlFixture(t, direct, ids...)
	if _, err := direct.Exec(`CREATE FUNCTION slow_on(item text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
  IF item = 'slow' THEN PERFORM nextval('tries'); PERFORM pg_sleep(3); END IF;
  RETURN true;
END $$`); err != nil {
		t.Fatal(err)
	}
	go func() {
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			var called bool
			if direct.Get(&called, `SELECT is_called FROM tries`) == nil && called {
				proxy.Down()
				return
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errs := sqlAction(db, `UPDATE items SET done = true WHERE id = ANY($1) AND slow_on(id) RETURNING id`)(ctx, tasksOf(ids...))
	for i, err := range errs {
		if outcome(err) != "unavailable" {
			t.Errorf("task %s: %s (%v), want unavailable: the connection was cut by an outage", ids[i], outcome(err), err)
		}
	}
}

// killOn makes kill_on(item) end its own session for the task id (counting
// each time in the sqlFixture's sequence tries), true for any other.
func killOn(t *testing.T, db *sqlx.DB, id string) {
	t.Helper()
	if _, err := db.Exec(`CREATE FUNCTION kill_on(item text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
  IF item = '` + id + `' THEN PERFORM nextval('tries'); PERFORM pg_terminate_backend(pg_backend_pid()); END IF;
  RETURN true;
END $$`); err != nil {
		t.Fatal(err)
	}
}
