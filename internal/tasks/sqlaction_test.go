package tasks

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// sqlQueue is a sql action's queue served by a real consumer on real
// Redis and PostgreSQL, as the Manager runs one.
type sqlQueue struct {
	t     *testing.T
	rdb   *redis.Client
	keys  queue.Keys
	cl    *client.Client
	calls atomic.Int64 // batches the action ran
	stop  func()
}

// sqlTestMaxAttempts is the queues' max_attempts: small, so the old
// behaviour (every error an attempt) dead-letters quickly.
const sqlTestMaxAttempts = 2

// startSQLQueue runs process (built by wrap around sqlAction(db,
// statement)) for the tasks ids, all due now and claimed in one batch.
func startSQLQueue(t *testing.T, db *sqlx.DB, statement string, wrap func(consumer.ProcessFunc) consumer.ProcessFunc, ids ...string) *sqlQueue {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	cl, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, id := range ids {
		if _, _, err := cl.PutTask(ctx, id, []byte(`{}`), time.Now().Add(-time.Second), client.Create); err != nil {
			t.Fatal(err)
		}
	}
	q := &sqlQueue{t: t, rdb: rdb, keys: keys, cl: cl}
	action := sqlAction(db, statement)
	if wrap != nil {
		action = wrap(action)
	}
	// A lease of 2 s: each batch has 1.75 s, each statement 0.44 s.
	c, err := consumer.New(consumer.Config{
		Keys: keys, Workers: 1, BatchSize: 20, Lease: 2 * time.Second, StatementTimeout: 1500 * time.Millisecond,
		DrainTimeout: time.Second, MaxAttempts: sqlTestMaxAttempts, BackoffMax: 2 * time.Second,
		ScanInterval: 100 * time.Millisecond, Owner: "t",
		Retry: func(int) time.Duration { return 50 * time.Millisecond },
		Process: func(ctx context.Context, tasks []consumer.Task) []error {
			q.calls.Add(1)
			return action(ctx, tasks)
		},
	}, rdb, nil, metrics.New(prometheus.NewRegistry(), "t", "t"), zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		c.Run(runCtx) //nolint:errcheck // nil once runCtx ends
	}()
	var once sync.Once
	q.stop = func() { once.Do(func() { cancel(); wg.Wait() }) }
	t.Cleanup(q.stop)
	return q
}

// task returns id's entry; ok is false once it is gone (done).
func (q *sqlQueue) task(id string) (client.Task, bool) {
	q.t.Helper()
	tk, err := q.cl.GetTask(context.Background(), id)
	if errors.Is(err, client.ErrNotFound) {
		return tk, false
	}
	if err != nil {
		q.t.Fatal(err)
	}
	return tk, true
}

func waitUntil(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// sqlFixture creates the table the statements update: one row per id.
func sqlFixture(t *testing.T, db *sqlx.DB, ids ...string) {
	t.Helper()
	_, err := db.Exec(`CREATE TABLE items (id text PRIMARY KEY, done boolean NOT NULL DEFAULT false);
		CREATE TABLE knob (slow boolean NOT NULL);
		INSERT INTO knob VALUES (false);
		CREATE SEQUENCE tries;
		CREATE FUNCTION check_item(id text) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN
			IF id LIKE 'poison%' THEN RAISE EXCEPTION 'poison task %', id; END IF;
			RETURN true;
		END $$;`)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if _, err := db.Exec(`INSERT INTO items (id) VALUES ($1)`, id); err != nil {
			t.Fatal(err)
		}
	}
}

func doneRows(t *testing.T, db *sqlx.DB) []string {
	t.Helper()
	var ids []string
	if err := db.Select(&ids, `SELECT id FROM items WHERE done ORDER BY id`); err != nil {
		t.Fatal(err)
	}
	return ids
}

