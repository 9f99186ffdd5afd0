package orders_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The tests mostly wait (on PostgreSQL: most make a database of their own),
// so more of them run at once than there are cores.
func TestMain(m *testing.M) {
	testenv.SetDefaultParallel(4)
	os.Exit(m.Run())
}

func ctxT(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// order is a row of the reference orders table; expires is relative to now().
type order struct {
	serial  string
	status  string
	expires time.Duration
}

func insert(t *testing.T, db *sqlx.DB, rows ...order) {
	t.Helper()
	for _, r := range rows {
		_, err := db.Exec(`INSERT INTO orders (serial_no, status, expires_at, paid_at)
			VALUES ($1, $2, now() + $3::bigint * interval '1 millisecond',
			        CASE WHEN $2 = 'paid' THEN now() END)`,
			r.serial, r.status, r.expires.Milliseconds())
		if err != nil {
			t.Fatalf("insert %+v: %v", r, err)
		}
	}
}

func status(t *testing.T, db *sqlx.DB, serial string) string {
	t.Helper()
	var s string
	if err := db.Get(&s, `SELECT status FROM orders WHERE serial_no = $1`, serial); err != nil {
		t.Fatalf("status of %s: %v", serial, err)
	}
	return s
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

func TestMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	db, dsn := testenv.Postgres(t)
	// Start from an empty database: drop what the template brought.
	if _, err := db.Exec(`DROP TABLE orders, orderdelay_close_outbox, orderdelay_tasks, orderdelay_task_log, ` + orders.MigrationsTable); err != nil {
		t.Fatalf("empty the database: %v", err)
	}
	for i := range 2 {
		v, err := orders.Migrate(dsn)
		if err != nil {
			t.Fatalf("Migrate #%d: %v", i+1, err)
		}
		if v != orders.SchemaVersion {
			t.Errorf("Migrate #%d = version %d, want %d", i+1, v, orders.SchemaVersion)
		}
	}
	var n int
	if err := db.Get(&n, `SELECT count(*) FROM orders`); err != nil {
		t.Errorf("orders table after Migrate: %v", err)
	}
	var idx bool
	if err := db.Get(&idx, `SELECT EXISTS (SELECT 1 FROM pg_indexes WHERE tablename = 'orders' AND indexname = 'orders_pending_expires_at')`); err != nil || !idx {
		t.Errorf("partial index orders_pending_expires_at exists = %v (%v), want true", idx, err)
	}
}

func TestMigrateKeepsData(t *testing.T) {
	t.Parallel()
	db, dsn := testenv.Postgres(t)
	insert(t, db, order{"keep", "pending", time.Hour})
	if _, err := orders.Migrate(dsn); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	if got := status(t, db, "keep"); got != "pending" {
		t.Errorf("status after re-migrate = %q, want pending", got)
	}
}

func TestSchemaRejectsUnknownStatus(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	_, err := db.Exec(`INSERT INTO orders (serial_no, status, expires_at) VALUES ('x', 'cancelled', now())`)
	var pqErr *pq.Error
	if !errors.As(err, &pqErr) || pqErr.Code != "23514" {
		t.Errorf("insert with status cancelled: error = %v, want check violation 23514", err)
	}
}

func TestCloseClosesOnlyPending(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	insert(t, db,
		order{"p1", "pending", -time.Minute},
		order{"p2", "pending", -time.Second},
		order{"paid", "paid", -time.Minute},
		order{"closed", "closed", -time.Hour},
		order{"other", "pending", -time.Minute}, // not asked for
	)
	s := orders.NewStore(db, orders.Statements{})
	got, err := s.Close(ctx, []string{"p1", "p2", "paid", "closed", "missing"}, nil)
	if err != nil {
		t.Fatalf("Close: %v", err)
	}
	if want := []string{"p1", "p2"}; !slices.Equal(sorted(got), want) {
		t.Errorf("Close returned %v, want %v", got, want)
	}
	for serial, want := range map[string]string{"p1": "closed", "p2": "closed", "paid": "paid", "closed": "closed", "other": "pending"} {
		if got := status(t, db, serial); got != want {
			t.Errorf("status of %s = %q, want %q", serial, got, want)
		}
	}
	var reason string
	var closedAt sql.NullTime
	if err := db.QueryRow(`SELECT close_reason, closed_at FROM orders WHERE serial_no = 'p1'`).Scan(&reason, &closedAt); err != nil {
		t.Fatal(err)
	}
	if reason != "timeout" || !closedAt.Valid {
		t.Errorf("p1 close_reason = %q, closed_at valid = %v; want timeout, true", reason, closedAt.Valid)
	}

	// A second close of the same serials closes nothing.
	got, err = s.Close(ctx, []string{"p1", "p2", "paid", "closed", "missing"}, nil)
	if err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if len(got) != 0 {
		t.Errorf("second Close returned %v, want nothing", got)
	}
}

func TestCloseEmptyInput(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	insert(t, db, order{"p1", "pending", -time.Minute})
	s := orders.NewStore(db, orders.Statements{})
	for _, in := range [][]string{nil, {}} {
		got, err := s.Close(ctxT(t), in, nil)
		if err != nil || len(got) != 0 {
			t.Errorf("Close(%#v) = %v, %v; want nothing, nil", in, got, err)
		}
	}
	if got := status(t, db, "p1"); got != "pending" {
		t.Errorf("status of p1 = %q, want pending", got)
	}
}

// TestClosePaidWhileWaiting: a payment that commits while the close waits
// for the row's lock wins; the close re-checks and leaves the order alone.
func TestClosePaidWhileWaiting(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	insert(t, db, order{"race", "pending", -time.Minute})
	s := orders.NewStore(db, orders.Statements{})

	pay, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pay.Rollback() }) //nolint:errcheck
	if _, err := pay.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = 'race'`); err != nil {
		t.Fatal(err)
	}
	var payPID int
	if err := pay.Get(&payPID, `SELECT pg_backend_pid()`); err != nil {
		t.Fatal(err)
	}

	type result struct {
		closed []string
		err    error
	}
	done := make(chan result, 1)
	go func() {
		got, err := s.Close(ctx, []string{"race"}, nil)
		done <- result{got, err}
	}()
	waitBlockedBy(t, db, payPID)
	if err := pay.Commit(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("Close: %v", r.err)
	}
	if len(r.closed) != 0 {
		t.Errorf("Close returned %v for an order paid meanwhile, want nothing", r.closed)
	}
	if got := status(t, db, "race"); got != "paid" {
		t.Errorf("status = %q, want paid", got)
	}
}

// waitBlockedBy waits until some backend is waiting for a lock held by pid.
func waitBlockedBy(t *testing.T, db *sqlx.DB, pid int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		var n int
		if err := db.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, pid); err != nil {
			t.Fatalf("pg_blocking_pids: %v", err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no backend blocked by pid %d within 20s", pid)
		}
		time.Sleep(5 * time.Millisecond) // polling an observed condition, not guessing
	}
}

func TestLookupReturnsExistingOnlyAndWhetherPending(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	insert(t, db,
		order{"pending", "pending", time.Hour},
		order{"paid", "paid", -time.Hour},
		order{"closed", "closed", -time.Hour},
	)
	s := orders.NewStore(db, orders.Statements{})
	got, err := s.Lookup(ctxT(t), []string{"pending", "paid", "closed", "missing", "1' OR '1'='1"})
	if err != nil {
		t.Fatalf("Lookup: %v", err)
	}
	slices.SortFunc(got, func(a, b orders.Found) int { return strings.Compare(a.Serial, b.Serial) })
	want := []orders.Found{{Serial: "closed"}, {Serial: "paid"}, {Serial: "pending", Pending: true}}
	if !slices.Equal(got, want) {
		t.Errorf("Lookup = %v, want %v", got, want)
	}
}

// A close whose fence drops a serial is rolled back and redone without it:
// the dropped serial stays pending, the others close.
func TestCloseFenceDropsAreNeverCommitted(t *testing.T) {
	t.Parallel()
	for _, path := range closePaths {
		t.Run(path.name, func(t *testing.T) {
			db, _ := testenv.Postgres(t)
			insert(t, db, order{"keep", "pending", -time.Hour}, order{"drop", "pending", -time.Hour})
			s := orders.NewStore(db, orders.Statements{})
			calls := 0
			got, err := path.close(ctxT(t), s, []string{"keep", "drop"}, func(_ context.Context, closed []string) ([]string, error) {
				calls++
				if slices.Contains(closed, "drop") {
					return []string{"drop"}, nil
				}
				return nil, nil
			})
			if err != nil || !slices.Equal(got, []string{"keep"}) {
				t.Fatalf("Close = %v, %v; want [keep]", got, err)
			}
			if calls != 2 {
				t.Errorf("fence called %d times, want 2 (once per attempt)", calls)
			}
			if st := status(t, db, "drop"); st != "pending" {
				t.Errorf("dropped serial is %s, want pending", st)
			}
			// A fence that cannot answer commits nothing.
			insert(t, db, order{"unsure", "pending", -time.Hour})
			_, err = path.close(ctxT(t), s, []string{"unsure"}, func(context.Context, []string) ([]string, error) {
				return nil, errors.New("redis: connection refused")
			})
			var fe *orders.FenceError
			if !errors.As(err, &fe) {
				t.Fatalf("Close with a failing fence = %v, want a *FenceError", err)
			}
			if st := status(t, db, "unsure"); st != "pending" {
				t.Errorf("closed without an answer from the fence: %s", st)
			}
		})
	}
}

// With SetTimeouts a close that waits on a row lock is cut by the server
// (55P03), not by the client, so nothing is left in doubt.
func TestCloseTimeoutsAreTheServers(t *testing.T) {
	t.Parallel()
	for _, path := range closePaths {
		t.Run(path.name, func(t *testing.T) {
			db, _ := testenv.Postgres(t)
			insert(t, db, order{"held", "pending", -time.Hour})
			tx, err := db.Begin()
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			if _, err := tx.Exec(`SELECT 1 FROM orders WHERE serial_no = 'held' FOR UPDATE`); err != nil {
				t.Fatal(err)
			}
			s := orders.NewStore(db, orders.Statements{})
			s.SetTimeouts(5*time.Second, 50*time.Millisecond)
			_, err = path.close(ctxT(t), s, []string{"held"}, nil)
			var pqErr *pq.Error
			if !errors.As(err, &pqErr) || pqErr.Code != "55P03" {
				t.Fatalf("close of a locked row = %v, want the server's 55P03", err)
			}
		})
	}
}

func TestVerify(t *testing.T) {
	t.Parallel()
	const (
		closeSetting   = "ORDERDELAY_CLOSE_SQL"
		lookupSetting  = "ORDERDELAY_LOOKUP_SQL"
		overdueSetting = "ORDERDELAY_OVERDUE_SQL"
	)
	tests := []struct {
		name        string
		stmts       orders.Statements
		wantSetting string // empty: Verify accepts
		wantText    string
	}{
		{"defaults", orders.Statements{}, "", ""},
		{"explicit defaults", orders.DefaultStatements(), "", ""},
		{"varchar result is text enough", orders.Statements{Lookup: `SELECT serial_no::varchar, true FROM orders WHERE serial_no = ANY($1)`}, "", ""},
		{"lookup without the pending column", orders.Statements{Lookup: `SELECT serial_no FROM orders WHERE serial_no = ANY($1)`}, lookupSetting, "whether the order is still pending"},
		{"lookup pending is text", orders.Statements{Lookup: `SELECT serial_no, status FROM orders WHERE serial_no = ANY($1)`}, lookupSetting, "want bool"},
		{"close syntax error", orders.Statements{Close: `UPDATE orders SET WHERE`}, closeSetting, "does not prepare"},
		{"lookup syntax error", orders.Statements{Lookup: `SELEC serial_no FROM orders`}, lookupSetting, "does not prepare"},
		{"unknown table", orders.Statements{Lookup: `SELECT serial_no FROM no_such_table WHERE serial_no = ANY($1)`}, lookupSetting, "does not prepare"},
		{"close takes int[]", orders.Statements{Close: `UPDATE orders SET status = 'closed' WHERE length(serial_no) = ANY($1::int[]) RETURNING serial_no`}, closeSetting, "parameters"},
		{"lookup takes text not text[]", orders.Statements{Lookup: `SELECT serial_no FROM orders WHERE serial_no = $1`}, lookupSetting, "parameters"},
		{"lookup takes two parameters", orders.Statements{Lookup: `SELECT serial_no FROM orders WHERE serial_no = ANY($1) AND status = $2`}, lookupSetting, "parameters"},
		{"overdue takes int", orders.Statements{Overdue: `SELECT serial_no, expires_at FROM orders WHERE expires_at < now() - $1::int * interval '1 ms' AND (expires_at, serial_no) > ($3::timestamptz, $4::text) LIMIT $2::bigint`}, overdueSetting, "parameters"},
		// The contract before keyset paging: refused at start, saying what is expected.
		{"overdue without a cursor (old contract)", orders.Statements{Overdue: `SELECT serial_no FROM orders
