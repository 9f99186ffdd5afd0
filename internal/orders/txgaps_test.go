package orders_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// alterQueued starts ddl on other (another client, as a migration) and
// returns once it waits for its table lock: the store's transaction holds
// the rows it closed, so the ALTER runs when that transaction ends, before
// the store's next statement on the table can run. Its result comes on the
// channel.
func alterQueued(t *testing.T, ctx context.Context, other *sqlx.DB, ddl string) <-chan error {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		_, err := other.ExecContext(ctx, ddl)
		errc <- err
	}()
	for {
		var n int
		if err := other.GetContext(ctx, &n, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query = $1`, ddl); err != nil {
			t.Error(err)
			return errc
		}
		if n > 0 {
			return errc
		}
		select {
		case err := <-errc:
			t.Errorf("%s ran without waiting for the close's locks: %v", ddl, err)
			errc <- err
			return errc
		case <-ctx.Done():
			t.Error(ctx.Err())
			return errc
		default:
		}
	}
}

// A fence that drops serials makes closeTx roll back and run the close
// again without them; if that rerun meets a stale plan (0A000, a migration
// changed a returned column's type while the dropped close held its rows),
// the statements are prepared again and the rerun runs once more — still
// without the dropped serials. Each stale plan costs one of the call's two
// cures (maxCures), a drop none. Pinned, with two such rounds: the outcome
// is the kept orders closed and nothing said of the dropped ones, which
// stay pending; the fence never sees a dropped serial closed again; and
// the session shows the close statement prepared three times (the first,
// then once per cure), so both 0A000s did happen on the reruns. With a
// third round the cures are spent: the call returns the 0A000, which is
// Transient (no attempt spent, no split), and nothing commits.
func TestFenceDropThenStalePlanRunsAgainWithoutTheDropped(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	ddls := []string{
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE varchar(128)`,
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE text`,
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE varchar(128)`,
	}
	for _, p := range prepPaths {
		if p.name == "one statement" {
			// Its columns are the same types whatever the serial column's
			// (TestOneStatementIsNeverStaleForAColumnType): no 0A000.
			continue
		}
		for _, rounds := range []int{2, 3} {
			t.Run(fmt.Sprintf("%s, %d rounds", p.name, rounds), func(t *testing.T) {
				db := oneConn(t)
				other := otherSession(t, db)
				s := orders.NewStore(db, p.stmts)
				batch(t, ctx, db, s, "warm")
				serials := pendingOrders(t, db, "f", 6)
				drops := [][]string{{serials[1]}, {serials[4], serials[0]}, {serials[2]}}[:rounds]
				var seen [][]string
				var alters []<-chan error
				fence := func(ctx context.Context, closed []string) ([]string, error) {
					seen = append(seen, sorted(closed))
					i := len(seen) - 1
					if i >= len(drops) {
						return nil, nil
					}
					alters = append(alters, alterQueued(t, ctx, other, ddls[i]))
					return drops[i], nil
				}
				out, err := s.Settle(ctx, serials, fence)
				for i, errc := range alters {
					if err := <-errc; err != nil {
						t.Fatalf("%s: %v", ddls[i], err)
					}
				}
				dropped := slices.Concat(drops...)
				kept := without(serials, dropped)
				wantSeen := [][]string{serials}
				for i := range drops[:min(rounds, 2)] {
					wantSeen = append(wantSeen, without(serials, slices.Concat(drops[:i+1]...)))
				}
				wantPending := sorted(dropped)
				if rounds > 2 {
					if !orders.StalePlan(err) || !orders.Transient(err) {
						t.Errorf("Settle after its cures ran out: %v (Transient %v); want the 0A000, transient", err, orders.Transient(err))
					}
					if len(out.Closed)+len(out.Settled)+len(out.Unknown) > 0 {
						t.Errorf("Settle = %+v with an error, want nothing", out)
					}
					wantPending = serials
				} else {
					if err != nil {
						t.Fatalf("Settle: %v (orders.Transient: %v)", err, orders.Transient(err))
					}
					if got := sortedOutcome(out); !equalOutcome(got, orders.Outcome{Closed: kept}) {
						t.Errorf("Settle = %+v, want %v closed and nothing said of the dropped %v", got, kept, dropped)
					}
				}
				if fmt.Sprint(seen) != fmt.Sprint(wantSeen) {
					t.Errorf("the fence saw closed %v, want %v", seen, wantSeen)
				}
				var pending []string
				if err := db.SelectContext(ctx, &pending, `SELECT serial_no FROM orders WHERE status = 'pending' AND serial_no = ANY($1) ORDER BY 1`,
					orders.TextArrayForTest(serials)); err != nil {
					t.Fatal(err)
				}
				if fmt.Sprint(pending) != fmt.Sprint(wantPending) {
					t.Errorf("pending after the close: %v, want %v", pending, wantPending)
				}
				// Prepared first, then again after each cure (a reset
				// leaves the stale ones in the session, unused).
				table := orders.DefaultSettleSQL
				if p.name != "one statement" {
					table = orders.ShapeClose(orders.DefaultCloseSQL)
				}
				if got := preparedCounts(t, db, table)[0]; got[:2] != "3/" {
					t.Errorf("the close statement prepared/ran in the session: %s, want prepared 3 times (once, then once per cure)", got)
				}
			})
		}
	}
}

func without(ss, drop []string) []string {
	return slices.DeleteFunc(slices.Clone(ss), func(s string) bool { return slices.Contains(drop, s) })
}

