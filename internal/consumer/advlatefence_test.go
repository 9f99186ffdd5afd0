package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// endingFenceStore ends the close's context inside its fence (end says
// which), then lets the real fence answer: after that end (late: a read
// go-redis does not cut), or meeting it (the call sees the ended context).
type endingFenceStore struct {
	*orders.Store
	end  func(stmtCancel context.CancelFunc)
	late bool
	ran  bool
}

func (s *endingFenceStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	return s.Store.Settle(ctx, serials, func(ctx context.Context, closed []string) ([]string, error) {
		s.ran = true
		s.end(cancel)
		if s.late {
			return fence(context.WithoutCancel(ctx), closed)
		}
		return fence(ctx, closed)
	})
}

// A whole batch whose close's own context (the statement's, not the
// batch's) ends while the fence is out — the fence then answers late, or
// its call meets the ended context — commits nothing, and the consumer
// takes it for what it is: the queue's lateness. PostgreSQL is not marked
// down, nothing is in doubt, nothing is dead-lettered, no attempt is
// spent, and the retry closes each order once (closed_total counts each
// once, closed_at is written once). Shutdown (the work context cancelled
// inside the fence) hands the claim back instead, the orders pending.
func TestAdvFenceOutlivedByTheClosesContext(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name     string
		late     bool
		shutdown bool
	}{
		{"statement's context, late answer", true, false},
		{"statement's context, call meets it", false, false},
		{"shutdown, late answer", true, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, orderStatements())
			past := e.RedisNow().Add(-time.Second)
			serials := e.Orders("outlived", 3, past)
			e.Enqueue(serials, past)
			c := e.consumer(Config{BatchSize: 10})
			e.m.SetUp(metrics.DepPostgres, true) // as after any batch that closed
			workCtx, shutdown := context.WithCancel(context.Background())
			defer shutdown()
			st := &endingFenceStore{Store: e.Store, late: tc.late, end: func(stmtCancel context.CancelFunc) {
				if tc.shutdown {
					shutdown()
				} else {
					stmtCancel()
				}
			}}
			c.store = st
			res := claimN(t, c, len(serials))
			batchCtx, cancelBatch := context.WithCancel(workCtx) // no deadline: the batch's time never runs out here
			defer cancelBatch()
			c.closeItems(workCtx, batchCtx, time.Minute, res.items) //nolint:errcheck // handled inside
			if !st.ran {
				t.Fatal("the close never reached its fence")
			}
			for _, s := range serials {
				if got := e.Status(s); got != "pending" {
					t.Errorf("%s: %s after the fence outlived the close's context, want pending", s, got)
				}
			}
			if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v == 0 {
				t.Errorf("up{postgres} = 0: PostgreSQL marked down for the queue's lateness")
			}
			if v := testutil.ToFloat64(e.m.InDoubt); v != 0 {
				t.Errorf("in_doubt_total = %v, want 0: no COMMIT was sent", v)
			}
			if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClose)); v != 1 {
				t.Errorf("errors_total{close} = %v, want 1", v)
			}
			if v := testutil.ToFloat64(e.m.Closed); v != 0 {
				t.Errorf("closed_total = %v after a close that committed nothing", v)
			}
			if tc.shutdown {
				if n := e.held(); n != 0 {
					t.Errorf("%d entries backing off after shutdown, want the claim handed back", n)
				}
			} else if n := e.held(); n != int64(len(serials)) {
				t.Errorf("%d entries backing off, want %d (retried)", n, len(serials))
			}

			// The retry (or the next claim after the hand-back) closes
			// them, once.
			c.store = e.Store
			var again claimResult
			eventually(t, "the orders come due again", 30*time.Second, func() bool {
				var err error
				again, err = c.claimBatch(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				return len(again.items) > 0
			})
			for _, it := range again.items {
				if it.attempts != 0 {
					t.Errorf("%s claimed again with %d attempts spent, want 0", it.serial, it.attempts)
				}
			}
			c.process(context.Background(), again.items)
			if len(again.items) != len(serials) {
				t.Fatalf("claimed %d again, want %d", len(again.items), len(serials))
			}
			at := map[string]time.Time{}
			for _, s := range serials {
				if got := e.Status(s); got != "closed" {
					t.Errorf("%s: %s after the retry, want closed", s, got)
				}
				at[s] = e.closedAt(s)
				e.assertNoEntries(t, s)
			}
			if v := testutil.ToFloat64(e.m.Closed); v != float64(len(serials)) {
				t.Errorf("closed_total = %v, want %d: each order counted once", v, len(serials))
			}
			for _, r := range []string{queue.ReasonNotFound, queue.ReasonCloseFailed} {
				if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(r)); v != 0 {
					t.Errorf("dead_lettered_total{%s} = %v, want 0", r, v)
				}
			}
			// A stale claim of the same orders (a replica that kept them)
			// finds them settled: closed_at does not move.
			if _, err := e.Store.Settle(context.Background(), serials, nil); err != nil {
				t.Fatal(err)
			}
			for _, s := range serials {
				if got := e.closedAt(s); !got.Equal(at[s]) {
					t.Errorf("%s: closed_at moved from %v to %v: closed twice", s, at[s], got)
				}
			}
		})
	}
}