// A statement that PostgreSQL cuts for its statement_timeout (57014) on one
// task's slow row spends no attempt and never dead-letters the task, however
// often it happens; its batch-mate is done meanwhile, and the slow task is
// done once its row is fast again. (It was an attempt like any error: the
// task was dead-lettered after max_attempts.)
func TestSQLTaskStatementTimeoutNeverDeadLetters(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "fast", "slow")
	if _, err := db.Exec(`UPDATE knob SET slow = true`); err != nil {
		t.Fatal(err)
	}
	// nextval counts the tries of the slow row (a sequence survives the
	// rollback of the statement it ran in).
	q := startSQLQueue(t, db, `UPDATE items SET done = true WHERE id = ANY($1)
		AND CASE WHEN id = 'slow' AND nextval('tries') > 0 AND (SELECT slow FROM knob) THEN pg_sleep(30) IS NOT NULL ELSE true END
		RETURNING id`, nil, "fast", "slow")
	var tries int
	var seen []string // last errors of the slow task while backing off
	waitUntil(t, fmt.Sprintf("%d tries of the slow task", sqlTestMaxAttempts+2), 60*time.Second, func() bool {
		tk, ok := q.task("slow")
		if !ok || tk.State == client.StateDead || tk.Attempts != 0 {
			t.Fatalf("slow task after %d tries: present %v, state %q, attempts %d, last error %q; want it waiting, no attempt spent",
				tries, ok, tk.State, tk.Attempts, tk.LastError)
		}
		if tk.LastError != "" {
			seen = append(seen, tk.LastError)
		}
		if err := db.Get(&tries, `SELECT last_value FROM tries`); err != nil {
			t.Fatal(err)
		}
		return tries >= sqlTestMaxAttempts+2 && len(seen) > 0
	})
	if _, ok := q.task("fast"); ok {
		t.Errorf("the batch-mate is not done after %d tries of the slow task: held back with it", tries)
	}
	if !strings.Contains(seen[len(seen)-1], "statement timeout") {
		t.Errorf("slow task's last error %q, want the statement timeout named", seen[len(seen)-1])
	}
	if _, err := db.Exec(`UPDATE knob SET slow = false`); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the slow task done once its row is fast", 30*time.Second, func() bool { _, ok := q.task("slow"); return !ok })
	if got := strings.Join(doneRows(t, db), ","); got != "fast,slow" {
		t.Errorf("rows done: %s, want fast,slow", got)
	}
}

// holdRow locks items' row id in a transaction of another session until
// the returned function is called.
func holdRow(t *testing.T, db *sqlx.DB, id string) (release func()) {
	t.Helper()
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	var got string
	if err := tx.QueryRow(`SELECT id FROM items WHERE id = $1 FOR UPDATE`, id).Scan(&got); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			if err := tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
				t.Error(err)
			}
		})
	}
	t.Cleanup(release)
	return release
}

// A row another transaction holds (55P03 after lock_timeout) holds back
// only its own task, spends no attempt and never dead-letters it; the task
// is done once the lock goes. (Before, the statement waited out the
// batch's deadline, the client cancelled it, and every task of the batch
// spent an attempt: both were dead-lettered.)
func TestSQLTaskLockedRowNeverDeadLettersNorHoldsItsBatch(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "free", "locked")
	release := holdRow(t, db, "locked")
	q := startSQLQueue(t, db, `UPDATE items SET done = true WHERE id = ANY($1) RETURNING id`, nil, "free", "locked")
	waitUntil(t, "more tries of the locked task than max_attempts", 60*time.Second, func() bool {
		if tk, ok := q.task("locked"); !ok || tk.State == client.StateDead || tk.Attempts != 0 {
			t.Fatalf("locked task after %d batches: present %v, state %q, attempts %d, last error %q; want it waiting, no attempt spent",
				q.calls.Load(), ok, tk.State, tk.Attempts, tk.LastError)
		}
		return q.calls.Load() > sqlTestMaxAttempts
	})
	if _, ok := q.task("free"); ok {
		t.Errorf("the batch-mate is not done after %d batches: held back with the locked task", q.calls.Load())
	}
	release()
	waitUntil(t, "the locked task done once the lock is gone", 30*time.Second, func() bool { _, ok := q.task("locked"); return !ok })
	if got := strings.Join(doneRows(t, db), ","); got != "free,locked" {
		t.Errorf("rows done: %s, want free,locked", got)
	}
}

