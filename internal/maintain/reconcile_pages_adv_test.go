package maintain

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// Invariant "nothing lost" (README, "How it works" 6: "It pages by keyset,
// so overdue orders still queued never hide a lost one"). Overdue orders
// still legitimately in Redis — a raw-ZADD producer extended their
// deadlines in Redis only (the queue's deadline is the producer's latest
// write; the row's expires_at stays), or a fast-path backlog past the
// grace — fill more pages than one pass reads (maxPagesPerRun). Every
// pass starts again from the first page, reads the same queued rows and
// ends before the lost order behind them, so while those orders stay
// queued the lost order is never closed, however many passes run.
func TestAdvReconcilerLostOrderBehindMorePagesOfQueuedOrdersThanAPassReads(t *testing.T) {
	e := newEnv(t, orderStatements())
	r, queued, lost := queuedAheadOfALostOrder(t, e, 2)
	threePassesReachTheLostOrder(t, e, r, queued, lost, "overdue orders still queued")
}

// Invariant "poison never blocks", reconciler, the same pages: poisonous
// orders (a shop's trigger refuses their close; the fast path dead-letters
// them as close_failed, so they are nowhere in Redis and stay pending and
// overdue for good) fill more pages than one pass reads. Each pass
// isolates them again, page after page, and ends before the good lost
// order behind them: one shop's bad rows, past that many, stop the
// safety net for every lost order with a later deadline, for good.
func TestAdvReconcilerLostOrderBehindMorePagesOfPoisonThanAPassReads(t *testing.T) {
	e := newEnv(t, orderStatements())
	const pageSize = 2
	poison := e.Orders("poison", pageSize*maxPagesPerRun+1, time.Now().Add(-2*time.Hour))
	e.CloseTrigger("refuse_poison", "NEW.serial_no LIKE 'poison-%'",
		"RAISE EXCEPTION 'shop trigger: order % cannot be closed', NEW.serial_no USING ERRCODE = 'P0001'")
	lost := e.Orders("lost", 1, time.Now().Add(-time.Hour))[0]
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: pageSize},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	threePassesReachTheLostOrder(t, e, r, poison, lost, "poisonous orders")
}

// threePassesReachTheLostOrder runs three passes of r (two read every row
// there is when ahead fills one page more than a pass reads, the third is
// to spare) and checks that the orders ahead stay pending and the lost
// one behind them is closed.
func threePassesReachTheLostOrder(t *testing.T, e *env, r *Reconciler, ahead []string, lost, what string) {
	t.Helper()
	const passes = 3
	total := 0
	for range passes {
		n, err := r.RunOnce(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		total += n
	}
	for _, s := range ahead {
		if st := e.Status(s); st != "pending" {
			t.Fatalf("%s is %s, want pending (still queued, or its close refused)", s, st)
		}
	}
	if st := e.Status(lost); st != "closed" {
		t.Fatalf("after %d passes (closed %d) the lost order %s is %s: %d %s ahead of it "+
			"(more than the %d pages of %d one pass reads) hide it from every pass",
			passes, total, lost, st, len(ahead), what, maxPagesPerRun, r.cfg.PageSize)
	}
}

// queuedAheadOfALostOrder makes one row more than a pass reads of overdue
// orders still queued (their deadlines extended in Redis only), then one
// lost order behind them, and a reconciler reading pages of pageSize.
func queuedAheadOfALostOrder(t *testing.T, e *env, pageSize int) (r *Reconciler, queued []string, lost string) {
	t.Helper()
	queued = e.Orders("queued", pageSize*maxPagesPerRun+1, time.Now().Add(-2*time.Hour))
	e.Enqueue(queued, e.RedisNow().Add(24*time.Hour))
	lost = e.Orders("lost", 1, time.Now().Add(-time.Hour))[0]
	r = NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: pageSize},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	return r, queued, lost
}

func runPass(t *testing.T, r *Reconciler) int {
	t.Helper()
	n, err := r.RunOnce(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// A pass that meets another replica's page (the advisory lock taken) ends
// without a failure and keeps where its walk had reached: were it to
// start again from the beginning, a replica that loses the lock now and
// then would read the same first pages every time it wins.
func TestReconcilerPassMeetingAnotherReplicaKeepsItsPlace(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	r, _, lost := queuedAheadOfALostOrder(t, e, 2)
	if n := runPass(t, r); n != 0 {
		t.Fatalf("the first pass closed %d, want 0 (it reads only queued orders)", n)
	}
	// Another replica's page holds the lock through the second pass.
	tx, err := e.Store.DB().BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := orders.TryAdvisoryXactLock(ctx, tx, r.lock); err != nil || !got {
		t.Fatalf("taking the reconciler's lock: %v, %v", got, err)
	}
	if n := runPass(t, r); n != 0 {
		t.Fatalf("a pass closed %d while another replica held the lock", n)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if n := runPass(t, r); n != 1 || e.Status(lost) != "closed" {
		t.Fatalf("the pass after the other replica's closed %d and left %s %s: it started again from the beginning",
			n, lost, e.Status(lost))
	}
}

// A walk that reached the end starts again from the beginning: an order
// lost behind where it had reached is closed when it comes round.
func TestReconcilerWalkComesRoundToAnOrderLostBehindIt(t *testing.T) {
	e := newEnv(t, orderStatements())
	r, _, lost := queuedAheadOfALostOrder(t, e, 2)
	runPass(t, r) // the first 40 queued orders
	// Lost now, ahead of every row the walk has read.
	head := e.Orders("head", 1, time.Now().Add(-3*time.Hour))[0]
	closed := 0
	for range 3 { // the rest, the end; then from the beginning
		closed += runPass(t, r)
	}
	for _, s := range []string{lost, head} {
		if st := e.Status(s); st != "closed" {
			t.Errorf("%s is %s after the walk came round (closed %d)", s, st, closed)
		}
	}
}
