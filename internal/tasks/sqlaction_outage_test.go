package tasks

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// PostgreSQL unreachable (connections cut and refused, through a proxy the
// test owns) while sql tasks fall due: no task spends an attempt, in Redis
// or, on a durable queue, in its row (the executor's own state check fails
// first there); all are done once it is back.
func TestSQLTaskDatabaseOutageSpendsNoAttempts(t *testing.T) {
	t.Parallel()
	for _, durable := range []bool{false, true} {
		name := "plain"
		if durable {
			name = "durable"
		}
		t.Run(name, func(t *testing.T) {
			direct, dsn := testenv.Postgres(t)
			ids := []string{"o1", "o2", "o3"}
			sqlFixture(t, direct, ids...)
			for _, id := range ids {
				if _, err := direct.Exec(`INSERT INTO orderdelay_tasks (queue, id, due_at, payload) VALUES ('q', $1, now(), '{}')`, id); err != nil {
					t.Fatal(err)
				}
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
			proxy.Down()
			var wrap func(consumer.ProcessFunc) consumer.ProcessFunc
			if durable {
				d := &Durable{DB: db, Queue: "q", Log: zaptest.NewLogger(t)}
				wrap = func(action consumer.ProcessFunc) consumer.ProcessFunc { return d.Executor(action, sqlTestMaxAttempts) }
			}
			q := startSQLQueue(t, db, `UPDATE items SET done = true WHERE id = ANY($1) RETURNING id`, wrap, ids...)
			var seen string
			waitUntil(t, "more tries than max_attempts", 60*time.Second, func() bool {
				for _, id := range ids {
					tk, ok := q.task(id)
					if !ok || tk.State == client.StateDead || tk.Attempts != 0 {
						t.Fatalf("task %s with the database down, after %d tries: present %v, state %q, attempts %d, last error %q; want no attempt spent",
							id, q.calls.Load(), ok, tk.State, tk.Attempts, tk.LastError)
					}
					if tk.LastError != "" {
						seen = tk.LastError
					}
				}
				return q.calls.Load() > sqlTestMaxAttempts && seen != ""
			})
			t.Logf("last error while down: %s", seen)
			proxy.Up()
			waitUntil(t, "every task done once the database is back", 60*time.Second, func() bool {
				for _, id := range ids {
					if _, ok := q.task(id); ok {
						return false
					}
				}
				return true
			})
			if got := strings.Join(doneRows(t, direct), ","); got != "o1,o2,o3" {
				t.Errorf("rows done: %s, want o1,o2,o3", got)
			}
			if durable {
				var bad int
				if err := direct.Get(&bad, `SELECT count(*) FROM orderdelay_tasks WHERE queue = 'q' AND (state <> 'EXECUTED' OR attempts <> 0)`); err != nil {
					t.Fatal(err)
				}
				if bad != 0 {
					t.Errorf("%d durable rows not EXECUTED with 0 attempts", bad)
				}
			}
		})
	}
}

// A batch holding both a poison task and a locked row, whichever the
// statement meets first: the poison task alone spends an attempt, the
// locked one is retried later without one, the rest are done.
func TestSQLActionPoisonAndLockedRowInOneBatch(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	for _, order := range [][]string{
		{"a", "poison1", "locked1", "b"},
		{"c", "locked2", "poison2", "d"},
	} {
		sqlFixture2(t, db, order...)
	}
	holdRow(t, db, "locked1")
	holdRow(t, db, "locked2")
	for _, order := range [][]string{
		{"a", "poison1", "locked1", "b"},
		{"c", "locked2", "poison2", "d"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second) // lock_timeout 0.5 s
		errs := sqlAction(db, `UPDATE items SET done = true WHERE id = ANY($1) AND check_item(id) RETURNING id`)(ctx, tasksOf(order...))
		cancel()
		got := make([]string, len(errs))
		for i, err := range errs {
			got[i] = outcome(err)
		}
		want := "done attempt later done"
		if order[1] == "locked2" {
			want = "done later attempt done"
		}
		if strings.Join(got, " ") != want {
			t.Errorf("batch %v: outcomes %v (errors %v), want %s", order, got, errs, want)
		}
	}
}

// sqlFixture2 adds rows to the fixture, creating it the first time.
func sqlFixture2(t *testing.T, db *sqlx.DB, ids ...string) {
	t.Helper()
	var exists bool
	if err := db.Get(&exists, `SELECT to_regclass('items') IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
	if !exists {
		sqlFixture(t, db, ids...)
		return
	}
	for _, id := range ids {
		if _, err := db.Exec(`INSERT INTO items (id) VALUES ($1)`, id); err != nil {
			t.Fatal(err)
		}
	}
}
