package maintain

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// cancelAfterFence cancels the reconciler's pass right after the queue
// answered its fence (the first script the client runs once armed): the
// state a fence answered after the pass's context ended leaves (go-redis
// does not cut a read when a context ends; a shutdown cancels the pass
// while Redis is slow to answer).
type cancelAfterFence struct {
	armed  atomic.Bool
	fired  atomic.Bool
	cancel context.CancelFunc
}

func (h *cancelAfterFence) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *cancelAfterFence) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, c redis.Cmder) error {
		err := next(ctx, c)
		if n := c.Name(); (n == "evalsha" || n == "eval") && err == nil && h.armed.Load() && h.fired.CompareAndSwap(false, true) {
			h.cancel()
		}
		return err
	}
}
func (h *cancelAfterFence) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// Invariant "closes reported = rows closed", reconciler: the fast path's
// close takes a fence answered after its context ended for the queue's
// error, with nothing committed and no COMMIT to ask about (bab3799,
// TestFenceAnsweredAfterTheDeadlineIsTheQueues). The reconciler's page has
// its own fence (inQueue, after the close statement and before COMMIT);
// answered after the pass's context ended (a shutdown, the pass timeout),
// database/sql has rolled the page back and never sends the COMMIT, so no
// order closed and none may be counted in doubt
// (orderdelay_orders_in_doubt_total: "a COMMIT whose answer was lost").
func TestAdvReconcilerFenceAnsweredAfterThePassEndedIsNoCommitInDoubt(t *testing.T) {
	e := newEnv(t, orderStatements())
	lost := e.Orders("late-fence", 3, time.Now().Add(-time.Hour))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hook := &cancelAfterFence{cancel: cancel}
	rdb := redis.NewClient(e.RDB.Options())
	t.Cleanup(func() { rdb.Close() })
	rdb.AddHook(hook)
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: time.Minute, PageSize: 10},
		rdb, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	r.afterClose = func(closed []string) {
		if len(closed) > 0 {
			hook.armed.Store(true) // the next script is the fence
		}
	}
	n, err := r.RunOnce(ctx)
	if !hook.fired.Load() {
		t.Fatalf("RunOnce = %d, %v: the fence never ran, the test proved nothing", n, err)
	}
	for _, s := range lost {
		if st := e.Status(s); st != "pending" {
			t.Fatalf("%s is %s: a page whose context ended before its COMMIT committed", s, st)
		}
	}
	if err == nil || n != 0 {
		t.Fatalf("RunOnce = %d, %v; want an error and nothing closed", n, err)
	}
	if v := testutil.ToFloat64(e.m.InDoubt); v != 0 {
		t.Errorf("in_doubt_total %v, want 0: no COMMIT was sent (the fence answered after the pass ended), yet the page's "+
			"%d closes were counted as a COMMIT whose answer was lost (RunOnce: %v)", v, len(lost), err)
	}
	var d *orders.InDoubtError
	if errors.As(err, &d) {
		t.Errorf("RunOnce's error is an InDoubtError (%v): nothing could have committed", err)
	}
	if v := testutil.ToFloat64(e.m.Reconciled); v != 0 {
		t.Errorf("reconciled_total %v, want 0", v)
	}
	// The next pass closes them.
	if n, err := r.RunOnce(context.Background()); err != nil || n != len(lost) {
		t.Fatalf("next pass closed %d (%v), want %d", n, err, len(lost))
	}
}
