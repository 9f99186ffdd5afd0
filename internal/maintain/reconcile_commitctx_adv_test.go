package maintain

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// Adversarial test of c9eb009's COMMIT errors taken for database/sql's own.

// Invariant "in_doubt only when a COMMIT may have been sent", the other
// way round: c9eb009 takes a COMMIT error that is the context's for one
// database/sql raised itself. Here the pass's context ends after the
// COMMIT went out (its answer held by the proxy), and the connection is
// then cut: the COMMIT landed, so the page's orders must be counted in
// doubt, not "nothing closed". Holds on main (lib/pq reports the cut, not
// the context); it fails if the classification looks at ctx.Err() alone.
func TestAdvPassByCommitSentBeforeTheContextEndedIsInDoubt(t *testing.T) {
	e, px := newProxiedEnv(t)
	lost := e.Orders("lost", 3, time.Now().Add(-time.Hour))
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: time.Minute, PageSize: 10},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel+1)))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hit := px.StallOnQuery("COMMIT", time.Minute)
	landed := make(chan bool, 1)
	go func() {
		<-hit
		cancel() // the pass ends while the COMMIT's answer is held
		ok := false
		for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
			var n int
			if e.DB.Get(&n, "SELECT count(*) FROM orders WHERE serial_no = ANY($1) AND status = 'closed'", pq.Array(lost)) == nil && n == len(lost) {
				ok = true
				break
			}
		}
		px.Down()
		landed <- ok
	}()
	n, err := r.RunOnce(ctx)
	if !<-landed {
		t.Fatalf("the COMMIT did not land (RunOnce = %d, %v): the test proved nothing", n, err)
	}
	if err == nil {
		t.Fatalf("RunOnce = %d, nil: the COMMIT's answer never came", n)
	}
	if n != 0 || testutil.ToFloat64(e.m.Reconciled) != 0 {
		t.Errorf("RunOnce = %d, reconciled_total %v: no answer said the COMMIT landed", n, testutil.ToFloat64(e.m.Reconciled))
	}
	if v := testutil.ToFloat64(e.m.InDoubt); v != float64(len(lost)) {
		t.Errorf("in_doubt_total %v, want %d: the COMMIT was sent and landed (%v)", v, len(lost), err)
	}
	var d *orders.InDoubtError
	if !errors.As(err, &d) {
		t.Errorf("RunOnce's error %v is no InDoubtError", err)
	}
}