// A task whose row makes the statement fail (a function RAISEs for it) is
// isolated: its batch-mates are done, it alone spends attempts and is
// dead-lettered after max_attempts with the cause as its last error. The
// isolation costs at most 1 + 2*ceil(log2 N) statements for a batch of N.
// (Before, the whole batch failed every time and every task was
// dead-lettered.)
func TestSQLTaskPoisonIsIsolatedFromItsBatch(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ids := []string{"a", "b", "c", "d", "poison", "e", "f", "g"}
	sqlFixture(t, db, ids...)
	// tries counts statements (the FROM subquery runs once per statement).
	q := startSQLQueue(t, db, `UPDATE items SET done = true FROM (SELECT nextval('tries')) AS s
		WHERE id = ANY($1) AND check_item(id) RETURNING id`, nil, ids...)
	waitUntil(t, "the poison task dead-lettered", 60*time.Second, func() bool {
		tk, ok := q.task("poison")
		return ok && tk.State == client.StateDead
	})
	tk, _ := q.task("poison")
	if tk.Reason != consumer.ReasonFailed || tk.Attempts != sqlTestMaxAttempts || !strings.Contains(tk.LastError, "poison task poison") {
		t.Errorf("poison task: reason %q, attempts %d, last error %q; want failed after %d attempts naming the RAISE",
			tk.Reason, tk.Attempts, tk.LastError, sqlTestMaxAttempts)
	}
	for _, id := range ids {
		if _, ok := q.task(id); ok && id != "poison" {
			t.Errorf("task %s is still in the queue: the poison task held back its batch", id)
		}
	}
	if got := strings.Join(doneRows(t, db), ","); got != "a,b,c,d,e,f,g" {
		t.Errorf("rows done: %s, want every one but the poison task's", got)
	}
	var stmts int
	if err := db.Get(&stmts, `SELECT last_value FROM tries`); err != nil {
		t.Fatal(err)
	}
	// First batch of 8: 1 + 2*3; each later attempt: the poison task alone.
	if limit := 1 + 2*3 + (sqlTestMaxAttempts - 1); stmts > limit {
		t.Errorf("%d statements ran, want at most %d (bisection)", stmts, limit)
	}
}

// A read-only database (25006, as a standby answers after a failover)
// spends no attempt of any task, however long it lasts; the tasks are done
// once it is writable again. (Before, each try was an attempt: they were
// dead-lettered.) lib/pq opens transactions with BEGIN READ WRITE, which
// overrides default_transaction_read_only, so a trigger refuses the writes
// with 25006 while a flag row exists (a real standby refuses the BEGIN
// itself, an orders.BeginError, which is transient too).
func TestSQLTaskReadOnlyDatabaseSpendsNoAttempts(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "r1", "r2")
	if _, err := db.Exec(`CREATE TABLE read_only (on_ boolean);
		INSERT INTO read_only VALUES (true);
		CREATE FUNCTION refuse_writes() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF EXISTS (SELECT 1 FROM read_only) THEN
				RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction' USING ERRCODE = 'read_only_sql_transaction';
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER refuse_writes BEFORE UPDATE ON items FOR EACH ROW EXECUTE FUNCTION refuse_writes()`); err != nil {
		t.Fatal(err)
	}
	q := startSQLQueue(t, db, `UPDATE items SET done = true WHERE id = ANY($1) RETURNING id`, nil, "r1", "r2")
	var seen []string // last errors of the tasks while backing off
	waitUntil(t, "more tries than max_attempts", 60*time.Second, func() bool {
		for _, id := range []string{"r1", "r2"} {
			tk, ok := q.task(id)
			if !ok || tk.State == client.StateDead || tk.Attempts != 0 {
				t.Fatalf("task %s on a read-only database after %d tries: present %v, state %q, attempts %d, last error %q; want no attempt spent",
					id, q.calls.Load(), ok, tk.State, tk.Attempts, tk.LastError)
			}
			if tk.LastError != "" {
				seen = append(seen, tk.LastError)
			}
		}
		return q.calls.Load() > sqlTestMaxAttempts && len(seen) > 0
	})
	if !strings.Contains(seen[0], "read-only") {
		t.Errorf("last error %q, want the read-only transaction named", seen[0])
	}
	if _, err := db.Exec(`DELETE FROM read_only`); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the tasks done once the database is writable", 30*time.Second, func() bool {
		_, ok1 := q.task("r1")
		_, ok2 := q.task("r2")
		return !ok1 && !ok2
	})
	if got := strings.Join(doneRows(t, db), ","); got != "r1,r2" {
		t.Errorf("rows done: %s, want r1,r2", got)
	}
}

