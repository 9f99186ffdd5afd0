package orders_test

import (
	"context"
	"slices"
	"testing"
	"time"

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
	for _, path := range closePaths {
		t.Run(path.name, func(t *testing.T) {
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
