package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
)

// A migration that changes the type of a column the prepared statements
// return, between two batches, costs neither batch anything: the second is
// closed in full, nothing is retried, dead-lettered or counted as an error
// (PostgreSQL's 0A000 is the statement's, and the store prepares it again
// before the consumer could take it for a bad order and split the batch).
func TestTableAlteredUnderThePreparedStatementsLosesNoBatch(t *testing.T) {
	t.Parallel()
	for name, stmts := range map[string]orders.Statements{
		"one statement":   orderStatements(),
		"close statement": {Lookup: orders.DefaultLookupSQL + " "},
	} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, stmts)
			ctx := context.Background()
			past := e.RedisNow().Add(-time.Second)
			c := e.consumer(Config{BatchSize: 20})
			for i, ddl := range []string{"", `ALTER TABLE orders ALTER COLUMN serial_no TYPE varchar(128)`} {
				if ddl != "" {
					if _, err := e.DB.Exec(ddl); err != nil {
						t.Fatal(err)
					}
				}
				serials := e.Orders(string(rune('a'+i)), 10, past)
				e.Enqueue(append(serials, string(rune('a'+i))+"-norow"), past)
				res, err := c.claimBatch(ctx)
				if err != nil || len(res.items) != 11 {
					t.Fatalf("claim %d: %v, %d items", i, err, len(res.items))
				}
				c.process(ctx, res.items)
			}
			if got := e.StatusCounts(); got["closed"] != 20 {
				t.Errorf("statuses %v, want 20 closed", got)
			}
			if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClose)); v != 0 {
				t.Errorf("errors_total{stage=close} %v, want 0", v)
			}
			if n := e.card(e.Keys.Dead); n != 0 {
				t.Errorf("%d dead letters, want none", n)
			}
			// Only the two serials without a row are left, retried with
			// the attempt that a missing row costs, not more.
			for _, s := range []string{"a-norow", "b-norow"} {
				got, err := e.cl.Get(ctx, s)
				if err != nil || got.Attempts != 1 {
					t.Errorf("%s: %+v (%v), want one attempt", s, got, err)
				}
			}
		})
	}
}
