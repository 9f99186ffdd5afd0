package maintain

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
)

// The reconciler's page transaction meets the database too slow for the
// pass, in the two ways the fast path once took for the orders' fault
// (731edeb): a BEGIN that answers only after the pass's deadline (the
// driver cannot cut a BEGIN; PostgreSQL's answers held at a proxy), and a
// statement the pass's deadline cuts while the server runs it
// (orders.CutWhileRunning) in the middle of closing a page order by order
// (isolating a contended row). Either way the pass ends with a transient
// error and nothing is blamed on an order: none skipped or remembered in
// the skip set, none reported with its serial, no error counted inside the
// pass (Run counts the pass), nothing committed from the page; and the next
// pass, the database answering again, closes every lost order but the one
// the shop's trigger refuses. Pinned: it holds as it is.
func TestReconcilerDeadlineInsideAPassIsTheDatabases(t *testing.T) {
	const pass = 400 * time.Millisecond
	for _, tc := range []struct {
		name string
		// setup makes the pass's deadline pass: stalling the proxy, or
		// making the close of slow (a row after the contended one) outlast
		// it.
		setup func(e *env, stall func(time.Duration), contended, slow string)
	}{
		{"BEGIN answered after the deadline", func(e *env, stall func(time.Duration), _, _ string) {
			stall(3 * pass)
		}},
		{"statement cut while it ran, closing order by order", func(e *env, _ func(time.Duration), contended, slow string) {
			e.FailClose(contended, "40001")
			e.CloseTrigger("slow_close", "NEW.serial_no = '"+slow+"'", "PERFORM pg_sleep(5)")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, px := newProxiedEnv(t)
			ctx := context.Background()
			lost := e.Orders("lost", 12, time.Now().Add(-10*time.Minute))
			contended, slow := lost[2], lost[7]
			core, logs := observer.New(zap.WarnLevel)
			r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 16, PassTimeout: pass},
				e.RDB, e.Store, e.m, zap.New(core))
			// The pool has its connection before the fault, as a running
			// daemon's has.
			if err := e.Store.DB().PingContext(ctx); err != nil {
				t.Fatal(err)
			}
			tc.setup(e, px.Stall, contended, slow)
			n, err := r.RunOnce(ctx)
			if err == nil || !orders.Transient(err) || n != 0 {
				t.Fatalf("pass = %d, %v (Transient %v); want the pass to end with a transient error, nothing closed", n, err, orders.Transient(err))
			}
			t.Logf("pass: %v", err)
			if len(r.skip) != 0 {
				t.Errorf("orders remembered as failing: %v, want none", r.skip)
			}
			for _, s := range []string{slow, lost[0], lost[11]} {
				if k := logs.FilterField(zap.String("serial", s)).Len(); k != 0 {
					t.Errorf("%s reported as failing %d times: %v", s, k, logs.All())
				}
			}
			if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageReconcile)); v > 1 {
				// The contended row of the second case counts once.
				t.Errorf(`errors_total{stage="reconcile"} = %v inside the pass, want at most the contended row's`, v)
			}
			for _, s := range lost {
				if st := e.Status(s); st != "pending" {
					t.Errorf("%s is %s after a pass that failed, want pending", s, st)
				}
			}
			px.Stall(0)
			e.DB.MustExec(`DROP TRIGGER IF EXISTS slow_close ON orders`)
			// The next pass gets a deadline no busy machine misses: what it
			// shows is that the failed pass left nothing behind, not that
			// twelve closes fit in 400 ms.
			r.loop.PassTimeout = time.Minute
			n, err = r.RunOnce(ctx)
			want := len(lost)
			if e.Status(contended) == "pending" {
				want-- // the shop's trigger still refuses it
			}
			if err != nil || n != want {
				t.Errorf("next pass = %d, %v; want %d closed", n, err, want)
			}
		})
	}
}
