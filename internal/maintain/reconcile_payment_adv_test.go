package maintain

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

// Invariant (b), reconciler: a checkout's payment is in flight — its
// transaction has marked the order paid and holds the row, not committed
// yet — when the reconciler's pass reads its page of overdue orders the
// queue lost. The reconciler must neither wait for the payment nor close
// the order: it passes the row by (SKIP LOCKED), closes the rest, and once
// the payment commits the order is paid, also after another pass.
func TestAdvReconcilerLeavesAnOrderWhosePaymentIsInFlight(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	lost := e.Orders("pay", 5, time.Now().Add(-time.Hour))
	paying := lost[2]
	pay, err := e.DB.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pay.Rollback() //nolint:errcheck // committed below
	if _, err := pay.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1 AND status = 'pending'`, paying); err != nil {
		t.Fatal(err)
	}
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: time.Minute, PageSize: 10},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != len(lost)-1 {
		t.Errorf("closed %d, want %d: all but the order being paid", n, len(lost)-1)
	}
	if err := pay.Commit(); err != nil {
		t.Fatal(err)
	}
	if n, err := r.RunOnce(ctx); err != nil || n != 0 {
		t.Errorf("second pass closed %d, %v; want 0, nil", n, err)
	}
	for _, s := range lost {
		want := "closed"
		if s == paying {
			want = "paid"
		}
		if st := e.Status(s); st != want {
			t.Errorf("%s is %s, want %s", s, st, want)
		}
	}
}
