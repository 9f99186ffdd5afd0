package orders_test

import (
	"context"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A close whose COMMIT answer is lost because the primary died, on a
// database that then fails over: the promoted standby never had the close
// (asynchronous replication) and hands the same transaction id to a
// transaction of its own, which commits. Asking "did xid X commit?" of the
// new primary says yes, about someone else's transaction; taking that for
// our close would report an order closed that is pending, and finish would
// take it out of the queue. The store must only trust the answer of the
// server that ran the close.
func TestLostCommitAnswerAfterFailoverIsNotTakenForCommitted(t *testing.T) {
	t.Parallel()
	for _, path := range closePaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			p := testenv.PrivatePostgresPair(t)
			front, err := sqlx.Open("postgres", p.URL(p.Front.Addr()))
			if err != nil {
				t.Fatal(err)
			}
			defer front.Close()
			primary, err := sqlx.Open("postgres", p.URL(p.PrimaryAddr))
			if err != nil {
				t.Fatal(err)
			}
			defer primary.Close()
			standby, err := sqlx.Open("postgres", p.URL(p.StandbyAddr))
			if err != nil {
				t.Fatal(err)
			}
			defer standby.Close()
			insert(t, front, order{"ghost", "pending", -time.Hour})
			// The standby has the order before replication is cut.
			for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				var n int
				if err := standby.Get(&n, "SELECT count(*) FROM orders WHERE serial_no = 'ghost'"); err == nil && n == 1 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the standby never received the order")
				}
			}
			p.CutReplication()

			s := orders.NewStore(front, orders.Statements{})
			got, err := path.close(ctxT(t), s, []string{"ghost"}, func(ctx context.Context, _ []string) ([]string, error) {
				// Right before COMMIT: the primary's newest transaction id is at
				// least the close's.
				var newest int64
				if err := primary.Get(&newest, "SELECT txid_current()"); err != nil {
					return nil, err
				}
				// The primary dies before the COMMIT reaches it; the standby is
				// promoted and the Service follows it.
				p.StopPrimary()
				if err := p.Promote(30 * time.Second); err != nil {
					t.Error(err)
					return nil, err
				}
				p.Repoint()
				// The new primary's own transactions take the ids the old one
				// handed out after the cut, the close's among them, and commit.
				for {
					var xid int64
					if err := standby.Get(&xid, "SELECT txid_current()"); err != nil {
						t.Error(err)
						return nil, err
					}
					if xid >= newest {
						return nil, nil
					}
				}
			})
			if st := status(t, front, "ghost"); st != "pending" {
				t.Fatalf("the order is %s on the new primary: the test proved nothing", st)
			}
			if err == nil || len(got) != 0 {
				t.Fatalf("Close = %v, %v; want an error: the close never committed on the server that ran it, "+
					"and the new primary's answer about its transaction id is about another transaction", got, err)
			}
			if !orders.Transient(err) {
				t.Errorf("Close error %v is not transient: the order must be retried, not buried", err)
			}
			if n := orders.InDoubt(err); n != 1 {
				t.Errorf("InDoubt(%v) = %d, want 1: the server that answered is not the one that ran the close", err, n)
			}
		})
	}
}
