package orders_test

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"testing"
	"time"

	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A close whose first run meets a stale prepared statement (0A000: a
// migration changed the type of a column it returns) is run again by
// runCured, and the COMMIT of that second run loses its answer. What the
// second run committed must be settled as any lost COMMIT is: the server
// that ran it says it committed → the orders are reported closed, the
// close is not run a third time (a third run would find them closed and
// report them settled: never counted closed); the server out of reach for
// longer than the store asks → in doubt (transient, counted apart), and
// the orders are still closed once. Never does the cure loop take the lost
// answer for a statement to cure.
//
// The answer is lost by the test's proxy: dropped with its connection
// (DropReplies) right after the fence, whose next server bytes are the
// COMMIT's; or, for the server out of reach, held (Stall) until
// PostgreSQL notifies, at commit, that the orders closed, then the proxy
// goes down. Each order's closing is logged by a trigger with its
// transaction id, so "closed once" is read from the server.
func TestLostCommitOfACuredRunIsSettledByTheServer(t *testing.T) {
	t.Parallel()
	for _, path := range closePaths {
		if path.name == "one statement" {
			// Never stale for the column type change this test makes
			// (TestOneStatementIsNeverStaleForAColumnType): no cure.
			continue
		}
		for _, reachable := range []bool{true, false} {
			name := path.name + ", server out of reach"
			if reachable {
				name = path.name + ", server reachable"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				ctx := ctxT(t)
				direct, directDSN := testenv.Postgres(t)
				u, err := url.Parse(directDSN)
				if err != nil {
					t.Fatal(err)
				}
				px := testenv.NewProxy(t, u.Host)
				u.Host = px.Addr()
				db, h := testenv.CountingPool(t, u.String(), 2)
				insert(t, direct,
					order{"warm", "pending", -time.Hour},
					order{"cc-1", "pending", -time.Hour},
					order{"cc-2", "pending", -time.Hour},
					order{"cc-paid", "paid", -time.Hour})
				s := orders.NewStore(db, orders.Statements{})
				wait := 5 * time.Second
				if !reachable {
					wait = 300 * time.Millisecond
				}
				s.SetCommitStatusWait(wait)
				closeQ := []string{orders.DefaultSettleSQL}
				if path.name == "close statement" {
					closeQ = []string{orders.ShapeClose(orders.DefaultCloseSQL), orders.DefaultCloseSQL}
				}
				closeRuns := func() int {
					n := 0
					for _, q := range closeQ {
						n += h.Ran(q)
					}
					return n
				}
				if got, err := path.close(ctx, s, []string{"warm"}, nil); err != nil || !slices.Equal(got, []string{"warm"}) {
					t.Fatalf("warm-up close = %v, %v", got, err)
				}
				// The warm-up's prepared close is stale now: the first run fails.
				direct.MustExec(`ALTER TABLE orders ALTER COLUMN serial_no TYPE varchar(128)`)
				// Made after the ALTER: a PL/pgSQL function caches its plans per
				// session, and one planned before would refuse the new type.
				direct.MustExec(`CREATE TABLE od_close_log (serial_no text NOT NULL, xid bigint NOT NULL);
CREATE FUNCTION od_log_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND OLD.status <> 'closed' THEN
    INSERT INTO od_close_log VALUES (NEW.serial_no, txid_current());
    PERFORM pg_notify('od_closed', NEW.serial_no);
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER od_log_close AFTER UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION od_log_close()`)

				l := pq.NewListener(directDSN, time.Second, time.Second, nil)
				defer l.Close()
				if err := l.Listen("od_closed"); err != nil {
					t.Fatal(err)
				}
				downed := make(chan struct{})
				runs0 := closeRuns()
				serials := []string{"cc-1", "cc-2", "cc-paid"}
				var fenced [][]string
				got, err := path.close(ctx, s, serials, func(ctx context.Context, closed []string) ([]string, error) {
					fenced = append(fenced, sorted(closed))
					if len(fenced) > 1 {
						return nil, nil
					}
					if reachable {
						px.DropReplies(1) // the COMMIT's answer, and its connection
						close(downed)
						return nil, nil
					}
					px.Stall(time.Minute)
					go func() {
						defer close(downed)
						for {
							select {
							case n := <-l.Notify:
								if n == nil {
									continue // the listener reconnected
								}
								px.Down() // committed: the answer held, the server out of reach
								return
							case <-ctx.Done():
								t.Error("no notification that the close committed")
								return
							}
						}
					}()
					return nil, nil
				})
				if len(fenced) == 0 {
					t.Fatalf("close = %v, %v; the fence was never asked: no run reached COMMIT", got, err)
				}
				<-downed
				px.Stall(0)
				px.Up()
				runs := closeRuns() - runs0

				var log []string
				if err := direct.SelectContext(ctx, &log, `SELECT serial_no || ' ' || count(*) || ' ' || count(DISTINCT xid)
					FROM od_close_log WHERE serial_no <> 'warm' GROUP BY serial_no ORDER BY serial_no`); err != nil {
					t.Fatal(err)
				}
				if want := []string{"cc-1 1 1", "cc-2 1 1"}; !slices.Equal(log, want) {
					t.Fatalf("closings logged (serial, times, transactions): %v, want %v: each closed once", log, want)
				}
				if st := status(t, direct, "cc-paid"); st != "paid" {
					t.Errorf("the paid order is %s", st)
				}
				if runs != 2 {
					t.Errorf("the close ran %d times, want 2: once stale, once cured (and not again after the lost COMMIT)", runs)
				}
				if want := [][]string{{"cc-1", "cc-2"}}; fmt.Sprint(fenced) != fmt.Sprint(want) {
					t.Errorf("the fence saw %v, want %v: only the cured run reaches it", fenced, want)
				}
				if reachable {
					if err != nil || !slices.Equal(sorted(got), []string{"cc-1", "cc-2"}) {
						t.Fatalf("close = %v, %v (in doubt %d); want [cc-1 cc-2]: the server that ran it says it committed",
							got, err, orders.InDoubt(err))
					}
					return
				}
				if err == nil || len(got) != 0 {
					t.Fatalf("close = %v, %v; want an error: nobody could confirm the commit", got, err)
				}
				if n := orders.InDoubt(err); n != 2 || !orders.Transient(err) {
					t.Errorf("close error %v: in doubt %d, transient %v; want 2 in doubt, transient", err, n, orders.Transient(err))
				}
				// The consumer's retry, the server back: nothing closes again.
				again, err := path.close(ctx, s, serials, nil)
				if err != nil || len(again) != 0 {
					t.Errorf("retried close = %v, %v; want nothing closed: it committed the first time", again, err)
				}
			})
		}
	}
}
