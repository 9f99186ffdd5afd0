package orders_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The connection breaks while the server is still working on the COMMIT
// (a deferred trigger, a slow fsync, a wait for a synchronous standby):
// asked at once, the server says the transaction is "in progress". That
// is no answer yet, not "nobody can say": the server is reachable and
// finishes the COMMIT a moment later (it does not notice the client is
// gone until it writes). The store must keep asking, within its wait, and
// report the close it then sees committed — not an in-doubt error whose
// orders come back "settled" and are never counted closed.
func TestCommitStillRunningWhenItsConnectionBreaksIsAskedAgain(t *testing.T) {
	t.Parallel()
	for _, path := range closePaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			db, viaProxy, _, px := testenv.PostgresViaProxy(t)
			// The COMMIT runs a deferred trigger that takes 700 ms.
			if _, err := db.Exec(`CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.7); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER UPDATE ON orders DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION slow_commit()`); err != nil {
				t.Fatal(err)
			}
			insert(t, db, order{"slow", "pending", -time.Hour})
			s := orders.NewStore(viaProxy, orders.Statements{})
			s.SetCommitStatusWait(5 * time.Second)
			cut := make(chan struct{})
			got, err := path.close(ctxT(t), s, []string{"slow"}, func(context.Context, []string) ([]string, error) {
				// Right before COMMIT: once the server sleeps in the
				// deferred trigger of the COMMIT, cut the connection.
				go func() {
					defer close(cut)
					for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
						var n int
						if db.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
							AND query = 'COMMIT' AND wait_event = 'PgSleep'`) == nil && n == 1 {
							px.Down()
							px.Up()
							return
						}
					}
					t.Error("the COMMIT never reached the deferred trigger")
				}()
				return nil, nil
			})
			<-cut
			st := status(t, db, "slow")
			for end := time.Now().Add(5 * time.Second); st != "closed" && time.Now().Before(end); st = status(t, db, "slow") {
				time.Sleep(10 * time.Millisecond)
			}
			if st != "closed" {
				t.Fatalf("the server did not commit (%s): the test proved nothing", st)
			}
			if err != nil || !slices.Equal(got, []string{"slow"}) {
				t.Fatalf("Close = %v, %v (in doubt: %d); want [slow]: the server was reachable and committed 0.7 s later",
					got, err, orders.InDoubt(err))
			}
		})
	}
}

// PostgreSQL answers a COMMIT with an error only when the transaction did
// not commit (a deferred constraint or trigger, a serialization check:
// all before the commit record). Such a close is a plain failure even when
// the question that follows cannot be answered (here txid_status itself
// fails): not in doubt — in_doubt_total would count orders the server said
// it did not close — and the error keeps its own classification (a
// shop's deferred trigger refusing one order: a data error, the batch
// split), as the reconciler's CommitError already has it. Every
// InDoubtError is then about a COMMIT without an answer, and transient.
func TestCommitTheServerRefusedIsNotInDoubt(t *testing.T) {
	t.Parallel()
	for _, path := range closePaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			db, _ := testenv.Postgres(t)
			if _, err := db.Exec(`CREATE FUNCTION refuse_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE unique_violation USING MESSAGE = 'refused at commit'; END $$;
CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER UPDATE ON orders DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION refuse_at_commit();
-- The question after the COMMIT fails too (public comes before pg_catalog).
CREATE FUNCTION public.txid_status(bigint) RETURNS text LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'no status today'; END $$`); err != nil {
				t.Fatal(err)
			}
			var dbname string
			if err := db.Get(&dbname, "SELECT current_database()"); err != nil {
				t.Fatal(err)
			}
			if _, err := db.Exec(fmt.Sprintf("ALTER DATABASE %q SET search_path = public, pg_catalog", dbname)); err != nil {
				t.Fatal(err)
			}
			db.SetMaxIdleConns(0) // new sessions take the database's search_path
			db.SetMaxIdleConns(2)
			insert(t, db, order{"refused", "pending", -time.Hour})
			s := orders.NewStore(db, orders.Statements{})
			s.SetCommitStatusWait(time.Second)
			got, err := path.close(ctxT(t), s, []string{"refused"}, nil)
			if st := status(t, db, "refused"); st != "pending" {
				t.Fatalf("the order is %s: the COMMIT was not refused, the test proved nothing", st)
			}
			var pqErr *pq.Error
			if !errors.As(err, &pqErr) || pqErr.Code != "23505" {
				t.Fatalf("Close = %v, %v; want the COMMIT's 23505", got, err)
			}
			if n := orders.InDoubt(err); n != 0 {
				t.Errorf("InDoubt(%v) = %d, want 0: the server answered the COMMIT, it did not commit", err, n)
			}
		})
	}
}

// CommitError puts in doubt only a COMMIT error without an answer: every
// InDoubtError is transient (retried, never split or buried), and an error
// the server or the driver answered with is not in doubt.
func TestCommitErrorInDoubtOnlyWithoutAnAnswer(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		err   error
		doubt bool
	}{
		{driver.ErrBadConn, true}, {io.EOF, true}, {io.ErrUnexpectedEOF, true}, {sql.ErrTxDone, true},
		{context.DeadlineExceeded, true}, {&net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, true},
		{&pq.Error{Code: "23505"}, false}, {&pq.Error{Code: "40001"}, false}, {&pq.Error{Code: "57014"}, false},
		{fmt.Errorf("%w: %w", context.DeadlineExceeded, &pq.Error{Code: "57014"}), false},
		{pq.ErrInFailedTransaction, false}, {errors.New("unexpected command tag ROLLBACK"), false},
	} {
		err := orders.CommitError(c.err, 2)
		if got := orders.InDoubt(err) == 2; got != c.doubt {
			t.Errorf("CommitError(%v) in doubt: %v, want %v", c.err, got, c.doubt)
		}
		if orders.InDoubt(err) > 0 && !orders.Transient(err) {
			t.Errorf("CommitError(%v) = %v: in doubt but not transient", c.err, err)
		}
		if orders.InDoubt(orders.CommitError(c.err, 0)) != 0 {
			t.Errorf("CommitError(%v, 0) in doubt: nothing was closed", c.err)
		}
	}
}