WHERE status = 'pending' AND expires_at < now() - $1::bigint * interval '1 millisecond'
ORDER BY expires_at LIMIT $2::bigint FOR UPDATE SKIP LOCKED`}, overdueSetting, "takes parameters (bigint, bigint), want (bigint, bigint, timestamp with time zone, text); the overdue statement pages by keyset: it takes $1 bigint grace ms, $2 bigint limit, $3 timestamptz and $4 text"},
		{"overdue with a cursor but no deadline column", orders.Statements{Overdue: `SELECT serial_no FROM orders
WHERE status = 'pending' AND expires_at < now() - $1::bigint * interval '1 millisecond'
  AND (expires_at, serial_no) > ($3::timestamptz, $4::text)
ORDER BY expires_at, serial_no LIMIT $2::bigint FOR UPDATE SKIP LOCKED`}, overdueSetting, "returns 1 columns, want 2 (the serial, the deadline); the overdue statement pages by keyset"},
		{"overdue deadline as timestamp without time zone", orders.Statements{Overdue: `SELECT serial_no, expires_at::timestamp FROM orders
WHERE (expires_at, serial_no) > ($3::timestamptz, $4::text) AND $1::bigint > 0 LIMIT $2::bigint`}, overdueSetting, "returns the deadline (column 2) of type TIMESTAMP, want timestamptz"},
		{"overdue deadline first", orders.Statements{Overdue: `SELECT expires_at, serial_no FROM orders
