package tasks

import (
	"context"
	"errors"
	"testing"

	"github.com/jmoiron/sqlx"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// durableRows inserts SCHEDULED rows of queue 'q', due now, for ids.
func durableRows(t *testing.T, db *sqlx.DB, ids ...string) {
	t.Helper()
	for _, id := range ids {
		if _, err := db.Exec(`INSERT INTO orderdelay_tasks (queue, id, due_at, payload) VALUES ('q', $1, now(), '{}')`, id); err != nil {
			t.Fatal(err)
		}
	}
}

func durableRow(t *testing.T, db *sqlx.DB, id string) Row {
	t.Helper()
	var r Row
	if err := db.Get(&r, `SELECT id, due_at, payload, state, attempts, version FROM orderdelay_tasks WHERE queue = 'q' AND id = $1`, id); err != nil {
		t.Fatal(err)
	}
	return r
}

// A producer reschedules a durable task (PUT: a new version, attempts back
// to 0) while a run of its old version is failing. The old run's failure
// must not count against the new schedule: settle never touches a newer
// version, and neither may the attempt it records.
func TestDurableOldRunsFailureDoesNotBumpTheNewSchedule(t *testing.T) {
	db, _ := testenv.Postgres(t)
	durableRows(t, db, "a")
	d := &Durable{DB: db, Queue: "q", Log: zaptest.NewLogger(t)}
	action := func(ctx context.Context, tasks []consumer.Task) []error {
		// What Put does on a reschedule, while the action runs.
		if _, err := db.Exec(`UPDATE orderdelay_tasks SET due_at = now() + interval '1 hour', attempts = 0,
			version = version + 1 WHERE queue = 'q' AND id = 'a'`); err != nil {
			t.Fatal(err)
		}
		return []error{errors.New("the old run failed")}
	}
	errs := d.Executor(action, 5)(context.Background(), tasksOf("a"))
	if errs[0] == nil {
		t.Fatal("the action's error was lost")
	}
	if r := durableRow(t, db, "a"); r.Attempts != 0 || r.State != StateScheduled || r.Version != 2 {
		t.Errorf("rescheduled row after the old run failed: state %s, attempts %d, version %d; want SCHEDULED, 0, 2",
			r.State, r.Attempts, r.Version)
	}
}

