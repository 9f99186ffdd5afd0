package orders_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// oneConn is a test database whose pool holds one connection, so every
// statement of the store and of the test runs in the same session and
// pg_prepared_statements shows what the store prepared there.
func oneConn(t *testing.T) *sqlx.DB {
	t.Helper()
	db, _ := testenv.Postgres(t)
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	return db
}

// preparedCounts returns, for each query, how often it is prepared in the
// pool's session (pg_prepared_statements) and how often it ran there
// (generic and custom plans), as "prepared/ran". Queried with the simple
// protocol (no parameters), so the check prepares nothing itself.
func preparedCounts(t *testing.T, db *sqlx.DB, queries ...string) []string {
	t.Helper()
	rows, err := db.Query(`SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	n, ran := map[string]int{}, map[string]int64{}
	for rows.Next() {
		var q string
		var r int64
		if err := rows.Scan(&q, &r); err != nil {
			t.Fatal(err)
		}
		n[q]++
		ran[q] += r
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	out := make([]string, len(queries))
	for i, q := range queries {
		out[i] = fmt.Sprintf("%d/%d", n[q], ran[q])
	}
	return out
}

func pendingOrders(t *testing.T, db *sqlx.DB, prefix string, n int) []string {
	t.Helper()
	ss := make([]string, n)
	for i := range ss {
		ss[i] = fmt.Sprintf("%s-%03d", prefix, i)
	}
	if _, err := db.Exec(`INSERT INTO orders (serial_no, status, expires_at)
		SELECT s, 'pending', now() - interval '1 minute' FROM unnest($1::text[]) s`, orders.TextArrayForTest(ss)); err != nil {
		t.Fatal(err)
	}
	return ss
}

// The statements a batch runs are prepared once per connection and then
// only bound and executed: one Parse per session, not one per batch (the
// round trip of Parse/Describe and the planning of a fresh statement are
// saved on every later batch).
func TestBatchStatementsArePreparedOncePerConnection(t *testing.T) {
	t.Parallel()
	const batches = 8
	ctx := ctxT(t)
	custom := orders.DefaultLookupSQL + " "
	for _, p := range []struct {
		name    string
		stmts   orders.Statements
		queries []string // the statements a batch runs, each prepared once
	}{
		{"one statement", orders.Statements{}, []string{orders.ShapedSettleSQL, orders.ShapeLookup(orders.DefaultLookupSQL)}},
		{"close statement", orders.Statements{Lookup: custom}, []string{orders.ShapeClose(orders.DefaultCloseSQL), orders.TxRefSQL, orders.ShapeLookup(custom)}},
	} {
		t.Run(p.name, func(t *testing.T) {
			db := oneConn(t)
			s := orders.NewStore(db, p.stmts)
			for i := range batches {
				serials := pendingOrders(t, db, fmt.Sprintf("b%d", i), 5)
				out, err := s.Settle(ctx, append(serials, "no-row"), nil)
				if err != nil || len(out.Closed) != 5 {
					t.Fatalf("batch %d: %+v, %v", i, out, err)
				}
				if _, err := s.Lookup(ctx, out.Unknown); err != nil {
					t.Fatalf("lookup %d: %v", i, err)
				}
			}
			got := preparedCounts(t, db, p.queries...)
			want := make([]string, len(p.queries))
			for i := range want {
				want[i] = fmt.Sprintf("1/%d", batches)
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("the batch's statements prepared/ran in the session: %v, want %v", got, want)
			}
		})
	}
}

// prepPaths are the two ways a batch runs its statements: the one
// statement of the reference schema, and the close statement alone with
// its transaction-id query (a custom lookup statement).
var prepPaths = []struct {
	name     string
	stmts    orders.Statements
	prepared int // statements a connection has prepared once it ran a batch
}{
	{"one statement", orders.Statements{}, 2},
	{"close statement", orders.Statements{Lookup: orders.DefaultLookupSQL + " "}, 3},
}

// ours counts the store's statements prepared in db's session.
func ours(t *testing.T, db *sqlx.DB) int {
	t.Helper()
	var n int
	if err := db.Get(&n, `SELECT count(*) FROM pg_prepared_statements WHERE statement ~ 'serial_no|txid_current'`); err != nil {
		t.Fatal(err)
	}
	return n
}

// batch settles n new pending orders and a serial without a row, then
// looks up what the close could not answer for, as the consumer does, and
// fails the test unless every order closed and the lookup found no row
// for the missing one.
func batch(t *testing.T, ctx context.Context, db *sqlx.DB, s *orders.Store, prefix string) {
	t.Helper()
	serials := pendingOrders(t, db, prefix, 5)
	out, err := s.Settle(ctx, append(serials, prefix+"-no-row"), nil)
	if err != nil {
		t.Fatalf("%s: Settle: %v", prefix, err)
	}
	if got := sorted(out.Closed); fmt.Sprint(got) != fmt.Sprint(serials) {
		t.Fatalf("%s: closed %v, want %v", prefix, got, serials)
	}
	found, err := s.Lookup(ctx, out.Unknown)
	if err != nil || len(found) != 0 {
		t.Fatalf("%s: Lookup(%v) = %+v, %v; want no row", prefix, out.Unknown, found, err)
	}
}

// A table altered under the prepared statements — a column they return
// changes type, so PostgreSQL refuses to run them ("cached plan must not
// change result type", 0A000), a column added and dropped, which it
// replans by itself — costs no batch: the statements are prepared again
// and the batch runs at once, without an error reaching the caller (which
// would take a 0A000 for this batch's data and split it).
func TestPreparedStatementsSurviveAlteredTable(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	for _, p := range prepPaths {
		t.Run(p.name, func(t *testing.T) {
			db := oneConn(t)
			other := otherSession(t, db)
			s := orders.NewStore(db, p.stmts)
			batch(t, ctx, db, s, "before")
			for i, ddl := range []string{
				`ALTER TABLE orders ALTER COLUMN serial_no TYPE varchar(128)`,
				`ALTER TABLE orders ADD COLUMN od_note text`,
				`ALTER TABLE orders DROP COLUMN od_note`,
				`ALTER TABLE orders ALTER COLUMN serial_no TYPE text`,
			} {
				if _, err := other.ExecContext(ctx, ddl); err != nil {
					t.Fatalf("%s: %v", ddl, err)
				}
				batch(t, ctx, db, s, fmt.Sprintf("after%d", i))
			}
		})
	}
}

// The one statement answers in columns of the same types whatever the
// serial column's (its serials cast to text): a change of that column's
// type under it, which makes the close statement's plan stale (0A000) and
// costs it a cure, is replanned by PostgreSQL without one — text, varchar,
// char(n) (whose blanks the cast trims), a domain over text, and back.
func TestOneStatementIsNeverStaleForAColumnType(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := oneConn(t)
	other := otherSession(t, db)
	s := orders.NewStore(db, orders.Statements{})
	batch(t, ctx, db, s, "before")
	ddls := []string{
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE varchar(128)`,
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE char(40)`,
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE text`,
		`CREATE DOMAIN od_serial AS text`,
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE od_serial`,
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE text`,
	}
	for i, ddl := range ddls {
		if _, err := other.ExecContext(ctx, ddl); err != nil {
			t.Fatalf("%s: %v", ddl, err)
		}
		// Only the one statement runs (every serial has a row: no
		// lookup, whose plan the change does make stale).
		serials := pendingOrders(t, db, fmt.Sprintf("after%d", i), 5)
		out, err := s.Settle(ctx, serials, nil)
		if got := sorted(out.Closed); err != nil || fmt.Sprint(got) != fmt.Sprint(serials) || len(out.Unknown)+len(out.Settled) > 0 {
			t.Fatalf("after %s: Settle = %+v, %v; want %v closed", ddl, out, err, serials)
		}
	}
	if got := preparedCounts(t, db, orders.ShapedSettleSQL)[0]; got != fmt.Sprintf("1/%d", len(ddls)+1) {
		t.Errorf("the one statement prepared/ran in the session: %s, want prepared once, run %d times", got, len(ddls)+1)
	}
}

