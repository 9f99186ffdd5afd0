package orders_test

import (
	"database/sql"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Behind a pooler that loses prepared statements, or hands a session
// where another client's hold the names, every worker's next batch meets
// 26000 or 42P05 at about the same time. The first to hear of it falls back
// to unprepared statements; another worker whose statement failed the same
// way, but whose answer came after that, must run its batch again
// (unprepared now) too, not return the error: the consumer would take it
// for the database being down (backoff, dependency marked down) for a batch
// that closes at once. Worker 2's statement is held in its Parse by a
// table lock (as a migration would), so its 42P05 comes after worker 1's
// 26000 made the store fall back.
func TestAdvPrepSecondWorkerLosingItsStatementAfterTheFallback(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	for _, p := range prepPaths {
		t.Run(p.name, func(t *testing.T) {
			db, _ := testenv.Postgres(t)
			db.SetMaxOpenConns(2)
			db.SetMaxIdleConns(2)
			other := otherSession(t, db)
			s := orders.NewStore(db, p.stmts)
			logs := warnings(s)
			// Session A: another client's statements under lib/pq's names.
			ca, err := db.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var pidA int
			if err := ca.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pidA); err != nil {
				t.Fatal(err)
			}
			for _, name := range []string{"1", "2", "3", "4"} {
				if _, err := ca.ExecContext(ctx, `PREPARE "`+name+`" AS SELECT 1`); err != nil {
					t.Fatal(err)
				}
			}
			// Session B: the store's statements, then lost.
			batch(t, ctx, db, s, "warm")
			cb, err := db.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := cb.ExecContext(ctx, `DEALLOCATE ALL`); err != nil {
				t.Fatal(err)
			}
			w1 := pendingOrders(t, other, "w1", 5)
			w2 := pendingOrders(t, other, "w2", 5)
			lock, err := other.BeginTxx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer lock.Rollback() //nolint:errcheck // committed below
			if _, err := lock.ExecContext(ctx, `LOCK TABLE orders IN ACCESS EXCLUSIVE MODE`); err != nil {
				t.Fatal(err)
			}
			type result struct {
				out orders.Outcome
				err error
			}
			settle := func(serials []string) chan result {
				ch := make(chan result, 1)
				go func() {
					out, err := s.Settle(ctx, serials, nil)
					ch <- result{out, err}
				}()
				return ch
			}
			// Worker 2 on session A: its Parse waits for the lock.
			ca.Close()
			done2 := settle(w2)
			for {
				var wait sql.NullString
				if err := other.GetContext(ctx, &wait, `SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1`, pidA); err != nil {
					t.Fatal(err)
				}
				if wait.String == "Lock" {
					break
				}
				if ctx.Err() != nil {
					t.Fatal(ctx.Err())
				}
			}
			// Worker 1 on session B: 26000 at once, falls back, then waits
			// for the lock too.
			cb.Close()
			done1 := settle(w1)
			for logs.Len() == 0 {
				select {
				case r := <-done1:
					t.Fatalf("worker 1 ended (%+v, %v) without falling back", r.out, r.err)
				case <-ctx.Done():
					t.Fatal(ctx.Err())
				case <-time.After(time.Millisecond):
				}
			}
			if err := lock.Commit(); err != nil {
				t.Fatal(err)
			}
			for i, ch := range []chan result{done1, done2} {
				r := <-ch
				if r.err != nil || len(r.out.Closed) != 5 {
					t.Errorf("worker %d: Settle = %+v, %v; want its 5 orders closed, unprepared, at once", i+1, r.out, r.err)
				}
			}
			if logs.Len() != 1 {
				t.Errorf("%d warnings, want 1", logs.Len())
			}
		})
	}
}

// Behind a pooler that hands this client a server session where another
// client prepared a different statement under the name lib/pq gave ours,
// the Bind of ours may not fit theirs: PostgreSQL answers 08P01 from
// exec_bind_message ("bind message supplies 1 parameters, but prepared
// statement requires 2") or PortalSetResultFormat ("bind message has 5
// result formats but query has 2 columns"). lib/pq always binds its own
// statement as it described it,
// so that is the pooler mixing prepared statements up, as 42P05 is: the
// store falls back to unprepared statements and runs the batch again at
// once. Before, 08P01 (class 08, a connection exception) was taken for the
// database being down: the batch was backed off, again and again for as
// long as the sessions kept another client's statement under that name,
// and prepared statements stayed on.
func TestAdvPrepBindThatDoesNotFitFallsBack(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	for _, p := range prepPaths {
		t.Run(p.name, func(t *testing.T) {
			db := oneConn(t)
			s := orders.NewStore(db, p.stmts)
			logs := warnings(s)
			batch(t, ctx, db, s, "warm")
			// The session handed over next: another client's "1" is a
			// statement of two columns and two parameters.
			if _, err := db.ExecContext(ctx, `DEALLOCATE ALL`); err != nil {
				t.Fatal(err)
			}
			if _, err := db.ExecContext(ctx, `PREPARE "1"(text, text) AS SELECT $1, $2`); err != nil {
				t.Fatal(err)
			}
			batch(t, ctx, db, s, "mixed")
			checkFellBack(t, db, logs, "08P01")
		})
	}
}
