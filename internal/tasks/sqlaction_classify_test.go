package tasks

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// outcome names what a ProcessFunc's error means to the consumer.
func outcome(err error) string {
	var na *consumer.NoAttemptError
	switch {
	case err == nil:
		return "done"
	case errors.As(err, &na) && na.Unavailable:
		return "unavailable"
	case errors.As(err, &na):
		return "later"
	default:
		return "attempt"
	}
}

// Each kind of error the statement can meet on one task of a batch of
// three, raised by a function for that task's row with the SQLSTATE the
// server would give, and what each task of the batch gets: the order
// path's classification (orders.Transient, orders.Contended), reused.
func TestSQLActionClassifiesEachError(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "a", "bad", "b")
	if _, err := db.Exec(`CREATE TABLE codes (id text PRIMARY KEY, code text NOT NULL);
		CREATE FUNCTION raise_for(item text) RETURNS boolean LANGUAGE plpgsql AS $$
		DECLARE c text;
		BEGIN
			SELECT code INTO c FROM codes WHERE id = item;
			IF c IS NOT NULL THEN RAISE EXCEPTION 'raised % for %', c, item USING ERRCODE = c; END IF;
			RETURN true;
		END $$`); err != nil {
		t.Fatal(err)
	}
	const stmt = `UPDATE items SET done = false WHERE id = ANY($1) AND raise_for(id) RETURNING id`
	for _, tc := range []struct {
		code string
		want string // outcomes of a, bad, b
	}{
		// Contended: one row's, retried without an attempt; batch-mates done.
		{"40001", "done later done"}, // serialization failure
		{"40P01", "done later done"}, // deadlock
		{"55P03", "done later done"}, // lock not available
		{"57014", "done later done"}, // the server's statement timeout
		// About the database: nobody spends an attempt.
		{"25006", "unavailable unavailable unavailable"}, // read-only (a standby)
		{"53300", "unavailable unavailable unavailable"}, // too many connections
		{"53100", "unavailable unavailable unavailable"}, // disk full
		{"57P01", "unavailable unavailable unavailable"}, // admin shutdown
		{"58030", "unavailable unavailable unavailable"}, // I/O error
		{"08006", "unavailable unavailable unavailable"}, // connection failure
		// About the row: the batch is split, only the task spends an attempt.
		{"23505", "done attempt done"}, // unique violation
		{"23514", "done attempt done"}, // check violation
		{"22012", "done attempt done"}, // division by zero
		{"P0001", "done attempt done"}, // a trigger's RAISE
		{"42703", "done attempt done"}, // class 42 inside a function: may depend on the row
	} {
		t.Run(tc.code, func(t *testing.T) {
			if _, err := db.Exec(`INSERT INTO codes VALUES ('bad', $1) ON CONFLICT (id) DO UPDATE SET code = EXCLUDED.code`, tc.code); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			errs := sqlAction(db, stmt)(ctx, tasksOf("a", "bad", "b"))
			got := make([]string, len(errs))
			for i, err := range errs {
				got[i] = outcome(err)
			}
			if strings.Join(got, " ") != tc.want {
				t.Errorf("outcomes %v (errors %v), want %s", got, errs, tc.want)
			}
			if tc.want != "done later done" && tc.want != "done attempt done" {
				return
			}
			if !strings.Contains(errs[1].Error(), "raised "+tc.code+" for bad") {
				t.Errorf("the failing task's error %q does not name its cause", errs[1])
			}
		})
	}
	// A statement broken for every input (the schema changed under the
	// daemon: class 42 raised by the statement itself) buries nobody.
	errs := sqlAction(db, `UPDATE items SET nope = 1 WHERE id = ANY($1) RETURNING id`)(context.Background(), tasksOf("a", "b"))
	for i, err := range errs {
		if outcome(err) != "unavailable" {
			t.Errorf("undefined column in the statement, task %d: %s (%v), want unavailable", i, outcome(err), err)
		}
	}
}

// A batch whose tasks time out one after another costs a bounded number of
// timeouts: after the batch's own, the tasks are tried one by one until
// maxCostly of them timed out; the database is then taken to be slow and
// the rest goes back untried, no attempt spent. Fast tasks tried before
// are done.
func TestSQLActionBoundsTheTimeoutsItSpendsIsolating(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ids := []string{"fast1", "slow1", "slow2", "slow3", "fast2"}
	sqlFixture(t, db, ids...)
	stmt := `UPDATE items SET done = true WHERE id = ANY($1)
		AND CASE WHEN id LIKE 'slow%' AND nextval('tries') > 0 THEN pg_sleep(30) IS NOT NULL ELSE true END RETURNING id`
	// 4 s of batch: 1 s per statement.
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
	defer cancel()
	start := time.Now()
	errs := sqlAction(db, stmt)(ctx, tasksOf(ids...))
	took := time.Since(start)
	got := make([]string, len(errs))
	for i, err := range errs {
		got[i] = outcome(err)
	}
	if want := "done later later unavailable unavailable"; strings.Join(got, " ") != want {
		t.Errorf("outcomes %v (errors %v), want %s", got, errs, want)
	}
	var slowTries int
	if err := db.Get(&slowTries, `SELECT last_value FROM tries`); err != nil {
		t.Fatal(err)
	}
	// The batch's statement reached one slow row, then slow1 and slow2
	// alone: three timeouts, never slow3.
	if slowTries != 3 {
		t.Errorf("slow rows tried %d times, want 3 (the batch, then maxCostly=%d alone)", slowTries, maxCostly)
	}
	if ctx.Err() != nil {
		t.Errorf("the action used up its batch's time (%v): a statement was cut by the client", took)
	}
	t.Logf("isolating took %v", took)
}

func tasksOf(ids ...string) []consumer.Task {
	out := make([]consumer.Task, len(ids))
	for i, id := range ids {
		out[i] = consumer.Task{ID: id, Deadline: time.UnixMilli(1_700_000_000_000), Payload: []byte(`{}`)}
	}
	return out
}

// A statement the client cancels (the drain timeout ending a shutdown: the
// batch's context is cancelled, lib/pq asks the server to cancel and
// reports its 57014) says nothing about the tasks: it is not taken for the
// server's statement timeout (which would start isolating with no time
// left), and no task spends an attempt. The consumer then hands the tasks
// back.
func TestSQLActionClientCancelIsNotATaskTimeout(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "x", "y")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		// Cancel once the statement is sleeping on the server.
		for {
			var n int
			if err := db.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND datname = current_database()`); err != nil || n > 0 {
				cancel()
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	errs := sqlAction(db, `UPDATE items SET done = pg_sleep(30) IS NOT NULL WHERE id = ANY($1) RETURNING id`)(ctx, tasksOf("x", "y"))
	for i, err := range errs {
		if outcome(err) != "unavailable" {
			t.Errorf("task %d after a client cancel: %s (%v), want unavailable", i, outcome(err), err)
		}
	}
}
