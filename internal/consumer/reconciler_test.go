package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

func TestReconcilerClosesOnlyOrdersTheQueueLost(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	longAgo := time.Now().Add(-time.Hour)
	lost := e.orders("lost", 1200, longAgo)                       // Redis lost them
	queued := e.orders("queued", 5, longAgo)                      // a backlog: still in the queue
	leased := e.orders("leased", 5, longAgo)                      // a replica holds them
	recent := e.orders("recent", 5, time.Now().Add(-time.Minute)) // within the grace
	e.enqueue(queued, longAgo)
	e.enqueue(leased, longAgo)
	// Lease the "leased" group: a replica is working on them.
	if err := e.rdb.ZRem(ctx, e.keys.Queue, anys(queued)...).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.consumer(Config{BatchSize: 5})
	if res, err := c.claimBatch(ctx); err != nil || len(res.items) != len(leased) {
		t.Fatalf("claim: %v", err)
	}
	e.enqueue(queued, longAgo)
	r := NewReconciler(ReconcilerConfig{Keys: e.keys, Grace: 5 * time.Minute, PageSize: 100},
		e.rdb, e.store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != len(lost) {
		t.Fatalf("reconciled %d orders, want %d", n, len(lost))
	}
	for _, group := range [][]string{queued, leased, recent} {
		for _, s := range group {
			if st := e.status(s); st != "pending" {
				t.Fatalf("%s is %s: the reconciler touched an order the queue still holds or that is within grace", s, st)
			}
		}
	}
	if v := testutil.ToFloat64(e.m.Reconciled); v != float64(len(lost)) {
		t.Errorf("orders_reconciled_total %v, want %d", v, len(lost))
	}
	// A second pass finds nothing.
	if n, err := r.RunOnce(ctx); err != nil || n != 0 {
		t.Fatalf("second pass closed %d (%v), want 0", n, err)
	}
}

func TestReconcilerYieldsToAnotherReplicaHoldingTheLock(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	e.orders("lost", 3, time.Now().Add(-time.Hour))
	r := NewReconciler(ReconcilerConfig{Keys: e.keys}, e.rdb, e.store, e.m, zaptest.NewLogger(t))
	tx, err := e.db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.Exec("SELECT pg_advisory_xact_lock($1)", r.lock); err != nil {
		t.Fatal(err)
	}
	if n, err := r.RunOnce(ctx); err != nil || n != 0 {
		t.Fatalf("closed %d (%v) while another replica held the lock, want 0", n, err)
	}
}

func TestReconcilerWaitsWhileClosingIsPaused(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	lost := e.orders("lost", 3, time.Now().Add(-time.Hour))
	if err := e.rdb.Set(ctx, e.keys.Paused, "1|PSP outage", 0).Err(); err != nil {
		t.Fatal(err)
	}
	r := NewReconciler(ReconcilerConfig{Keys: e.keys}, e.rdb, e.store, e.m, zaptest.NewLogger(t))
	if n, err := r.RunOnce(ctx); err != nil || n != 0 {
		t.Fatalf("closed %d (%v) while paused, want 0", n, err)
	}
	e.rdb.Del(ctx, e.keys.Paused)
	if n, err := r.RunOnce(ctx); err != nil || n != len(lost) {
		t.Fatalf("closed %d (%v) after resume, want %d", n, err, len(lost))
	}
}

// Issue 11 item 4: more than a page of older overdue orders still
// legitimately queued must not hide a lost order behind them: pages follow
// each other by keyset within a pass.
func TestReconcilerPagesPastOrdersStillQueued(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	older := time.Now().Add(-2 * time.Hour)
	queued := e.orders("queued", 12, older) // same deadline: ties need the serial to page
	e.enqueue(queued, older)
	lost := e.orders("lost", 1, time.Now().Add(-time.Hour))
	r := NewReconciler(ReconcilerConfig{Keys: e.keys, Grace: 5 * time.Minute, PageSize: 5},
		e.rdb, e.store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 || e.status(lost[0]) != "closed" {
		t.Fatalf("one pass closed %d, lost order is %s; want it closed behind %d queued orders (page size 5)", n, e.status(lost[0]), len(queued))
	}
	for _, s := range queued {
		if st := e.status(s); st != "pending" {
			t.Fatalf("%s is %s, but it is still queued", s, st)
		}
	}
}