// otherSession returns a connection to db's database that is not in db's
// pool: another client, as a migration would be.
func otherSession(t *testing.T, db *sqlx.DB) *sqlx.DB {
	t.Helper()
	var name string
	if err := db.Get(&name, `SELECT current_database()`); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(testenv.AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	other, err := sqlx.Open("postgres", u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	return other
}

// warnings returns the store's log at Warn and above.
func warnings(s *orders.Store) *observer.ObservedLogs {
	core, logs := observer.New(zap.WarnLevel)
	s.SetLogger(zap.New(core))
	return logs
}

// loggedCode returns the SQLSTATE of the error a log entry carries.
func loggedCode(e observer.LoggedEntry) string {
	for _, f := range e.Context {
		if err, ok := f.Interface.(error); ok {
			var pqErr *pq.Error
			if errors.As(err, &pqErr) {
				return string(pqErr.Code)
			}
		}
	}
	return ""
}

// Behind PgBouncer in transaction pooling (before 1.21, or without
// max_prepared_statements) the session a transaction gets may not have
// the statement prepared on another (26000), or may have another
// client's of the same name (42P05). Simulated on a real server by doing
// to the session what the pooler's reuse does: DEALLOCATE ALL in a
// transaction on the store's own connection (a pool of one), and a
// statement named as lib/pq names its first one, prepared on that session
// before the store's. The store falls back to unprepared statements, says
// why once at Warn, and no batch fails, then or later.
func TestPreparedStatementsFallBackBehindATransactionPooler(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	for _, p := range prepPaths {
		t.Run(p.name+", lost (26000)", func(t *testing.T) {
			db := oneConn(t)
			s := orders.NewStore(db, p.stmts)
			logs := warnings(s)
			batch(t, ctx, db, s, "prepared")
			for i := range 3 {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := tx.ExecContext(ctx, `DEALLOCATE ALL`); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
				batch(t, ctx, db, s, fmt.Sprintf("lost%d", i))
			}
			checkFellBack(t, db, logs, "26000")
		})
		t.Run(p.name+", taken (42P05)", func(t *testing.T) {
			db := oneConn(t)
			s := orders.NewStore(db, p.stmts)
			logs := warnings(s)
			for _, name := range []string{"1", "2", "3"} { // lib/pq's names for a connection's first statements
				if _, err := db.ExecContext(ctx, `PREPARE "`+name+`" AS SELECT 1`); err != nil {
					t.Fatal(err)
				}
			}
			for i := range 3 {
				batch(t, ctx, db, s, fmt.Sprintf("taken%d", i))
			}
			checkFellBack(t, db, logs, "42P05")
		})
	}
}

// checkFellBack checks that the store warned once, for the error code,
// and prepares nothing in the session any more.
func checkFellBack(t *testing.T, db *sqlx.DB, logs *observer.ObservedLogs, code string) {
	t.Helper()
	if logs.Len() != 1 {
		t.Fatalf("%d warnings, want 1: %v", logs.Len(), logs.All())
	}
	e := logs.All()[0]
	if got := loggedCode(e); got != code || !strings.Contains(e.Message, "PgBouncer") {
		t.Errorf("warning %q with error code %q, want one that names PgBouncer, for %s", e.Message, got, code)
	}
	if n := ours(t, db); n != 0 {
		t.Errorf("%d statements of the store still prepared in the session after the fallback", n)
	}
}

// A connection that dies takes its prepared statements with it: the pool
// dials another and the statements are prepared there on first use.
func TestPreparedStatementsOnANewConnection(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	for _, p := range prepPaths {
		t.Run(p.name, func(t *testing.T) {
			db := oneConn(t)
			other := otherSession(t, db)
			s := orders.NewStore(db, p.stmts)
			batch(t, ctx, db, s, "first")
			var pid int
			if err := db.Get(&pid, `SELECT pg_backend_pid()`); err != nil {
				t.Fatal(err)
			}
			if _, err := other.ExecContext(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
				t.Fatal(err)
			}
			// The pool finds the connection dead when it next uses it; a
			// statement that was first to find out fails as the
			// connection's (transient), and the batch is retried.
			serials := pendingOrders(t, db, "second", 5)
			out, err := s.Settle(ctx, serials, nil)
			if err != nil {
				if !orders.Transient(err) {
					t.Fatalf("Settle on a dead connection: %v, want a transient error", err)
				}
				out, err = s.Settle(ctx, serials, nil)
			}
			if err != nil || len(out.Closed) != 5 {
				t.Fatalf("Settle after the connection died: %+v, %v", out, err)
			}
			batch(t, ctx, db, s, "third")
			var now int
			if err := db.Get(&now, `SELECT pg_backend_pid()`); err != nil || now == pid {
				t.Fatalf("backend %d (%v), want a new one", now, err)
			}
			if n := ours(t, db); n != p.prepared {
				t.Errorf("%d statements of the store prepared on the new connection, want %d", n, p.prepared)
			}
		})
	}
}

// backendCPU returns the CPU time the server process pid has used, from
// /proc (the server runs on this machine), or false when it cannot be read.
func backendCPU(pid int) (time.Duration, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0, false
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(ut+st) * 10 * time.Millisecond, true // USER_HZ = 100
}

// BenchmarkSettle500 closes batches of 500 orders, the statements
// prepared or not, on one connection, and reports the server process's CPU
// per order (pg-µs/order, when the server runs on this machine), counted
// over the Settle calls only (the rows are made pending again between).
func BenchmarkSettle500(b *testing.B) {
	for _, prep := range []bool{true, false} {
		name := "prepared"
		if !prep {
			name = "unprepared"
		}
		b.Run(name, func(b *testing.B) {
			db, _ := testenv.Postgres(b)
			db.SetMaxOpenConns(1)
			s := orders.NewStore(db, orders.Statements{})
			if !prep {
				orders.Unprepared(s)
			}
			ss := pendingRows(b, db, 100000)
			if _, err := db.Exec(`VACUUM ANALYZE orders`); err != nil {
				b.Fatal(err)
			}
			var pid int
			if err := db.Get(&pid, `SELECT pg_backend_pid()`); err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			var cpu time.Duration
			measured := true
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				batch := ss[(i*500)%len(ss):][:500]
				if (i*500)%len(ss) == 0 && i > 0 {
					b.StopTimer()
					if _, err := db.Exec(`UPDATE orders SET status = 'pending', closed_at = NULL WHERE status = 'closed'`); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
				before, ok1 := backendCPU(pid)
				out, err := s.Settle(ctx, batch, nil)
				after, ok2 := backendCPU(pid)
				if err != nil || len(out.Closed) != 500 {
					b.Fatalf("Settle: %d closed, %v", len(out.Closed), err)
				}
				measured = measured && ok1 && ok2
				cpu += after - before
			}
			if measured {
				b.ReportMetric(float64(cpu.Microseconds())/float64(b.N*500), "pg-µs/order")
			}
		})
	}
}

// With prepared statements off (ORDERDELAY_PREPARED_STATEMENTS=false: a
// pooler that hands transactions to any server session) the store prepares
// nothing in the session: every batch sends its statements unprepared, as
// lib/pq does a query with parameters, and still closes and looks up.
func TestUnpreparedStoreLeavesNoStatementInTheSession(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	for _, p := range prepPaths {
		t.Run(p.name, func(t *testing.T) {
			db := oneConn(t)
			s := orders.NewStore(db, p.stmts)
			s.Unprepared()
			for i := range 3 {
				batch(t, ctx, db, s, fmt.Sprintf("unprep%d", i))
			}
			if n := ours(t, db); n != 0 {
				t.Errorf("%d of the store's statements prepared in the session, want 0", n)
			}
		})
	}
}