WHERE (expires_at, serial_no) > ($3::timestamptz, $4::text) AND $1::bigint > 0 LIMIT $2::bigint`}, overdueSetting, "returns the serial (column 1) of type TIMESTAMPTZ, want text"},
		{"close returns two columns", orders.Statements{Close: `UPDATE orders SET status = 'closed' WHERE serial_no = ANY($1) RETURNING serial_no, status`}, closeSetting, "2 columns"},
		{"close returns nothing", orders.Statements{Close: `UPDATE orders SET status = 'closed' WHERE serial_no = ANY($1)`}, closeSetting, "0 columns"},
		{"lookup returns an integer", orders.Statements{Lookup: `SELECT length(serial_no), true FROM orders WHERE serial_no = ANY($1)`}, lookupSetting, "type INT4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			db, _ := testenv.Postgres(t)
			err := orders.NewStore(db, tt.stmts).Verify(ctxT(t))
			if tt.wantSetting == "" {
				if err != nil {
					t.Fatalf("Verify = %v, want nil", err)
				}
				return
			}
			var se *orders.StatementError
			if !errors.As(err, &se) {
				t.Fatalf("Verify = %v (%T), want a *StatementError", err, err)
			}
			if se.Setting != tt.wantSetting {
				t.Errorf("StatementError.Setting = %q, want %q", se.Setting, tt.wantSetting)
			}
			if !strings.Contains(err.Error(), tt.wantSetting) || !strings.Contains(err.Error(), tt.wantText) {
				t.Errorf("Verify error = %q, want it to name %s and say %q", err, tt.wantSetting, tt.wantText)
			}
		})
	}
}

// TestVerifyChangesNoData: Verify runs the statements, so a statement that
// writes regardless of its input must still leave the data as it was.
func TestVerifyChangesNoData(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	insert(t, db, order{"a", "pending", -time.Hour}, order{"b", "pending", -time.Hour})
	s := orders.NewStore(db, orders.Statements{
		Close:   `UPDATE orders SET status = 'closed' WHERE status = 'pending' OR serial_no = ANY($1) RETURNING serial_no`,
		Lookup:  `DELETE FROM orders WHERE serial_no = 'b' OR serial_no = ANY($1) RETURNING serial_no, true`,
		Overdue: `UPDATE orders SET status = 'paid' WHERE $1::bigint > 0 OR $2::bigint > 0 OR expires_at > $3::timestamptz OR serial_no > $4::text RETURNING serial_no, expires_at`,
	})
	if err := s.Verify(ctxT(t)); err != nil {
		t.Fatalf("Verify: %v", err)
	}
	for _, serial := range []string{"a", "b"} {
		if got := status(t, db, serial); got != "pending" {
			t.Errorf("status of %s after Verify = %q, want pending", serial, got)
		}
	}
}

func TestOverdue(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	insert(t, db,
		order{"d10", "pending", -10 * time.Minute},
		order{"d20", "pending", -20 * time.Minute},
		order{"d7", "pending", -7 * time.Minute},
		order{"within-grace", "pending", -time.Minute},
		order{"future", "pending", time.Hour},
		order{"paid", "paid", -30 * time.Minute},
		order{"closed", "closed", -15 * time.Minute},
	)
	s := orders.NewStore(db, orders.Statements{})
	grace := (5 * time.Minute).Milliseconds()
	tests := []struct {
		limit int64
		want  []string
	}{
		{100, []string{"d20", "d10", "d7"}},
		{3, []string{"d20", "d10", "d7"}},
		{2, []string{"d20", "d10"}},
		{1, []string{"d20"}},
		{0, []string{}},
	}
	for _, tt := range tests {
		t.Run("limit "+strconv.FormatInt(tt.limit, 10), func(t *testing.T) {
			ctx := ctxT(t)
			tx, err := db.BeginTxx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback() //nolint:errcheck
			rows, err := s.Overdue(ctx, tx, grace, tt.limit, orders.Cursor{})
			got := serialsOf(rows)
			if err != nil {
				t.Fatalf("Overdue: %v", err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("Overdue(grace 5m, limit %d) = %v, want %v (deadline order)", tt.limit, got, tt.want)
			}
		})
	}
}

func serialsOf(rows []orders.OverdueOrder) []string {
	out := make([]string, len(rows))
	for i, r := range rows {
		out[i] = r.Serial
	}
	return out
}

// TestOverduePagesByKeyset: each page starts after the last row of the one
// before, in (deadline, serial) order, so orders that share a deadline are
// neither repeated nor skipped at a page boundary, and a page of rows the
// caller leaves alone does not hide the rows behind it.
func TestOverduePagesByKeyset(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	// Seven orders share one deadline to the microsecond; two are older, two
	// newer, one within the grace, one paid.
	if _, err := db.Exec(`INSERT INTO orders (serial_no, expires_at)
		SELECT s, date_trunc('second', now()) - interval '1 hour'
		FROM unnest(ARRAY['t4','t1','t7','t3','t6','t2','t5']) s`); err != nil {
		t.Fatal(err)
	}
	insert(t, db,
		order{"old-b", "pending", -3 * time.Hour},
		order{"old-a", "pending", -2 * time.Hour},
		order{"new-1", "pending", -30 * time.Minute},
		order{"new-2", "pending", -20 * time.Minute},
		order{"recent", "pending", -time.Minute},
		order{"paid", "paid", -90 * time.Minute},
	)
	s := orders.NewStore(db, orders.Statements{})
	want := []string{"old-b", "old-a", "t1", "t2", "t3", "t4", "t5", "t6", "t7", "new-1", "new-2"}
	for _, size := range []int64{1, 2, 3, 4, 100} {
		t.Run("page "+strconv.FormatInt(size, 10), func(t *testing.T) {
			var got []string
			var cur orders.Cursor
			for page := 0; ; page++ {
				if page > len(want) {
					t.Fatalf("no end after %d pages: %v", page, got)
				}
				tx, err := db.BeginTxx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				rows, err := s.Overdue(ctx, tx, (5 * time.Minute).Milliseconds(), size, cur)
				tx.Rollback() //nolint:errcheck
				if err != nil {
					t.Fatalf("Overdue after %+v: %v", cur, err)
				}
				got = append(got, serialsOf(rows)...)
				if int64(len(rows)) < size {
					break
				}
				last := rows[len(rows)-1]
				cur = orders.Cursor{ExpiresAt: last.ExpiresAt, Serial: last.Serial}
			}
			if !slices.Equal(got, want) {
				t.Errorf("pages of %d gave %v, want %v", size, got, want)
			}
		})
	}
}

// TestOverdueUsesThePendingIndex: the keyset condition must not cost the
// reconciler the partial index on pending expires_at (a table scan every
// page on a table of millions of orders).
func TestOverdueUsesThePendingIndex(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	// A small table would be scanned anyway; forbid that to see whether the
	// index can serve the statement at all.
	if _, err := tx.Exec(`SET LOCAL enable_seqscan = off`); err != nil {
		t.Fatal(err)
	}
	rows, err := tx.Query(`EXPLAIN `+orders.DefaultOverdueSQL, int64(300000), int64(500), "2026-01-01T00:00:00Z", "s-1")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var plan strings.Builder
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		plan.WriteString(line + "\n")
	}
	if !strings.Contains(plan.String(), "orders_pending_expires_at") || !strings.Contains(plan.String(), "Index Cond") {
		t.Errorf("the overdue statement does not use orders_pending_expires_at with an index condition:\n%s", plan.String())
	}
}

func TestOverdueSkipsLockedRows(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	insert(t, db,
		order{"d30", "pending", -30 * time.Minute},
		order{"d20", "pending", -20 * time.Minute},
		order{"d10", "pending", -10 * time.Minute},
	)
	s := orders.NewStore(db, orders.Statements{})
	begin := func() *sqlx.Tx {
		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tx.Rollback() }) //nolint:errcheck
		return tx
	}
	grace := (5 * time.Minute).Milliseconds()

	// A: the reconciler on another replica takes the oldest page of one.
	a := begin()
	rowsA, err := s.Overdue(ctx, a, grace, 1, orders.Cursor{})
	gotA := serialsOf(rowsA)
	if err != nil {
		t.Fatalf("Overdue in A: %v", err)
	}
	if want := []string{"d30"}; !slices.Equal(gotA, want) {
		t.Fatalf("Overdue in A = %v, want %v", gotA, want)
	}
	// Someone else's payment holds d10.
	pay := begin()
	if _, err := pay.Exec(`SELECT 1 FROM orders WHERE serial_no = 'd10' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	// B does not wait for either; it gets what is free.
	b := begin()
	rowsB, err := s.Overdue(ctx, b, grace, 10, orders.Cursor{})
	gotB := serialsOf(rowsB)
	if err != nil {
		t.Fatalf("Overdue in B: %v", err)
	}
	if want := []string{"d20"}; !slices.Equal(gotB, want) {
		t.Errorf("Overdue in B = %v, want %v (locked rows skipped)", gotB, want)
	}
}