// Durable queues (the Executor around the sql action): a task held back by
// a locked row spends no attempt in PostgreSQL either (its row's attempts
// stay 0, its state SCHEDULED, never FAILED), and is EXECUTED once the lock
// goes; a poison task is FAILED after max_attempts while its batch-mate is
// EXECUTED. (Before, every try bumped the row's attempts and the locked
// task ended FAILED.)
func TestDurableSQLTaskTransientErrorsDoNotBumpAttempts(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db, "free", "locked", "poison")
	for _, id := range []string{"free", "locked", "poison"} {
		if _, err := db.Exec(`INSERT INTO orderdelay_tasks (queue, id, due_at, payload) VALUES ('q', $1, now(), '{}')`, id); err != nil {
			t.Fatal(err)
		}
	}
	release := holdRow(t, db, "locked")
	d := &Durable{DB: db, Queue: "q", Log: zaptest.NewLogger(t)}
	q := startSQLQueue(t, db, `UPDATE items SET done = true WHERE id = ANY($1) AND check_item(id) RETURNING id`,
		func(action consumer.ProcessFunc) consumer.ProcessFunc { return d.Executor(action, sqlTestMaxAttempts) },
		"free", "locked", "poison")
	row := func(id string) Row {
		t.Helper()
		var r Row
		if err := db.Get(&r, `SELECT id, due_at, payload, state, attempts, version FROM orderdelay_tasks WHERE queue = 'q' AND id = $1`, id); err != nil {
			t.Fatal(err)
		}
		return r
	}
	waitUntil(t, "more tries of the locked task than max_attempts", 60*time.Second, func() bool {
		if r := row("locked"); r.State != StateScheduled || r.Attempts != 0 {
			t.Fatalf("locked task's row after %d batches: state %s, attempts %d; want SCHEDULED with no attempt spent",
				q.calls.Load(), r.State, r.Attempts)
		}
		if tk, ok := q.task("locked"); !ok || tk.State == client.StateDead || tk.Attempts != 0 {
			t.Fatalf("locked task: present %v, state %q, attempts %d; want it waiting, no attempt spent", ok, tk.State, tk.Attempts)
		}
		return q.calls.Load() > sqlTestMaxAttempts+1
	})
	if p, f := row("poison"), row("free"); p.State != StateFailed || f.State != StateExecuted {
		t.Errorf("poison task %s, its batch-mate %s; want FAILED and EXECUTED", p.State, f.State)
	}
	release()
	waitUntil(t, "the locked task EXECUTED once the lock is gone", 30*time.Second, func() bool {
		return row("locked").State == StateExecuted
	})
	if r := row("locked"); r.Attempts != 0 {
		t.Errorf("locked task's row: attempts %d, want 0", r.Attempts)
	}
	var detail string
	if err := db.Get(&detail, `SELECT detail FROM orderdelay_task_log WHERE queue = 'q' AND task_id = 'poison' AND state = 'FAILED'`); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(detail, "poison task poison") {
		t.Errorf("poison task's FAILED log detail %q, want the RAISE named", detail)
	}
}
