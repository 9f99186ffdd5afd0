package bench

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

func needRedisServer(tb testing.TB) {
	tb.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		tb.Skip("redis-server is not on PATH; the harness runs a private one (apt-get install redis-server)")
	}
}

type logWriter struct{ t *testing.T }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestQuick runs the whole harness at CI size. It asserts correctness only
// — every run's orders closed once, none paid, none early, every section
// produced its numbers and plots — never a timing: absolute speed on a
// shared CI machine is not a test result.
func TestQuick(t *testing.T) {
	needRedisServer(t)
	o := Defaults("quick")
	o.OutDir = t.TempDir()
	o.Log = logWriter{t}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	rep, err := Run(ctx, o)
	if err != nil {
		if rep != nil {
			t.Log("\n" + rep.Markdown())
		}
		t.Fatal(err)
	}
	for _, c := range []string{CCeiling, COrderdelay, CTuned, CNaive1, CNaive16, CAsynq} {
		if s, ok := rep.DrainSummary[c]; !ok || s.Median <= 0 {
			t.Errorf("drain %s: no result", c)
		}
	}
	for _, d := range rep.Drains {
		if !d.TimeBoxed && d.Verdict.Closed != d.Verdict.Unpaid {
			t.Errorf("drain %s: %d closed, want every unpaid order (%d)", d.Contender, d.Verdict.Closed, d.Verdict.Unpaid)
		}
		if d.Verdict.Closed == 0 {
			t.Errorf("drain %s closed nothing", d.Contender)
		}
	}
	if len(rep.Steady) != 5 {
		t.Errorf("%d steady scenarios, want 5 (1,000/s constant, mixed, raw; 500/s and 5,000/s mixed)", len(rep.Steady))
	}
	for _, s := range rep.Steady {
		if s.Orders == 0 || !s.KeepsUp || s.Verdict.Early != 0 || s.Verdict.Closed == 0 {
			t.Errorf("steady %s: %+v", s.Scenario, s)
		}
	}
	if rep.Big == nil || rep.Big.RSSKB == 0 || rep.Big.APICalls == 0 {
		t.Errorf("big drain: %+v", rep.Big)
	}
	if len(rep.Enqueue) != 3 || len(rep.Idle) != 4 || len(rep.Memory) != 5 {
		t.Errorf("enqueue %d, idle %d, memory %d results", len(rep.Enqueue), len(rep.Idle), len(rep.Memory))
	}
	for _, m := range rep.Memory {
		if m.BytesPerOrder <= 0 {
			t.Errorf("memory %s: %.0f B per order", m.What, m.BytesPerOrder)
		}
	}
	// Issue 13's table: each of these targets is there (PostgreSQL CPU
	// against the ceiling's only when the ceiling's is above the 10 ms
	// tick, which 2,000 orders are not).
	for _, want := range []string{"drain ≥ 0.6×", "Redis CPU", "daemon CPU", "lateness p99 ≤ 10 ms, mixed 500/s",
		"lateness p99 ≤ 10 ms, mixed 5000/s", "none early", "idle ≤ 5", "Redis memory reported: pending",
		"Redis memory reported: leased"} {
		found := false
		for _, tg := range rep.Targets {
			found = found || (tg.Issue == 13 && strings.HasPrefix(tg.What, want))
		}
		if !found {
			t.Errorf("no issue-13 target %q", want)
		}
	}
	for _, f := range []string{"report.md", "results.json", "lateness-cdf.png", "lateness-orderdelay.png",
		"drain-contenders.png", "drain-vs-batch.png", "drain-vs-workers.png"} {
		if st, err := os.Stat(filepath.Join(o.OutDir, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s not written: %v", f, err)
		}
	}
	t.Log("\n" + rep.Markdown())
}

// TestVerifyCatchesViolations: the correctness check must fail a run that
// closed a paid order, closed one early, or miscounted its closes.
func TestVerifyCatchesViolations(t *testing.T) {
	ctx := context.Background()
	e, err := newPGEnv(ctx, Defaults("quick").AdminURL)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	name, err := e.newDB(ctx)
	if err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("postgres", e.dbURL(name))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	set := backlog(10, time.Now())
	if err := loadPG(ctx, db, set); err != nil {
		t.Fatal(err)
	}
	if v, err := verify(ctx, db, false, 0, false); err != nil || !v.OK() {
		t.Fatalf("untouched table: %+v %v", v, err)
	}
	if v, _ := verify(ctx, db, true, 0, false); v.OK() {
		t.Error("unclosed orders passed a run that had to finish")
	}
	// serial 0 is paid; close it, and close serial 1 a second before its deadline.
	db.ExecContext(ctx, `UPDATE orders SET status = 'closed', closed_at = now() WHERE serial_no = $1`, set.Serials[0])
	db.ExecContext(ctx, `UPDATE orders SET status = 'closed', closed_at = expires_at - interval '1 second' WHERE serial_no = $1`, set.Serials[1])
	v, err := verify(ctx, db, false, 2, false)
	if err != nil {
		t.Fatal(err)
	}
	if v.OK() || v.PaidClosed != 1 || v.Early != 1 {
		t.Errorf("violations not caught: %+v", v)
	}
	if v, _ := verify(ctx, db, false, 3, false); len(v.Violations) != 3 {
		t.Errorf("a miscount was not caught: %v", v.Violations)
	}
}

// benchDB gives a benchmark a database of its own holding n pending orders.
func benchDB(b *testing.B, n int) (*sql.DB, *orderSet) {
	b.Helper()
	ctx := context.Background()
	db := benchPool(b, ceilingConns)
	set := backlog(n, time.Now())
	for i := range set.Paid {
		set.Paid[i] = false
	}
	if err := loadPG(ctx, db, set); err != nil {
		b.Fatal(err)
	}
	return db, set
}

// benchClose closes b.N orders in batches of size through close, on one
// connection: the SQL cost per order, without Redis or the daemon.
func benchClose(b *testing.B, size int, close func(ctx context.Context, db *sql.DB, serials []string) (int, error)) {
	db, set := benchDB(b, b.N)
	ctx := context.Background()
	b.ResetTimer()
	closed := 0
	for i := 0; i < b.N; i += size {
		n, err := close(ctx, db, set.Serials[i:min(i+size, b.N)])
		if err != nil {
			b.Fatal(err)
		}
		closed += n
	}
	b.StopTimer()
	if closed != b.N {
		b.Fatalf("closed %d of %d", closed, b.N)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "orders/s")
}

// lockedArrayCloseSQL is a candidate replacement of the default close
// statement: rows are still locked in serial order first (the inner
// SELECT … ORDER BY serial_no FOR UPDATE), but the UPDATE takes the locked
// serials as an array, so the planner always uses the primary key: the
// default statement's join of the CTE switches to a hash join over a
// sequential scan of the whole table at about 1,000 serials per batch.
const lockedArrayCloseSQL = `UPDATE orders SET status = 'closed', closed_at = now(), close_reason = 'timeout',
    closed_by = current_setting('application_name')
WHERE serial_no = ANY(ARRAY(
    SELECT serial_no FROM orders WHERE serial_no = ANY($1) AND status = 'pending'
    ORDER BY serial_no FOR UPDATE))
  AND status = 'pending'
RETURNING serial_no`

// BenchmarkBatchClose compares, per order, on one connection: the daemon's
// default close statement (a CTE locking rows in serial order, joined to
// the UPDATE), the plain batched UPDATE of the ceiling, and the
// locked-array candidate, at batch sizes around the default.
func BenchmarkBatchClose(b *testing.B) {
	for _, size := range []int{500, 1000, 2000} {
		b.Run("locked-array-sql/"+strconv.Itoa(size), func(b *testing.B) {
			benchClose(b, size, func(ctx context.Context, db *sql.DB, s []string) (int, error) {
				return countRows(ctx, db, lockedArrayCloseSQL, pq.Array(s))
			})
		})
		b.Run("orderdelay-default-sql/"+strconv.Itoa(size), func(b *testing.B) {
			benchClose(b, size, func(ctx context.Context, db *sql.DB, s []string) (int, error) {
				out, err := orders.NewStore(sqlx.NewDb(db, "postgres"), orders.Statements{}).Close(ctx, s, nil)
				return len(out), err
			})
		})
		b.Run("orderdelay-settle/"+strconv.Itoa(size), func(b *testing.B) {
			benchClose(b, size, func(ctx context.Context, db *sql.DB, s []string) (int, error) {
				out, err := orders.NewStore(sqlx.NewDb(db, "postgres"), orders.Statements{}).Settle(ctx, s, nil)
				return len(out.Closed), err
			})
		})
		b.Run("ceiling-sql/"+strconv.Itoa(size), func(b *testing.B) {
			benchClose(b, size, func(ctx context.Context, db *sql.DB, s []string) (int, error) {
				return countRows(ctx, db, ceilingSQL, pq.Array(s))
			})
		})
	}
}

// allClosed is a Store for which every order is unpaid and closes at once:
// with it the consumer runs only its Redis side (claim, fence, finish) and
// its own Go code.
type allClosed struct{}

func (allClosed) Settle(ctx context.Context, s []string, fence orders.Fence) (orders.Outcome, error) {
	if fence == nil {
		return orders.Outcome{Closed: s}, nil
	}
	drop, err := fence(ctx, s)
	if err != nil || len(drop) > 0 {
		return orders.Outcome{}, fmt.Errorf("fence: dropped %d, %v", len(drop), err)
	}
	return orders.Outcome{Closed: s}, nil
}

func (allClosed) Lookup(context.Context, []string) ([]orders.Found, error) { return nil, nil }

// BenchmarkClaimFinish drains b.N due entries through the real consumer
// with a store that closes everything instantly: the claim script, the
// finish script and the worker pool, per order, with no SQL.
func BenchmarkClaimFinish(b *testing.B) {
	needRedisServer(b)
	r, err := startPrivateRedis("")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(r.Stop)
	rdb := redis.NewClient(&redis.Options{Addr: r.Addr})
	b.Cleanup(func() { rdb.Close() })
	ctx := context.Background()
	keys := queue.NewKeys(benchKey)
	set := backlog(b.N, time.Now())
	if err := zaddAll(ctx, rdb, keys.Queue, set, 0, b.N); err != nil {
		b.Fatal(err)
	}
	c, err := consumer.New(consumer.Config{Keys: keys}, rdb, allClosed{},
		metrics.New(prometheus.NewRegistry(), "bench", "bench"), zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	b.ResetTimer()
	go func() { defer close(done); c.Run(runCtx) }() //nolint:errcheck // nil on cancel
	for {
		n1, _ := rdb.ZCard(ctx, keys.Queue).Result()
		n2, _ := rdb.ZCard(ctx, keys.Inflight).Result()
		n3, _ := rdb.ZCard(ctx, keys.Leases).Result()
		if n1 == 0 && n2 == 0 && n3 == 0 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	b.StopTimer()
	cancel()
	<-done
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "orders/s")
}

// benchPool gives a benchmark a database of its own, empty, on a pool of
// conns connections, dropped at the end.
func benchPool(b *testing.B, conns int) *sql.DB {
	b.Helper()
	ctx := context.Background()
	e, err := newPGEnv(ctx, Defaults("quick").AdminURL)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(e.Close)
	name, err := e.newDB(ctx)
	if err != nil {
		b.Fatal(err)
	}
	db, err := openPool(ctx, e.dbURL(name), conns)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { db.Close() })
	return db
}

// perRowSettleSQL is orders.DefaultSettleSQL as it was until its answer
// became one row per kind of outcome (the serials as an array): one row
// per serial, (serial, closed, pending in the snapshot, and on closed rows
// the transaction id and the server). BenchmarkCloseForms runs it beside
// the statement of today (orderdelay-settle-500), and the candidates below
// are cuts of it, each answering per serial as it does.
const perRowSettleSQL = `WITH closed AS (
  UPDATE orders
  SET status = 'closed', closed_at = now(), close_reason = 'timeout',
      closed_by = current_setting('application_name')
  WHERE serial_no = ANY(ARRAY(SELECT unnest($1::text[])))
    AND status = 'pending'
  RETURNING serial_no, txid_current() AS xid)
SELECT serial_no, true, true, xid, (SELECT ` + tidServerSQL + `) FROM closed
UNION ALL
SELECT serial_no, false, status = 'pending', NULL, NULL FROM orders
WHERE serial_no = ANY(ARRAY(SELECT unnest($1::text[]) EXCEPT SELECT serial_no FROM closed))`

// settleUpdateOnly is the update of perRowSettleSQL without the read-back
// of the rows it did not close: what the one statement costs before it
// answers for the paid orders of a batch.
func settleUpdateOnly(b *testing.B) string {
	update, _, ok := strings.Cut(perRowSettleSQL, "\nSELECT serial_no, true")
	if !ok {
		b.Fatal("perRowSettleSQL no longer has the shape BenchmarkCloseForms cuts: a CTE, then \"SELECT serial_no, true …\"")
	}
	return update + "\nSELECT serial_no, xid FROM closed"
}

// settleInitPlans is q (perRowSettleSQL) with closed_by and the
// transaction id evaluated once per statement, as init plans, rather than
// once per row.
func settleInitPlans(b *testing.B, q string) string {
	for _, r := range [][2]string{
		{"closed_by = current_setting('application_name')", "closed_by = (SELECT current_setting('application_name'))"},
		{"RETURNING serial_no, txid_current() AS xid)", "RETURNING serial_no)"},
		{"SELECT serial_no, true, true, xid,", "SELECT serial_no, true, true, (SELECT txid_current()),"},
	} {
		if !strings.Contains(q, r[0]) {
			b.Fatalf("perRowSettleSQL no longer has %q", r[0])
		}
		q = strings.Replace(q, r[0], r[1], 1)
	}
	return q
}

// settleAnyParam is q (perRowSettleSQL) with the update's array given to
// the primary key as it is, not rebuilt by a subquery.
func settleAnyParam(b *testing.B, q string) string {
	const from = "WHERE serial_no = ANY(ARRAY(SELECT unnest($1::text[])))\n    AND status = 'pending'"
	if !strings.Contains(q, from) {
		b.Fatalf("perRowSettleSQL no longer has %q", from)
	}
	return strings.Replace(q, from, "WHERE serial_no = ANY($1::text[])\n    AND status = 'pending'", 1)
}

// The TID candidates for perRowSettleSQL that BenchmarkCloseForms
// measures: the same answer (serial, closed, pending in the snapshot, and
// on closed rows the transaction id and the server), each reading every
// serial's row once (s) and updating the pending ones by their TID, where
// the one statement descends the primary key for the update and again for
// the rows it did not close. None is cheaper (BENCHMARKS.md: the heap
// fetch by TID, the join and s's tuplestore cost more than the read-back's
// descents). They also answer one interleaving differently: a row another
// transaction updated while the close waited for its lock, and left
// pending, has a new TID, which the TID scan's recheck rejects, so they
// leave it pending (not closed, pending: the daemon looks it up and tries
// it again) where perRowSettleSQL re-checks its status and closes it.
const (
	// tidServerSQL is the server's identity, as the one statement has it.
	tidServerSQL = "extract(epoch FROM pg_postmaster_start_time())::text"
	// tidLookupSQL reads the batch's rows once (the array hidden from the
	// planner, as in perRowSettleSQL, so the primary key is scanned at any
	// size, in serial order); tidUpdateSQL closes the pending ones through
	// their TIDs, joined row by row (the locks are taken in s's order).
	tidLookupSQL = `WITH s AS MATERIALIZED (
  SELECT ctid, serial_no, status FROM orders
  WHERE serial_no = ANY(ARRAY(SELECT unnest($1::text[])))),
`
	tidUpdateSQL = `closed AS (
  UPDATE orders o
  SET status = 'closed', closed_at = now(), close_reason = 'timeout',
      closed_by = current_setting('application_name')
  FROM s WHERE o.ctid = s.ctid AND s.status = 'pending' AND o.status = 'pending'
  RETURNING o.serial_no, txid_current() AS xid)
`
	// tidAntiJoinSQL: the rows of s not closed, by an anti-join.
	tidAntiJoinSQL = tidLookupSQL + tidUpdateSQL + `SELECT serial_no, true, true, xid, (SELECT ` + tidServerSQL + `) FROM closed
UNION ALL
SELECT s.serial_no, false, s.status = 'pending', NULL, NULL FROM s
WHERE NOT EXISTS (SELECT 1 FROM closed c WHERE c.serial_no = s.serial_no)`
	// tidPlainSQL: tidAntiJoinSQL with the array given to the primary key
	// as it is.
	tidPlainSQL = `WITH s AS MATERIALIZED (
  SELECT ctid, serial_no, status FROM orders WHERE serial_no = ANY($1::text[])),
` + tidUpdateSQL + `SELECT serial_no, true, true, xid, (SELECT ` + tidServerSQL + `) FROM closed
UNION ALL
SELECT s.serial_no, false, s.status = 'pending', NULL, NULL FROM s
WHERE NOT EXISTS (SELECT 1 FROM closed c WHERE c.serial_no = s.serial_no)`
	// tidOrSQL: the rows of s not closed, found by their status first, a
	// hashed subplan over what was closed after.
	tidOrSQL = tidLookupSQL + tidUpdateSQL + `SELECT serial_no, true, true, xid, (SELECT ` + tidServerSQL + `) FROM closed
UNION ALL
SELECT s.serial_no, false, s.status = 'pending', NULL, NULL FROM s
WHERE s.status <> 'pending' OR s.serial_no NOT IN (SELECT serial_no FROM closed)`
	// tidLeftJoinSQL: every row of s once, joined to what was closed.
	tidLeftJoinSQL = tidLookupSQL + tidUpdateSQL + `SELECT s.serial_no, c.serial_no IS NOT NULL, s.status = 'pending', c.xid,
  CASE WHEN c.serial_no IS NOT NULL THEN (SELECT ` + tidServerSQL + `) END
FROM s LEFT JOIN closed c ON c.serial_no = s.serial_no`
	// tidCountedSQL: the rows of s that were not pending, by their status;
	// the pending ones not closed (changed while the statement waited for
	// them) by an anti-join that runs only when the counts say there are
	// some.
	tidCountedSQL  = tidLookupSQL + tidUpdateSQL + tidCountedTail
	tidCountedTail = `SELECT serial_no, true, true, xid, (SELECT ` + tidServerSQL + `) FROM closed
UNION ALL
SELECT serial_no, false, false, NULL, NULL FROM s WHERE status <> 'pending'
UNION ALL
SELECT s.serial_no, false, true, NULL, NULL FROM s
WHERE s.status = 'pending'
  AND (SELECT count(*) FROM closed) < (SELECT count(*) FROM s WHERE status = 'pending')
  AND NOT EXISTS (SELECT 1 FROM closed c WHERE c.serial_no = s.serial_no)`
	// tidArraySQL: tidCountedSQL with the TIDs handed to the update as an
	// array (a TID scan, no join): the rows are then locked in TID order,
	// not serial order.
	tidArraySQL = tidLookupSQL + `closed AS (
  UPDATE orders
  SET status = 'closed', closed_at = now(), close_reason = 'timeout',
      closed_by = current_setting('application_name')
  WHERE ctid = ANY(ARRAY(SELECT ctid FROM s WHERE status = 'pending')) AND status = 'pending'
  RETURNING serial_no, txid_current() AS xid)
` + tidCountedTail
)

// BenchmarkCloseForms splits PostgreSQL's CPU per order of the daemon's
// close into its parts (issue 13's "PostgreSQL ≤ 1.15× the ceiling's"):
// the harness's ceiling (the autocommit UPDATE, 1,000 serials per
// statement); the same UPDATE at the daemon's 500; that inside the
// daemon's transaction (BEGIN, SET LOCAL timeouts, COMMIT); the one
// statement's update alone, in that transaction; and orders.Store.Settle
// as the daemon runs it (the update plus the read-back of the rows it did
// not close). Then candidates for the one statement, prepared and in the
// daemon's transaction as Settle runs it: perRowSettleSQL (the statement
// orderdelay-settle-500 replaced, the control), its update alone, the TID
// forms above and perRowSettleSQL
// with its per-row parts cut. One connection, one order in ten paid, as in
// the harness's drain. The forms take turns, 1,000 orders each per round,
// so a busy machine slows them alike, and each statement's backend CPU
// time is read from /proc/<pid>/schedstat (nanoseconds). It reports each
// form's median round in µs per order, and the daemon's close as a
// multiple of the ceiling's:
//
//	go test -run '^$' -bench CloseForms -benchtime 200000x .
func BenchmarkCloseForms(b *testing.B) {
	inTx := func(q string) func(context.Context, *sql.DB, []string) (int, error) {
		return func(ctx context.Context, db *sql.DB, s []string) (int, error) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return 0, err
			}
			defer tx.Rollback() //nolint:errcheck // after Commit a no-op
			if _, err := tx.ExecContext(ctx, "SET LOCAL statement_timeout = 10000; SET LOCAL lock_timeout = 2500"); err != nil {
				return 0, err
			}
			rows, err := tx.QueryContext(ctx, q, pq.Array(s))
			if err != nil {
				return 0, err
			}
			n := 0
			for rows.Next() {
				n++
			}
			if err := rows.Err(); err != nil {
				return 0, err
			}
			rows.Close()
			return n, tx.Commit()
		}
	}
	ceiling := func(ctx context.Context, db *sql.DB, s []string) (int, error) {
		return countRows(ctx, db, ceilingSQL, pq.Array(s))
	}
	var st *orders.Store // one store, as the daemon has: statements prepared once
	// prepared runs a one-statement candidate as Settle runs its statement
	// (prepared once on the connection, in the daemon's transaction) and
	// counts the rows it closed (second column true), so that it compares
	// with orderdelay-settle without paying a Parse and a plan per batch.
	// Nothing else runs on the table, so a candidate must answer for every
	// serial (unless whole is false: an update alone): closed with a
	// transaction id, or not pending.
	var preps []*sql.Stmt
	prepared := func(q string, whole bool) func(context.Context, *sql.DB, []string) (int, error) {
		var stmt *sql.Stmt
		return func(ctx context.Context, db *sql.DB, s []string) (int, error) {
			if stmt == nil {
				var err error
				if stmt, err = db.PrepareContext(ctx, q); err != nil {
					return 0, err
				}
				preps = append(preps, stmt)
			}
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return 0, err
			}
			defer tx.Rollback() //nolint:errcheck // after Commit a no-op
			if _, err := tx.ExecContext(ctx, "SET LOCAL statement_timeout = 10000; SET LOCAL lock_timeout = 2500"); err != nil {
				return 0, err
			}
			rows, err := tx.StmtContext(ctx, stmt).QueryContext(ctx, pq.Array(s))
			if err != nil {
				return 0, err
			}
			n, all := 0, 0
			for rows.Next() {
				var serial string
				var closed, pending bool
				var xid sql.NullInt64
				var server sql.NullString
				if err := rows.Scan(&serial, &closed, &pending, &xid, &server); err != nil {
					rows.Close()
					return 0, err
				}
				all++
				switch {
				case closed && xid.Valid:
					n++
				case closed || pending:
					rows.Close()
					return 0, fmt.Errorf("%s: closed %v, pending %v, transaction id %v", serial, closed, pending, xid)
				}
			}
			if err := rows.Err(); err != nil {
				return 0, err
			}
			rows.Close()
			if whole && all != len(s) {
				return 0, fmt.Errorf("%d rows for %d serials", all, len(s))
			}
			return n, tx.Commit()
		}
	}
	forms := []struct {
		name  string
		size  int
		close func(context.Context, *sql.DB, []string) (int, error)
	}{
		{"ceiling-1000", 1000, ceiling},
		{"ceiling-500", 500, ceiling},
		{"ceiling-in-tx-500", 500, inTx(ceilingSQL)},
		{"settle-update-only-500", 500, inTx(settleUpdateOnly(b))},
		{"orderdelay-settle-500", 500, func(ctx context.Context, db *sql.DB, s []string) (int, error) {
			out, err := st.Settle(ctx, s, nil)
			return len(out.Closed), err
		}},
		// Candidates for the per-row statement, run as Settle ran it; the
		// first is perRowSettleSQL itself, the control of the others and
		// the statement orderdelay-settle-500 replaced.
		{"prep-settle-500", 500, prepared(perRowSettleSQL, true)},
		{"prep-update-only-500", 500, prepared(strings.TrimSuffix(settleUpdateOnly(b), "xid FROM closed")+"true, true, xid, NULL::text FROM closed", false)},
		{"tid-antijoin-500", 500, prepared(tidAntiJoinSQL, true)},
		{"tid-plain-500", 500, prepared(tidPlainSQL, true)},
		{"tid-or-500", 500, prepared(tidOrSQL, true)},
		{"tid-leftjoin-500", 500, prepared(tidLeftJoinSQL, true)},
		{"tid-counted-500", 500, prepared(tidCountedSQL, true)},
		{"tid-array-500", 500, prepared(tidArraySQL, true)},
		// perRowSettleSQL with its per-row parts cut.
		{"settle-initplans-500", 500, prepared(settleInitPlans(b, perRowSettleSQL), true)},
		{"settle-any-500", 500, prepared(settleAnyParam(b, perRowSettleSQL), true)},
		{"settle-any-initplans-500", 500, prepared(settleAnyParam(b, settleInitPlans(b, perRowSettleSQL)), true)},
	}
	const round = 1000 // orders each form closes per round
	rounds := max(b.N/round, 1)
	ctx := context.Background()
	db := benchPool(b, 1)
	st = orders.NewStore(sqlx.NewDb(db, "postgres"), orders.Statements{})
	st.SetTimeouts(10*time.Second, 2500*time.Millisecond)
	set := backlog(rounds*round*len(forms), time.Now())
	if err := loadPG(ctx, db, set); err != nil {
		b.Fatal(err)
	}
	var pid int
	if err := db.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		b.Fatal(err)
	}
	if _, ok := schedNanos(pid); !ok {
		b.Skipf("backend %d is not readable in /proc (PostgreSQL on another host?)", pid)
	}
	// spent[f][r]: the backend's CPU time of form f in round r. Each
	// round starts with another form (the order rotates), so none always
	// follows the same one.
	spent := make([][]int64, len(forms))
	for f := range spent {
		spent[f] = make([]int64, rounds)
	}
	closed := make([]int, len(forms))
	b.ResetTimer()
	for r := range rounds {
		for k := range forms {
			f := (r + k) % len(forms)
			form := forms[f]
			first := (r*len(forms) + f) * round
			for i := first; i < first+round; i += form.size {
				t0, _ := schedNanos(pid)
				n, err := form.close(ctx, db, set.Serials[i:i+form.size])
				t1, _ := schedNanos(pid)
				if err != nil {
					b.Fatalf("%s: %v", form.name, err)
				}
				spent[f][r] += t1 - t0
				closed[f] += n
			}
		}
	}
	b.StopTimer()
	var again int
	if err := db.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&again); err != nil || again != pid {
		b.Fatalf("the pool's connection changed (backend %d, then %d, %v): its CPU time is lost", pid, again, err)
	}
	// The median round of each form: another test's burst on this
	// machine slows the rounds it falls in, whichever forms they run.
	perOrder := make([]float64, len(forms))
	for f, form := range forms {
		// Every form is given the same orders: a tenth paid.
		if want := rounds * round * 9 / 10; closed[f] != want {
			b.Fatalf("%s closed %d of %d unpaid", form.name, closed[f], want)
		}
		slices.Sort(spent[f])
		perOrder[f] = float64(spent[f][rounds/2]) / 1e3 / round
		b.ReportMetric(perOrder[f], form.name+"-µs/order")
	}
	for f, form := range forms {
		if form.name == "orderdelay-settle-500" {
			b.ReportMetric(perOrder[f]/perOrder[0], "settle×ceiling")
		}
	}
	for _, p := range preps {
		p.Close()
	}
}

// schedNanos is the CPU time process pid has run, in nanoseconds (the
// first field of /proc/<pid>/schedstat).
func schedNanos(pid int) (int64, bool) {
	raw, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "schedstat"))
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(raw))
	if len(f) == 0 {
		return 0, false
	}
	n, err := strconv.ParseInt(f[0], 10, 64)
	return n, err == nil
}