// TestReconcilerPass is what the reconciler does in one transaction: find
// overdue orders and close them, on the same transaction.
func TestReconcilerPass(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	insert(t, db, order{"old", "pending", -time.Hour}, order{"new", "pending", -time.Second})
	s := orders.NewStore(db, orders.Statements{})
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	rows, err := s.Overdue(ctx, tx, time.Minute.Milliseconds(), 100, orders.Cursor{})
	if err != nil {
		t.Fatal(err)
	}
	closed, err := s.CloseOn(ctx, tx, serialsOf(rows))
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if want := []string{"old"}; !slices.Equal(closed, want) {
		t.Errorf("closed %v, want %v", closed, want)
	}
	if got := status(t, db, "new"); got != "pending" {
		t.Errorf("status of new = %q, want pending", got)
	}
}

func TestStatementResultNULL(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	s := orders.NewStore(db, orders.Statements{Lookup: `SELECT NULL::text, true FROM unnest($1::text[])`})
	_, err := s.Lookup(ctxT(t), []string{"a"})
	if !errors.Is(err, orders.ErrBadResult) {
		t.Errorf("Lookup returning NULL: error = %v, want ErrBadResult", err)
	}
}

func TestTransientRealErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		err       func(t *testing.T) error
		transient bool
	}{
		{"statement timeout (57014)", statementTimeout, true},
		{"unique violation (23505)", uniqueViolation, false},
		{"invalid text representation (22P02)", func(t *testing.T) error {
			db, _ := testenv.Postgres(t)
			_, err := db.Exec(`SELECT 'x'::int`)
			return err
		}, false},
		{"connection refused", connectionRefused, true},
		{"context deadline", contextDeadline, true},
		{"connection terminated by the server", terminatedConnection, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := tt.err(t)
			if err == nil {
				t.Fatalf("the setup produced no error")
			}
			if got := orders.Transient(err); got != tt.transient {
				t.Errorf("Transient(%v [%T]) = %v, want %v", err, err, got, tt.transient)
			}
			// Wrapping, as callers do, changes nothing.
			if got := orders.Transient(fmt.Errorf("close batch: %w", err)); got != tt.transient {
				t.Errorf("Transient(wrapped %v) = %v, want %v", err, got, tt.transient)
			}
		})
	}
}

