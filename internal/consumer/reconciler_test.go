package consumer

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
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

// An error about the database, not the data (here a read-only error raised
// in the middle of the close, as after a failover), ends the pass: nothing is bisected,
// skipped or reported as a bad order, and the next pass tries again.
func TestReconcilerStopsThePassOnATransientError(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	lost := e.orders("lost", 20, time.Now().Add(-10*time.Minute))
	e.failClose(lost[5], "25006")
	core, logs := observer.New(zap.WarnLevel)
	r := NewReconciler(ReconcilerConfig{Keys: e.keys, Grace: 5 * time.Minute, PageSize: 8}, e.rdb, e.store, e.m, zap.New(core))
	n, err := r.RunOnce(ctx)
	if err == nil || !orders.Transient(err) {
		t.Fatalf("pass = %d, %v; want a transient error", n, err)
	}
	if n != 0 {
		t.Errorf("closed %d before the failing page, want 0 (it is the first page)", n)
	}
	if k := e.closeFailures(); k != 1 {
		t.Errorf("the failing close ran %d times, want 1 (no bisection on a transient error)", k)
	}
	if l := logs.FilterField(zap.String("serial", lost[5])).Len(); l != 0 {
		t.Errorf("the order was reported as failing %d times, want 0: %v", l, logs.All())
	}
	if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageReconcile)); v != 0 {
		t.Errorf(`errors_total{stage="reconcile"} = %v inside RunOnce, want 0 (Run counts the failed pass)`, v)
	}
	for _, s := range lost {
		if st := e.status(s); st != "pending" {
			t.Errorf("%s is %s after a pass that failed, want pending", s, st)
		}
	}
}

// Issue 11 item 3: one order whose close always fails (the oldest overdue
// row, so in every first page) must not stop the reconciler: it is isolated,
// skipped and reported, and every other lost order is closed.
func TestReconcilerIsolatesAnOrderWhoseCloseFails(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	poison := e.orders("poison", 1, time.Now().Add(-time.Hour))[0]
	lost := e.orders("lost", 20, time.Now().Add(-10*time.Minute))
	e.poisonOrder(poison)
	core, logs := observer.New(zap.WarnLevel)
	// Pages of 8: the poison is in the first of three pages.
	r := NewReconciler(ReconcilerConfig{Keys: e.keys, Grace: 5 * time.Minute, PageSize: 8}, e.rdb, e.store, e.m, zap.New(core))
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatalf("first pass: %v (one order's close failing must not fail the pass)", err)
	}
	if n != len(lost) {
		t.Errorf("first pass closed %d orders, want %d", n, len(lost))
	}
	for _, s := range lost {
		if st := e.status(s); st != "closed" {
			t.Errorf("%s is %s after a pass, want closed", s, st)
		}
	}
	if st := e.status(poison); st != "pending" {
		t.Errorf("the poisoned order is %s, want pending", st)
	}
	reported := func() int {
		k := 0
		for _, l := range logs.FilterField(zap.String("serial", poison)).All() {
			if l.Level == zap.WarnLevel && strings.Contains(fmt.Sprint(l.ContextMap()["error"]), "cannot be closed") {
				k++
			}
		}
		return k
	}
	if k := reported(); k != 1 {
		t.Errorf("the poisoned order was reported %d times in the first pass, want 1 Warn with its serial and error; logs: %v", k, logs.All())
	}
	if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageReconcile)); v != 1 {
		t.Errorf(`errors_total{stage="reconcile"} = %v after the first pass, want 1`, v)
	}
	// A later lost order is still reached by a later pass; the poison is
	// reported again and stops nothing.
	later := e.orders("later", 3, time.Now().Add(-6*time.Minute))
	if n, err := r.RunOnce(ctx); err != nil || n != len(later) {
		t.Fatalf("second pass closed %d (%v), want %d", n, err, len(later))
	}
	if k := reported(); k != 2 {
		t.Errorf("the poisoned order was reported %d times after two passes, want 2", k)
	}
	if st := e.status(poison); st != "pending" {
		t.Errorf("the poisoned order is %s, want pending", st)
	}
}

// A producer that re-adds a serial after the reconciler's "missing" check
// but before its commit keeps its order: the check is repeated after the
// close statement ran (rows locked) and what came back — to the queue key,
// a shard's queue key or a lease hash — is not closed; the rest is.
func TestReconcilerFencesSerialsReaddedBeforeCommit(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	all := e.shardKeys(3)
	longAgo := time.Now().Add(-time.Hour)
	lost := e.orders("lost", 10, longAgo)
	readded, leased, sharded := lost[3], lost[7], lost[8]
	back := []string{readded, leased, sharded}
	// A poisoned order in the same page is isolated once, not again when the
	// page is closed a second time.
	poison := lost[0]
	e.poisonOrder(poison)
	r := NewReconciler(ReconcilerConfig{Keys: all[0], Shards: all[1:], Grace: 5 * time.Minute},
		e.rdb, e.store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	hooked := 0
	r.afterClose = func(closed []string) {
		hooked++
		if hooked > 1 {
			return
		}
		// The checkout reschedules one an hour later (raw ZADD), another
		// through a shard key; a replica leases a third.
		later := time.Now().Add(time.Hour)
		e.zadd(all[0].Queue, []string{readded}, later)
		e.zadd(all[2].Queue, []string{sharded}, later)
		if err := e.rdb.HSet(ctx, all[3].Lease, leased, "1|0|r:1|").Err(); err != nil {
			t.Error(err)
		}
	}
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if hooked != 2 {
		t.Errorf("the close ran %d times, want 2 (once, then again without what came back)", hooked)
	}
	for _, s := range back {
		if st := e.status(s); st != "pending" {
			t.Errorf("%s is %s: it was back in Redis before the commit, want pending", s, st)
		}
	}
	if st := e.status(poison); st != "pending" {
		t.Errorf("the poisoned order is %s, want pending", st)
	}
	if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageReconcile)); v != 1 {
		t.Errorf(`errors_total{stage="reconcile"} = %v, want 1 (isolated once, then left out)`, v)
	}
	want := len(lost) - len(back) - 1
	if n != want {
		t.Errorf("closed %d, want %d (all but the ones back in Redis and the poison)", n, want)
	}
	for _, s := range lost {
		if s != poison && !slices.Contains(back, s) && e.status(s) != "closed" {
			t.Errorf("%s is %s, want closed", s, e.status(s))
		}
	}
	if v := testutil.ToFloat64(e.m.Reconciled); v != float64(want) {
		t.Errorf("orders_reconciled_total %v, want %d", v, want)
	}
}