// afterDeadline is a Querier on tx that runs a query the way the store's
// prepared statements run in a transaction (Tx.StmtContext, then the
// query) and lets the call's context end between the two, as a deadline
// can: database/sql then rolls the transaction back and closes its copy of
// the statement, and the query fails with "sql: statement is closed",
// which says nothing about the orders. (The rollback runs on its own
// goroutine, racing lib/pq's, which may mark the connection bad first;
// end is the interleaving that leaves the statement closed, made
// deterministic.)
type afterDeadline struct {
	db  *sqlx.DB
	tx  *sqlx.Tx
	end func(ctx context.Context, ts *sql.Stmt)
}

func (q afterDeadline) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	st, err := q.db.PrepareContext(context.Background(), query)
	if err != nil {
		return nil, err
	}
	defer st.Close()
	ts := q.tx.StmtContext(ctx, st)
	q.end(ctx, ts)
	return ts.QueryContext(ctx, args...)
}

// An error database/sql raises because the call's context ended — the
// transaction's copy of a prepared statement closed under its query by the
// rollback that follows the deadline or the cancellation ("sql: statement
// is closed") — is the deadline's or the cancellation's, never the
// orders': Transient, wrapping the context's error, and neither a
// statement timeout nor a statement cut while the server ran it. Before,
// it was permanent: the consumer split the batch over it, and
// dead-lettered an order alone.
func TestErrorAfterTheCallsContextEndedIsTheContexts(t *testing.T) {
	t.Parallel()
	parent := ctxT(t)
	db, _ := testenv.Postgres(t)
	s := orders.NewStore(db, orders.Statements{})
	serials := pendingOrders(t, db, "d", 3)
	for _, c := range []struct {
		name    string
		timeout bool // a deadline passes; else a cancellation
		end     func(ctx context.Context, tx *sqlx.Tx, ts *sql.Stmt)
	}{
		{"statement closed, deadline", true, func(ctx context.Context, _ *sqlx.Tx, ts *sql.Stmt) {
			<-ctx.Done()
			ts.Close() // what the transaction's rollback does to it
		}},
		{"statement closed, cancelled", false, func(ctx context.Context, _ *sqlx.Tx, ts *sql.Stmt) {
			ts.Close()
		}},
		{"transaction rolled back, deadline", true, func(ctx context.Context, tx *sqlx.Tx, _ *sql.Stmt) {
			<-ctx.Done()
			tx.Rollback() //nolint:errcheck // what database/sql does when the transaction's ctx ends
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			tx, err := db.BeginTxx(parent, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback() //nolint:errcheck // nothing to keep
			ctx, cancel := context.WithTimeout(parent, 50*time.Millisecond)
			defer cancel()
			q := afterDeadline{db: db, tx: tx, end: func(ctx context.Context, ts *sql.Stmt) {
				if !c.timeout {
					cancel()
				}
				c.end(ctx, tx, ts)
			}}
			closed, err := s.CloseOn(ctx, q, serials)
			want := context.Canceled
			if c.timeout {
				want = context.DeadlineExceeded
			}
			switch {
			case err == nil:
				t.Fatalf("CloseOn = %v, nil; want an error", closed)
			case !orders.Transient(err) || !errors.Is(err, want):
				t.Errorf("CloseOn after its context ended: %v; Transient %v, is %v: %v; want transient, the context's error",
					err, orders.Transient(err), want, errors.Is(err, want))
			case orders.TimedOut(err) || orders.CutWhileRunning(err) || orders.Contended(err):
				t.Errorf("CloseOn after its context ended: %v taken for the server's timeout or a slow statement", err)
			}
		})
	}
}

// A fence whose answer comes only after the close's context ended (Redis
// answered late; go-redis does not cut a read at a deadline) can commit
// nothing: database/sql has rolled the transaction back and never sends
// the COMMIT. The close says so as the queue's error — a FenceError
// carrying the context's — not as a COMMIT in doubt or a failure of the
// database's, and the orders stay pending.
func TestFenceAnsweredAfterTheDeadlineIsTheQueues(t *testing.T) {
	t.Parallel()
	for _, p := range prepPaths {
		t.Run(p.name, func(t *testing.T) {
			db := oneConn(t)
			s := orders.NewStore(db, p.stmts)
			serials := pendingOrders(t, db, "late", 3)
			ctx, cancel := context.WithCancel(ctxT(t))
			defer cancel()
			fenced := false
			_, err := s.Settle(ctx, serials, func(context.Context, []string) ([]string, error) {
				fenced = true
				cancel() // the answer below comes after the close's context ended
				return nil, nil
			})
			if !fenced {
				t.Fatalf("Settle: %v before the fence", err)
			}
			var fe *orders.FenceError
			if !errors.As(err, &fe) || !errors.Is(err, context.Canceled) {
				t.Errorf("Settle after a late fence: %v (%T); want a FenceError carrying the context's error", err, err)
			}
			if n := orders.InDoubt(err); n != 0 {
				t.Errorf("%d orders in doubt, want 0: no COMMIT was sent", n)
			}
			var pending int
			if err := db.GetContext(ctxT(t), &pending, `SELECT count(*) FROM orders WHERE status = 'pending' AND serial_no = ANY($1)`,
				orders.TextArrayForTest(serials)); err != nil {
				t.Fatal(err)
			}
			if pending != len(serials) {
				t.Errorf("%d of %d orders pending after a late fence, want all", pending, len(serials))
			}
		})
	}
}
