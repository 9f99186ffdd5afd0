package maintain

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
)

// The reconciler's page reads its overdue orders with FOR UPDATE SKIP
// LOCKED (DefaultOverdueSQL). It used to keep every row of the page locked
// until the page's transaction ended: the rows of the orders still in
// Redis too, which it skips as the fast path's. While a page ran (its close
// statement, the isolation of orders whose close fails, the fence, the
// commit), the fast path's close of those orders waited for their locks
// and failed with 55P03 once the lock timeout passed. Now the page rolls
// back to a savepoint taken before its read once Redis has named the lost
// orders, and the close locks those alone.
//
// Found by the e2e campaign (redis-refuse alone, seeds 444 and 555, a
// busy machine): refusals let a backlog of queued and backing-off orders
// fall past the grace, so they filled the reconciler's pages; every
// second a page locked them while it isolated the ~90 poisonous orders
// again, and the fast path's closes of the backlog kept timing out on
// those locks ("this order's row is locked ... retrying it alone", "not
// tried: the batch's time ran out isolating a row"), backed off, and came
// back to find them locked again: 1,903 orders were still pending more
// than 3 minutes after the last fault.
func TestReconcilerPageDoesNotLockTheOrdersItLeavesToTheFastPath(t *testing.T) {
	e := newEnv(t, orderStatements())
	e.Store.SetTimeouts(2*time.Second, 100*time.Millisecond)
	ctx := context.Background()
	overdue := time.Now().Add(-time.Hour)
	queued := e.Orders("queued", 3, overdue) // a backlog the fast path is working through
	e.Enqueue(queued, overdue)
	lost := e.Orders("lost", 2, overdue.Add(time.Minute))
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 10}, e.RDB, e.Store, e.m, zap.NewNop())
	var closed []string
	var closeErr error
	r.afterClose = func([]string) {
		// The fast path closes the queued orders while the page runs.
		closed, closeErr = e.Store.Close(ctx, queued, nil)
	}
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != len(lost) {
		t.Errorf("the pass closed %d orders, want the %d lost ones", n, len(lost))
	}
	if closeErr != nil || len(closed) != len(queued) {
		t.Errorf("the fast path's close of %d queued orders while the reconciler's page ran: closed %v, error %v; "+
			"want all closed (the page skips them: it must not hold their rows)", len(queued), closed, closeErr)
	}
}