func statementTimeout(t *testing.T) error {
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	if _, err := tx.Exec(`SET LOCAL statement_timeout = '50ms'`); err != nil {
		t.Fatal(err)
	}
	_, err = tx.Exec(`SELECT pg_sleep(10)`)
	var pqErr *pq.Error
	if !errors.As(err, &pqErr) || pqErr.Code != "57014" {
		t.Fatalf("pg_sleep under statement_timeout: error = %v, want 57014", err)
	}
	return err
}

func uniqueViolation(t *testing.T) error {
	db, _ := testenv.Postgres(t)
	insert(t, db, order{"dup", "pending", time.Hour})
	_, err := db.Exec(`INSERT INTO orders (serial_no, expires_at) VALUES ('dup', now())`)
	var pqErr *pq.Error
	if !errors.As(err, &pqErr) || pqErr.Code != "23505" {
		t.Fatalf("duplicate insert: error = %v, want 23505", err)
	}
	return err
}

func connectionRefused(t *testing.T) error {
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	db, err := sqlx.Open("postgres", fmt.Sprintf("postgres://postgres@127.0.0.1:%d/x?sslmode=disable&connect_timeout=5", port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db.PingContext(ctxT(t))
}

// contextDeadline: the caller's deadline has passed. (A deadline that
// expires during a pg_sleep relies on lib/pq's cancel request arriving in
// time, which a busy machine does not promise.)
func contextDeadline(t *testing.T) error {
	db, _ := testenv.Postgres(t)
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Millisecond))
	defer cancel()
	_, err := db.ExecContext(ctx, `SELECT 1`)
	return err
}

