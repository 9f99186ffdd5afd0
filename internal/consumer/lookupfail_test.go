package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// gatedLookup is the reference lookup behind a function that fails its
// first call with SQLSTATE code: the failure is the server's, whatever Go
// code runs the lookup.
func (e *env) gatedLookup(code string) {
	e.T.Helper()
	_, err := e.DB.Exec(`CREATE SEQUENCE lookup_calls;
CREATE FUNCTION lookup_gated(s text[]) RETURNS TABLE (serial_no text, pending boolean) LANGUAGE plpgsql AS $$
BEGIN
  IF nextval('lookup_calls') = 1 THEN
    RAISE EXCEPTION 'injected lookup failure' USING ERRCODE = '` + code + `';
  END IF;
  RETURN QUERY SELECT o.serial_no, o.status = 'pending' FROM orders o WHERE o.serial_no = ANY(s);
END $$;`)
	if err != nil {
		e.T.Fatal(err)
	}
}

// The close commits, then the lookup of the orders it left alone fails.
// The closed orders are removed from the queue at once (never closed
// again, never lost); the others — one paid, one with no row yet — are
// retried without an attempt spent, and settled or looked for again
// then. Whatever the failure says: the connection, one slow row, or the
// data.
func TestLookupFailingAfterACommittedClose(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, code string }{
		{"connection lost", "08006"},
		{"statement timeout", "57014"},
		{"data error", "22000"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, orders.Statements{Lookup: `SELECT * FROM lookup_gated($1)`})
			e.gatedLookup(tc.code)
			ctx := context.Background()
			past := e.RedisNow().Add(-time.Second)
			pending := e.Orders("lookupfail-pending", 3, past)
			paid := e.Orders("lookupfail-paid", 1, past)[0]
			if _, err := e.DB.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1`, paid); err != nil {
				t.Fatal(err)
			}
			missing := "lookupfail-missing-00000"
			e.Enqueue(append([]string{paid, missing}, pending...), past)
			c := e.consumer(Config{StatementTimeout: time.Second, Lease: 10 * time.Second})
			c.stopping = make(chan struct{})
			res, err := c.claimBatch(ctx)
			if err != nil || len(res.items) != 5 {
				t.Fatalf("claim: %v, %d", err, len(res.items))
			}
			c.process(ctx, res.items)
			closedAt := map[string]time.Time{}
			for _, s := range pending {
				if st := e.Status(s); st != "closed" {
					t.Fatalf("%s is %s, want closed", s, st)
				}
				closedAt[s] = e.closedAt(s)
				e.assertNoEntries(t, s)
			}
			if v := testutil.ToFloat64(e.m.Closed); v != 3 {
				t.Errorf("closed_total %v, want 3", v)
			}
			if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageLookup)); v < 1 {
				t.Errorf("errors_total{lookup} %v, want the failure counted", v)
			}
			// The rest, until they are settled: queued again, backing off or
			// settled already (an order-by-order retry in the same batch),
			// never dead-lettered, no attempt spent on the failure.
			for round := 0; ; round++ {
				pend := 0
				for _, s := range []string{paid, missing} {
					got, ok, err := e.st.Get(ctx, s)
					if err != nil {
						t.Fatal(err)
					}
					switch {
					case s == paid && !ok:
					case s == missing && ok && got.State == queue.StateBackoff && got.Attempts == 1:
					case ok && (got.State == queue.StateBackoff || got.State == queue.StateQueued) && got.Attempts == 0:
						pend++
						if got.State == queue.StateBackoff {
							e.expire(s)
						}
					default:
						t.Fatalf("round %d: %s is %+v (found %v), want retried, or settled", round, s, got, ok)
					}
				}
				if pend == 0 {
					break
				}
				if round == 2 {
					t.Fatalf("still not settled after %d rounds", round)
				}
				res, err := c.claimBatch(ctx)
				if err != nil {
					t.Fatal(err)
				}
				c.process(ctx, res.items)
			}
			if got, err := e.cl.Get(ctx, missing); err != nil || got.State != client.StateBackoff {
				t.Errorf("the order with no row: %+v (%v), want backing off (looked for again)", got, err)
			}
			if v := testutil.ToFloat64(e.m.Skipped.WithLabelValues(metrics.SkipSettled)); v != 1 {
				t.Errorf("skipped_total{settled} %v, want 1 (the paid order)", v)
			}
			if v := testutil.ToFloat64(e.m.Closed); v != 3 {
				t.Errorf("closed_total %v at the end, want 3", v)
			}
			for _, r := range []string{queue.ReasonNotFound, queue.ReasonCloseFailed} {
				if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(r)); v != 0 {
					t.Errorf("dead_lettered_total{%s} %v, want 0", r, v)
				}
			}
			for _, s := range pending {
				if at := e.closedAt(s); !at.Equal(closedAt[s]) {
					t.Errorf("%s closed again (%v, then %v)", s, closedAt[s], at)
				}
			}
			if st := e.Status(paid); st != "paid" {
				t.Errorf("the paid order is %s", st)
			}
		})
	}
}
