package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
)

// Errors that one row can cause while the database is up: a shop's trigger
// that fails a serialization check (40001) or deadlocks (40P01) on one
// order, or one order whose close is slow enough that the server's
// statement timeout cuts the statement (57014). They are transient — the
// same order may close later — but they are the row's, so a batch that
// holds it must not be held back with it.

// Fast path: the batch is split until the row is alone; the other 19 close
// in this round, the row backs off with no attempt spent.
func TestContendedRowIsIsolatedFromItsBatch(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(e *env, serial string)
	}{
		{"serialization failure", func(e *env, s string) { e.FailClose(s, "40001") }},
		{"deadlock", func(e *env, s string) { e.FailClose(s, "40P01") }},
		{"statement timeout", func(e *env, s string) { e.SlowCloseOf(s) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, orderStatements())
			e.Store.SetTimeouts(300*time.Millisecond, 50*time.Millisecond)
			ctx := context.Background()
			past := e.RedisNow().Add(-time.Second)
			serials := e.Orders("contended", 20, past)
			e.Enqueue(serials, past)
			bad := serials[7]
			tc.setup(e, bad)
			c := e.consumer(Config{BatchSize: 20, StatementTimeout: 300 * time.Millisecond, Lease: 30 * time.Second})
			c.stopping = make(chan struct{})
			res := claimN(t, c, 20)
			c.process(ctx, res.items)
			if got := e.StatusCounts(); got["closed"] != 19 || got["pending"] != 1 {
				t.Fatalf("statuses %v, want the 19 other orders closed in this round", got)
			}
			if v := testutil.ToFloat64(e.m.Closed); v != 19 {
				t.Errorf("closed_total %v after 19 orders closed one by one, want 19", v)
			}
			got, err := e.cl.Get(ctx, bad)
			if err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
				t.Fatalf("the contended order: %+v (%v), want backoff with 0 attempts", got, err)
			}
			if n := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues("close_failed")); n != 0 {
				t.Errorf("%v orders dead-lettered: a transient error is not the order's fault", n)
			}
		})
	}
}

// Fast path, a database slow for every row: one statement for the batch,
// maxCostly orders alone, then the batch backs off as for an outage
// (postgres down, no attempt spent) instead of timing out order by order.
func TestFastPathBacksOffADatabaseSlowForEveryRow(t *testing.T) {
	e := newEnv(t, orderStatements())
	e.Store.SetTimeouts(100*time.Millisecond, 50*time.Millisecond)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("slow", 64, past)
	e.Enqueue(serials, past)
	e.SlowEveryClose()
	c := e.consumer(Config{BatchSize: 64, StatementTimeout: 100 * time.Millisecond, Lease: 3 * time.Second})
	c.stopping = make(chan struct{})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 64 {
		t.Fatalf("claim: %v, %d", err, len(res.items))
	}
	c.process(ctx, res.items)
	if k := e.SlowCloses(); k != 1+maxCostly {
		t.Errorf("%d statements cut by the timeout for one batch, want %d", k, 1+maxCostly)
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 0 {
		t.Errorf("dependency_up{postgres} = %v, want 0: every row timing out is a slow database", v)
	}
	for _, s := range serials {
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
			t.Fatalf("%s: %+v (%v), want backoff with 0 attempts", s, got, err)
		}
	}
}

// A row that stays contended costs less and less: the retry delay grows
// with how overdue the order is (no attempt is spent, so attempts cannot
// drive it).
func TestContendedRetryDelayGrowsWithLateness(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	now := e.RedisNow()
	fresh := e.Orders("fresh", 1, now)[0]
	old := e.Orders("old", 1, now)[0]
	e.Enqueue([]string{fresh}, now.Add(-time.Second))
	e.Enqueue([]string{old}, now.Add(-time.Hour))
	e.FailClose(fresh, "40001")
	if _, err := e.DB.Exec(`CREATE OR REPLACE FUNCTION refuse_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' THEN
    RAISE EXCEPTION 'shop trigger: try later' USING ERRCODE = '40001';
  END IF;
  RETURN NEW;
END $$`); err != nil {
		t.Fatal(err)
	}
	c := e.consumer(Config{BatchSize: 1, BackoffMax: 10 * time.Minute})
	c.stopping = make(chan struct{})
	for range 2 {
		res, err := c.claimBatch(ctx)
		if err != nil || len(res.items) != 1 {
			t.Fatalf("claim: %v", err)
		}
		c.process(ctx, res.items)
	}
	until := func(s string) time.Duration {
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
			t.Fatalf("%s: %+v (%v), want backoff with 0 attempts", s, got, err)
		}
		return got.Until.Sub(now)
	}
	if d := until(fresh); d > 2*time.Second {
		t.Errorf("an order a second overdue waits %v, want about a second", d)
	}
	if d := until(old); d < 4*time.Minute || d > 11*time.Minute {
		t.Errorf("an order an hour overdue waits %v, want 5 to 10 minutes (half of BackoffMax to BackoffMax)", d)
	}
}

// One order whose close times out, claimed alone (low traffic, or back
// from its own retry), is a slow row: postgres stays up and the order
// waits the contended backoff, which grows with how overdue it is — not
// the dependency backoff, which any success elsewhere resets.
func TestLoneSlowRowIsNotTakenForADownDatabase(t *testing.T) {
	e := newEnv(t, orderStatements())
	e.Store.SetTimeouts(100*time.Millisecond, 50*time.Millisecond)
	ctx := context.Background()
	past := e.RedisNow().Add(-10 * time.Minute)
	slow := e.Orders("slow", 1, past)[0]
	e.SlowCloseOf(slow)
	e.Enqueue([]string{slow}, past)
	c := e.consumer(Config{BatchSize: 1, StatementTimeout: 100 * time.Millisecond, Lease: 3 * time.Second, BackoffMax: time.Hour})
	c.stopping = make(chan struct{})
	e.m.SetUp(metrics.DepPostgres, true)
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v %d", err, len(res.items))
	}
	now := e.RedisNow()
	c.process(ctx, res.items)
	got, err := e.cl.Get(ctx, slow)
	if err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
		t.Fatalf("%+v (%v), want backoff with 0 attempts", got, err)
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("dependency_up{postgres} = %v: one slow row marked the database down", v)
	}
	// Ten minutes overdue: half of that, with jitter down to half again.
	if d := got.Until.Sub(now); d < 2*time.Minute {
		t.Errorf("retried in %v, want the contended backoff (2.5 to 5 minutes)", d)
	}
}