// terminatedConnection: an administrator (or a failover) kills the backend
// in the middle of a transaction.
func terminatedConnection(t *testing.T) error {
	conn := terminatedConn(t)
	_, err := conn.ExecContext(ctxT(t), `SELECT 1`)
	return err
}

// terminatedConn returns a connection whose backend has been terminated.
func terminatedConn(t *testing.T) *sqlx.Conn {
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	conn, err := db.Connx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	var pid int
	if err := conn.GetContext(ctx, &pid, `SELECT pg_backend_pid()`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	return conn
}

func TestTransientClassification(t *testing.T) {
	t.Parallel()
	tests := []struct {
		err       error
		transient bool
	}{
		{nil, false},
		{errors.New("something else"), false},
		{&pq.Error{Code: "40001"}, true},  // serialization failure
		{&pq.Error{Code: "40P01"}, true},  // deadlock
		{&pq.Error{Code: "57014"}, true},  // statement timeout / cancel
		{&pq.Error{Code: "57P01"}, true},  // admin shutdown
		{&pq.Error{Code: "53300"}, true},  // too many connections
		{&pq.Error{Code: "08006"}, true},  // connection failure
		{&pq.Error{Code: "22P02"}, false}, // invalid text representation
		{&pq.Error{Code: "23505"}, false}, // unique violation
		{&pq.Error{Code: "42P01"}, true},  // undefined table in the statement: the same for every order
		{&pq.Error{Code: "42P01", Where: "PL/pgSQL function f() line 2 at EXECUTE"}, false}, // in a trigger: may be the row
		{&pq.Error{Code: "23514"}, false},                                  // check violation
		{&pq.Error{Code: "0A000", Routine: "RevalidateCachedQuery"}, true}, // cached plan must not change result type
		{&pq.Error{Code: "0A000"}, false},                                  // another feature not supported
		{&pq.Error{Code: "26000"}, true},                                   // prepared statement does not exist (a pooler)
		{fmt.Errorf("batch: %w", &pq.Error{Code: "40P01"}), true},
		{fmt.Errorf("batch: %w", &pq.Error{Code: "22P02"}), false},
		{context.DeadlineExceeded, true},
		{context.Canceled, true},
		{fmt.Errorf("close: %w", context.DeadlineExceeded), true},
	}
	for _, tt := range tests {
		name := "nil"
		if tt.err != nil {
			name = tt.err.Error()
			var pqErr *pq.Error
			if errors.As(tt.err, &pqErr) {
				name += " " + string(pqErr.Code)
			}
		}
		t.Run(name, func(t *testing.T) {
			if got := orders.Transient(tt.err); got != tt.transient {
				t.Errorf("Transient(%v) = %v, want %v", tt.err, got, tt.transient)
			}
		})
	}
}

// SchemaVersion must be the number of the newest embedded migration, or the
// start-up schema check warns on an up-to-date database.
func TestSchemaVersionMatchesMigrations(t *testing.T) {
	t.Parallel()
	entries, err := fs.ReadDir(orders.MigrationFiles(), ".")
	if err != nil {
		t.Fatal(err)
	}
	newest := 0
	for _, e := range entries {
		var n int
		if _, err := fmt.Sscanf(e.Name(), "%d_", &n); err == nil && n > newest {
			newest = n
		}
	}
	if newest != orders.SchemaVersion {
		t.Fatalf("newest migration is %d, orders.SchemaVersion is %d", newest, orders.SchemaVersion)
	}
}

// The server commits a close, its answer is lost, and the server stays out
// of reach for longer than the store asks what became of the transaction:
// nobody can say whether the orders closed. The close fails (retried as
// after an outage: transient), and says how many orders are in doubt, so
// the daemon can count them apart from the closes it confirmed.
func TestCloseWhoseCommitCannotBeConfirmedIsInDoubt(t *testing.T) {
	t.Parallel()
	for _, path := range closePaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			db, viaProxy, _, px := testenv.PostgresViaProxy(t)
			insert(t, db, order{"unheard-1", "pending", -time.Hour}, order{"unheard-2", "pending", -time.Hour})
			s := orders.NewStore(viaProxy, orders.Statements{})
			s.SetCommitStatusWait(300 * time.Millisecond)
			landed := make(chan struct{})
			got, err := path.close(ctxT(t), s, []string{"unheard-1", "unheard-2"}, func(context.Context, []string) ([]string, error) {
				// Right before COMMIT: hold the server's answers back; once the
				// server has committed, cut the proxy and keep it down.
				px.Stall(time.Minute)
				go func() {
					defer close(landed)
					defer px.Down()
					for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
						var st string
						if db.Get(&st, "SELECT status FROM orders WHERE serial_no = 'unheard-2'") == nil && st == "closed" {
							return
						}
					}
				}()
				return nil, nil
			})
			<-landed
			if st := status(t, db, "unheard-1"); st != "closed" {
				t.Fatalf("the server did not commit (%s): the test proved nothing", st)
			}
			if err == nil || len(got) != 0 {
				t.Fatalf("Close = %v, %v; want an error: nobody could confirm the commit", got, err)
			}
			if n := orders.InDoubt(err); n != 2 {
				t.Errorf("InDoubt(%v) = %d, want 2: the close's two orders may have closed", err, n)
			}
			if !orders.Transient(err) {
				t.Errorf("Close error %v is not transient: the orders must be retried, not buried", err)
			}
		})
	}
}

