package tasks

import (
	"context"
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/metrics"
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
	t.Parallel()
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

// A durable sql task done by an earlier statement of its batch (bisection
// committed its half) is recorded EXECUTED even when the batch's context
// ends while another task of the batch is being isolated (shutdown, or the
// batch's time). Left SCHEDULED, the loader would put it back into Redis
// and run it again, and a statement with a WHERE guard would then not
// return it: a done task spending attempts, in the end FAILED.
func TestDurableTaskDoneBeforeTheBatchIsCutIsSettled(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "a", "poison", "slow")
	if _, err := db.Exec(`CREATE OR REPLACE FUNCTION check_item(id text) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN
			IF id LIKE 'poison%' THEN RAISE EXCEPTION 'poison task %', id; END IF;
			IF id LIKE 'slow%' THEN PERFORM pg_sleep(30); END IF;
			RETURN true;
		END $$`); err != nil {
		t.Fatal(err)
	}
	durableRows(t, db, "a", "poison", "slow")
	d := &Durable{DB: db, Queue: "q", Log: zaptest.NewLogger(t)}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { // shutdown once the isolation reaches the slow task
		for ctx.Err() == nil {
			var n int
			if err := db.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND datname = current_database()`); err != nil || n > 0 {
				cancel()
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	// No deadline: the statement timeout is the session's (none), so the
	// slow task sleeps until the cancel.
	errs := d.Executor(sqlAction(db, `UPDATE items SET done = true WHERE id = ANY($1) AND check_item(id) RETURNING id`), 5)(
		ctx, tasksOf("a", "poison", "slow"))
	if got := []string{outcome(errs[0]), outcome(errs[1]), outcome(errs[2])}; got[0] != "done" || got[2] != "unavailable" {
		t.Fatalf("outcomes %v, want a done and slow unavailable", got)
	}
	if r := durableRow(t, db, "a"); r.State != StateExecuted {
		t.Errorf("task a (its statement committed) after the batch was cut: row %s, want EXECUTED", r.State)
	}
	// The consumer hands the failed and untried tasks back on a shutdown,
	// spending no attempt: their rows agree.
	for _, id := range []string{"poison", "slow"} {
		if r := durableRow(t, db, id); r.State != StateScheduled || r.Attempts != 0 {
			t.Errorf("%s task after the shutdown: row %s, attempts %d; want SCHEDULED, 0", id, r.State, r.Attempts)
		}
	}
}

// A statement may return NULL for one task's row (RETURNING a nullable
// column): a clear error, and only that task spends an attempt; its
// batch-mates are done.
func TestSQLActionNullResultIsolatesItsTask(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "a", "nul", "b")
	errs := sqlAction(db, `UPDATE items SET done = true WHERE id = ANY($1)
		RETURNING CASE WHEN id = 'nul' THEN NULL ELSE id END`)(context.Background(), tasksOf("a", "nul", "b"))
	if outcome(errs[0]) != "done" || outcome(errs[2]) != "done" {
		t.Errorf("batch-mates of the NULL: %v, %v; want done", errs[0], errs[2])
	}
	if outcome(errs[1]) != "attempt" || errs[1].Error() != "statement result: NULL serial" {
		t.Errorf("the task whose row returns NULL: %v, want an attempt with a clear error", errs[1])
	}
	if got := doneRows(t, db); len(got) != 2 {
		t.Errorf("rows done %v, want a and b (nul's statement rolled back)", got)
	}
}

// docsStatement is docs/tasks.md's example sql statement, word for word
// (and configs/orderdelay.yaml's).
const docsStatement = `WITH confirmed AS (
  UPDATE shipments SET received_at = now(), auto_confirmed = true
  WHERE shipment_no = ANY($1) AND received_at IS NULL
  RETURNING shipment_no)
SELECT shipment_no FROM confirmed
UNION ALL -- confirmed before (a rerun): handled too
SELECT shipment_no FROM shipments WHERE shipment_no = ANY($1) AND received_at IS NOT NULL`

// A batch runs again after its statement committed (its COMMIT's answer
// was lost, its lease expired, the durable settle did not happen): the
// documented statement must then report the tasks it had handled as done.
// Not returning them would spend an attempt per rerun and dead-letter a
// task whose work is done.
func TestSQLTaskDocumentedStatementRerunIsDone(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	if _, err := db.Exec(`CREATE TABLE shipments (shipment_no text PRIMARY KEY, received_at timestamptz,
		auto_confirmed boolean NOT NULL DEFAULT false);
		INSERT INTO shipments (shipment_no) VALUES ('s1'), ('s2')`); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"docs/tasks.md", "configs/orderdelay.yaml"} {
		b, err := os.ReadFile(filepath.Join("..", "..", f))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(dedent(string(b)), dedent(docsStatement)) {
			t.Errorf("%s does not show the statement this test runs", f)
		}
	}
	action := sqlAction(db, docsStatement)
	for run := 1; run <= 2; run++ {
		for i, err := range action(context.Background(), tasksOf("s1", "s2", "missing")) {
			want := "done"
			if i == 2 {
				want = "attempt" // no such shipment: not handled
			}
			if outcome(err) != want {
				t.Errorf("run %d, task %d: %s (%v), want %s", run, i, outcome(err), err, want)
			}
		}
	}
}

// dedent strips each line's leading spaces.
func dedent(s string) string {
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		lines[i] = strings.TrimLeft(l, " ")
	}
	return strings.Join(lines, "\n")
}

// A durable task cancelled (DELETE) while its batch isolates a poison
// batch-mate is not run by the isolation's later statements: the executor
// checked its state before the first statement only, and bisection can
// run statements for most of the lease after that.
func TestDurableTaskCancelledDuringIsolationIsNotRun(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "poison", "b")
	// The poison task's check waits for a lock the test holds, so the
	// cancel lands after the first statement began and before the split.
	if _, err := db.Exec(`CREATE OR REPLACE FUNCTION check_item(id text) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN
			IF id LIKE 'poison%' THEN
				PERFORM pg_advisory_xact_lock(4242);
				RAISE EXCEPTION 'poison task %', id;
			END IF;
			RETURN true;
		END $$`); err != nil {
		t.Fatal(err)
	}
	durableRows(t, db, "poison", "b")
	holder, err := db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	if _, err := holder.ExecContext(context.Background(), `SELECT pg_advisory_lock(4242)`); err != nil {
		t.Fatal(err)
	}
	d := &Durable{DB: db, Queue: "q", Log: zaptest.NewLogger(t)}
	result := make(chan []error, 1)
	go func() {
		result <- d.Executor(sqlAction(db, `UPDATE items SET done = true WHERE id = ANY($1) AND check_item(id) RETURNING id`), 5)(
			context.Background(), tasksOf("poison", "b"))
	}()
	waitUntil(t, "the first statement waiting on the poison task's lock", 30*time.Second, func() bool {
		var n int
		if err := db.Get(&n, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = 4242`); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
	// What Durable.Cancel does in PostgreSQL.
	if _, err := db.Exec(`UPDATE orderdelay_tasks SET state = 'CANCELLED', version = version + 1 WHERE queue = 'q' AND id = 'b'`); err != nil {
		t.Fatal(err)
	}
	if _, err := holder.ExecContext(context.Background(), `SELECT pg_advisory_unlock(4242)`); err != nil {
		t.Fatal(err)
	}
	errs := <-result
	if outcome(errs[0]) != "attempt" {
		t.Errorf("poison task: %s (%v), want an attempt", outcome(errs[0]), errs[0])
	}
	if got := doneRows(t, db); len(got) != 0 {
		t.Errorf("rows done %v after b was cancelled during its batch; want none", got)
	}
	if r := durableRow(t, db, "b"); r.State != StateCancelled {
		t.Errorf("b's row %s, want CANCELLED", r.State)
	}
}

// A task deleted (DELETE /v1/queues/…/tasks/{id}: its queue entry and
// lease record go) while its batch isolates a poison batch-mate is not run
// by the isolation's later statements, on a queue that is not durable
// either: the batch no longer holds it.
func TestSQLTaskDeletedDuringIsolationIsNotRun(t *testing.T) {
	t.Parallel()
	testDeletedDuringIsolation(t, false, false)
}

// As above, but the task's lease record now carries another claim's token
// (its lease expired and another replica took it, as after a pause of
// this one): the old batch leaves it to that claim, unrun.
func TestSQLTaskReclaimedDuringIsolationIsNotRunByTheOldBatch(t *testing.T) {
	t.Parallel()
	testDeletedDuringIsolation(t, false, true)
}

// As above on a durable queue whose Redis entry alone goes (as when
// another replica takes the task after an expired lease, its row still
// SCHEDULED at the same version): the old batch neither runs it nor
// records it EXECUTED, which would have the other replica drop a task no
// one ran.
func TestDurableSQLTaskNoLongerHeldIsNeitherRunNorSettled(t *testing.T) {
	t.Parallel()
	testDeletedDuringIsolation(t, true, false)
}

func testDeletedDuringIsolation(t *testing.T, durable, reclaim bool) {
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "poison", "b")
	// The poison task's check waits for a lock the test holds (no
	// lock_timeout; the statement_timeout, 7/32 of the 40 s lease, is the
	// bound), so the delete lands after the first statement began and
	// before the split runs b alone.
	if _, err := db.Exec(`CREATE OR REPLACE FUNCTION check_item(id text) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN
			IF id LIKE 'poison%' THEN
				PERFORM set_config('lock_timeout', '0', true);
				PERFORM pg_advisory_xact_lock(4243);
				RAISE EXCEPTION 'poison task %', id;
			END IF;
			RETURN true;
		END $$`); err != nil {
		t.Fatal(err)
	}
	holder, err := db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	if _, err := holder.ExecContext(context.Background(), `SELECT pg_advisory_lock(4243)`); err != nil {
		t.Fatal(err)
	}
	rdb, keys := testenv.Redis(t)
	cl, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"poison", "b"} {
		if _, _, err := cl.PutTask(context.Background(), id, []byte(`{}`), time.Now().Add(-time.Second), client.Create); err != nil {
			t.Fatal(err)
		}
	}
	process := sqlAction(db, `UPDATE items SET done = true WHERE id = ANY($1) AND check_item(id) RETURNING id`)
	if durable {
		durableRows(t, db, "poison", "b")
		d := &Durable{DB: db, Queue: "q", Log: zaptest.NewLogger(t)}
		process = d.Executor(process, 5)
	}
	c, err := consumer.New(consumer.Config{
		Keys: keys, Workers: 1, BatchSize: 20, Lease: 40 * time.Second, StatementTimeout: 30 * time.Second,
		DrainTimeout: time.Second, MaxAttempts: 5, ScanInterval: 100 * time.Millisecond, Owner: "t",
		Retry:   func(int) time.Duration { return time.Hour },
		Process: process,
	}, rdb, nil, metrics.New(prometheus.NewRegistry(), "t", "t"), zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { defer close(stopped); c.Run(runCtx) }() //nolint:errcheck // nil once runCtx ends
	defer func() { cancel(); <-stopped }()
	waitUntil(t, "the first statement waiting on the poison task's lock", 30*time.Second, func() bool {
		var n int
		if err := db.Get(&n, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = 4243`); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
	if reclaim {
		// What a claim by another replica leaves: deadline|attempts|token.
		rec, err := rdb.HGet(context.Background(), keys.Lease, "b").Result()
		if err != nil {
			t.Fatal(err)
		}
		f := strings.SplitN(rec, "|", 4)
		f[2] = "other:replica.1"
		if err := rdb.HSet(context.Background(), keys.Lease, "b", strings.Join(f, "|")).Err(); err != nil {
			t.Fatal(err)
		}
	} else if n, err := cl.DeleteTasks(context.Background(), "b"); err != nil || n != 1 {
		t.Fatalf("delete b: %d, %v", n, err)
	}
	if _, err := holder.ExecContext(context.Background(), `SELECT pg_advisory_unlock(4243)`); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the poison task's attempt", 30*time.Second, func() bool {
		tk, err := cl.GetTask(context.Background(), "poison")
		if err != nil {
			t.Fatal(err)
		}
		return tk.Attempts >= 1
	})
	if got := doneRows(t, db); len(got) != 0 {
		t.Errorf("rows done %v after b was deleted or reclaimed during its batch; want none", got)
	}
	if durable {
		if r := durableRow(t, db, "b"); r.State != StateScheduled || r.Version != 1 {
			t.Errorf("b's row %s version %d after the old batch let it go; want SCHEDULED, 1", r.State, r.Version)
		}
	}
}

// A statement that returns ids not in its batch, or one id twice: the
// batch's tasks are done, nothing else is, and nothing fails.
func TestSQLActionStrangerAndDuplicateIds(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db)
	errs := sqlAction(db, `SELECT x FROM unnest($1::text[] || ARRAY['stranger', $1[1]]) AS x`)(
		context.Background(), tasksOf("a", "b"))
	for i, err := range errs {
		if err != nil {
			t.Errorf("task %d: %v, want done", i, err)
		}
	}
}

// The statement's result has the wrong shape for every task (the schema
// changed under the daemon after start-up's check: `RETURNING *` on a
// table that gained a column): like a class 42 error raised by the
// statement itself, it says nothing about any task, so none spends an
// attempt (each would, alone, and be dead-lettered), and the error says
// what is wrong.
func TestSQLActionResultOfTheWrongShapeSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "a", "b", "c")
	errs := sqlAction(db, `UPDATE items SET done = true WHERE id = ANY($1) RETURNING *`)(
		context.Background(), tasksOf("a", "b", "c"))
	for i, err := range errs {
		if outcome(err) != "unavailable" || !strings.Contains(err.Error(), "2 columns") {
			t.Errorf("task %d: %s (%v), want unavailable, the column count named", i, outcome(err), err)
		}
	}
	if got := doneRows(t, db); len(got) != 0 {
		t.Errorf("rows done %v, want none (rolled back)", got)
	}
}

// PostgreSQL is cut off (a restart, a network cut) in the middle of an
// isolation: what was settled stays settled (the batch-mate done, the
// poison task's attempt), and the statement cut and the tasks not yet
// tried spend no attempt.
func TestSQLActionDatabaseCutMidIsolation(t *testing.T) {
	t.Parallel()
	direct, dsn := testenv.Postgres(t)
	sqlFixture(t, direct, "poison", "a", "slow", "b")
	if _, err := direct.Exec(`CREATE OR REPLACE FUNCTION check_item(id text) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN
			IF id LIKE 'poison%' THEN RAISE EXCEPTION 'poison task %', id; END IF;
			IF id LIKE 'slow%' THEN PERFORM pg_sleep(60); END IF;
			RETURN true;
		END $$`); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.NewProxy(t, u.Host)
	u.Host = proxy.Addr()
	db, err := sqlx.Open("postgres", u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	go func() { // cut once the isolation reaches the slow task
		for end := time.Now().Add(60 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
			var n int
			if direct.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND datname = current_database()`) == nil && n > 0 {
				proxy.Down()
				return
			}
		}
	}()
	errs := sqlAction(db, `UPDATE items SET done = true WHERE id = ANY($1) AND check_item(id) RETURNING id`)(
		context.Background(), tasksOf("poison", "a", "slow", "b"))
	want := []string{"attempt", "done", "unavailable", "unavailable"}
	for i, err := range errs {
		if outcome(err) != want[i] {
			t.Errorf("task %d: %s (%v), want %s", i, outcome(err), err, want[i])
		}
	}
	if got := doneRows(t, direct); len(got) != 1 || got[0] != "a" {
		t.Errorf("rows done %v, want [a]", got)
	}
}
