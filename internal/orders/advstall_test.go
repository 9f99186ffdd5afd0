package orders_test

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A reset (a migration changed a returned column's type, or a pooler lost
// the statements) while the network holds the server's replies back (a
// partition, a failover that blackholes the old primary) must not wait on
// that network. Closing a *sql.Stmt makes database/sql send each idle
// connection's Close and wait for its answer while it holds the pool's
// lock: every pool user, whatever its deadline, and every db.Stats (the
// pool metrics) would wait for as long as the replies are held (until TCP
// gives up, in production).
func TestAdvPrepResetDuringAStallLeavesThePoolFree(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	_, db, _, px := testenv.PostgresViaProxy(t)
	db.SetMaxOpenConns(2)
	s := orders.NewStore(db, orders.Statements{})
	batch(t, ctx, db, s, "warm") // the statements prepared on an idle connection
	px.Stall(20 * time.Second)
	defer px.Down() // before db.Close: nothing left to wait for
	resetDone := make(chan struct{})
	go func() { orders.ResetPrepared(s); close(resetDone) }()
	for waiting := false; !waiting; {
		select {
		case <-resetDone:
			waiting = true
		default:
			buf := make([]byte, 1<<20)
			if strings.Contains(string(buf[:runtime.Stack(buf, true)]), "noteUnusedDriverStatement") {
				px.Down()
				<-resetDone
				t.Fatal("reset waits for a stalled idle connection's statement Close, holding database/sql's pool lock " +
					"(every pool user and db.Stats wait with it)")
			}
		}
	}
	db.Stats()
	expired, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.Settle(expired, []string{"x"}, nil); !orders.Transient(err) {
		t.Fatalf("Settle with an ended context during the stall: %v, want a transient error", err)
	}
}
