package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/maintain"
)

// The reconciler (internal/maintain) beside the consumer: the orders the
// consumer holds are the fast path's, never the safety net's.

func TestReconcilerClosesOnlyOrdersTheQueueLost(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	longAgo := time.Now().Add(-time.Hour)
	lost := e.Orders("lost", 1200, longAgo)                       // Redis lost them
	queued := e.Orders("queued", 5, longAgo)                      // a backlog: still in the queue
	leased := e.Orders("leased", 5, longAgo)                      // a replica holds them
	recent := e.Orders("recent", 5, time.Now().Add(-time.Minute)) // within the grace
	e.Enqueue(queued, longAgo)
	e.Enqueue(leased, longAgo)
	// Lease the "leased" group: a replica is working on them.
	if err := e.RDB.ZRem(ctx, e.Keys.Queue, anys(queued)...).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.consumer(Config{BatchSize: 5})
	if res, err := c.claimBatch(ctx); err != nil || len(res.items) != len(leased) {
		t.Fatalf("claim: %v", err)
	}
	e.Enqueue(queued, longAgo)
	r := maintain.NewReconciler(maintain.ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 100},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != len(lost) {
		t.Fatalf("reconciled %d orders, want %d", n, len(lost))
	}
	for _, group := range [][]string{queued, leased, recent} {
		for _, s := range group {
			if st := e.Status(s); st != "pending" {
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
