package consumer

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

// lateFenceStore runs each close's fence only once expire has ended the
// batch's time: a fence whose Redis answered after the batch's deadline.
// late makes the fence's call itself run on, as a read go-redis does not
// cut (its answer comes back after the deadline); else the call meets the
// ended context.
type lateFenceStore struct {
	*orders.Store
	expire func()
	late   bool
	ran    bool
}

func (s *lateFenceStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	return s.Store.Settle(ctx, serials, func(ctx context.Context, closed []string) ([]string, error) {
		s.ran = true
		s.expire()
		if s.late {
			return fence(context.WithoutCancel(ctx), closed)
		}
		return fence(ctx, closed)
	})
}

// A whole batch (no row being isolated) whose fence answers after the
// batch's deadline: nothing commits, the orders are retried, and the log
// says the batch's time ran out waiting for the queue's check before the
// commit — not that it ran out isolating a row.
func TestLateFenceIsLoggedAsSuch(t *testing.T) {
	t.Parallel()
	for _, late := range []bool{true, false} {
		name := map[bool]string{true: "answered after the deadline", false: "called after the deadline"}[late]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, orderStatements())
			past := e.RedisNow().Add(-time.Second)
			serials := e.Orders("latefence", 2, past)
			e.Enqueue(serials, past)
			c := e.consumer(Config{BatchSize: 10})
			core, logs := observer.New(zap.InfoLevel)
			c.log = zap.New(core)
			batchCtx, expire := context.WithCancel(context.Background())
			defer expire()
			st := &lateFenceStore{Store: e.Store, expire: expire, late: late}
			c.store = st
			res := claimN(t, c, len(serials))
			_, stmt := c.batchBudget()
			c.closeItems(context.Background(), batchCtx, stmt, res.items) //nolint:errcheck // handled inside
			if !st.ran {
				t.Fatal("the close never reached its fence")
			}
			for _, s := range serials {
				if got := e.Status(s); got != "pending" {
					t.Errorf("%s: %s after a late fence, want pending (nothing commits)", s, got)
				}
			}
			if n := e.held(); n != int64(len(serials)) {
				t.Errorf("%d entries backing off, want %d (retried)", n, len(serials))
			}
			if n := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClose)); n != 1 {
				t.Errorf("errors_total{close} = %v, want 1", n)
			}
			if n := logs.FilterMessageSnippet("isolating").Len(); n != 0 {
				t.Errorf("%d log lines say a row was being isolated; none was", n)
			}
			if n := logs.FilterMessageSnippet("waiting for the queue's check before the commit").Len(); n != 1 {
				t.Errorf("%d lines say the batch's time ran out waiting for the fence, want 1; the log: %v", n, messages(logs))
			}
		})
	}
}

func messages(logs *observer.ObservedLogs) []string {
	var out []string
	for _, l := range logs.All() {
		out = append(out, l.Message)
	}
	return out
}