// Issue 11 item 9: the server commits a close but its answer is lost (the
// connection drops while the answer is on its way). The close must still be reported as
// closed — the store asks the server what became of the transaction —
// rather than failing and being counted as "settled" on its retry.
func TestCloseWhoseCommitAnswerIsLostIsStillReported(t *testing.T) {
	t.Parallel()
	for _, path := range closePaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			db, viaProxy, _, px := testenv.PostgresViaProxy(t)
			insert(t, db, order{"unheard", "pending", -time.Hour})
			s := orders.NewStore(viaProxy, orders.Statements{})
			got, err := path.close(ctxT(t), s, []string{"unheard"}, func(context.Context, []string) ([]string, error) {
				// Right before COMMIT: hold the server's answers back; once the
				// server has committed, cut the connection they travel on.
				px.Stall(3 * time.Second)
				go func() {
					// The cut loses the held answer; ending the stall with
					// it lets the store's question about the transaction
					// through at once, not when the 3 s run out.
					defer func() { px.Down(); px.Stall(0); px.Up() }()
					for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
						var st string
						if db.Get(&st, "SELECT status FROM orders WHERE serial_no = 'unheard'") == nil && st == "closed" {
							return
						}
					}
				}()
				return nil, nil
			})
			if st := status(t, db, "unheard"); st != "closed" {
				t.Fatalf("the server did not commit (%s): the test proved nothing", st)
			}
			if err != nil || !slices.Equal(got, []string{"unheard"}) {
				t.Fatalf("Close = %v, %v; want [unheard]: the commit landed, only its answer was lost", got, err)
			}
		})
	}
}
