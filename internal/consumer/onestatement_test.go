package consumer

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// countingEnv is an env whose order store counts the statements it sends.
func countingEnv(t *testing.T, stmts orders.Statements) (*env, *testenv.Statements) {
	t.Helper()
	e := newRedisEnv(t)
	var st *testenv.Statements
	e.DB, _, st = testenv.CountingPostgres(t)
	e.Store = orders.NewStore(e.DB, stmts)
	return e, st
}

// Issue 13 item 4: with the reference schema's statements, a batch whose
// orders all have rows — pending, paid, already closed — is closed and
// settled by one statement (BEGIN and COMMIT aside): no lookup after the
// commit, no query of its own for the transaction id.
func TestBatchClosesAndSettlesInOneStatement(t *testing.T) {
	t.Parallel()
	e, st := countingEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("one", 20, past)
	if _, err := e.DB.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = ANY($1)`,
		anyArray(serials[3], serials[11])); err != nil {
		t.Fatal(err)
	}
	if _, err := e.DB.Exec(`UPDATE orders SET status = 'closed' WHERE serial_no = $1`, serials[17]); err != nil {
		t.Fatal(err)
	}
	e.Enqueue(serials, past)
	c := e.consumer(Config{BatchSize: 20})
	res := claimN(t, c, 20)
	before := st.N()
	c.process(ctx, res.items)
	if n := st.N() - before; n != 1 {
		t.Errorf("the batch sent %d statements, want 1: %q", n, st.Since(before))
	}
	if got := e.StatusCounts(); got["closed"] != 18 || got["paid"] != 2 {
		t.Errorf("statuses %v, want 18 closed (17 now, 1 before) and 2 paid", got)
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 17 {
		t.Errorf("closed_total %v, want 17", v)
	}
	if v := testutil.ToFloat64(e.m.Skipped.WithLabelValues(metrics.SkipSettled)); v != 3 {
		t.Errorf("skipped{settled} %v, want 3 (two paid, one closed before)", v)
	}
	if n := e.card(e.Keys.Queue) + e.held(); n != 0 {
		t.Errorf("%d entries left in the queue or held, want none: every order is settled", n)
	}
}

// A serial with no row in the close's snapshot is asked again after the
// commit (the lookup): the only case that costs a second statement. It is
// retried with an attempt spent, as before.
func TestBatchAsksAgainOnlyForSerialsWithoutARow(t *testing.T) {
	t.Parallel()
	e, st := countingEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("row", 5, past)
	e.Enqueue(append(serials, "norow-1"), past)
	c := e.consumer(Config{BatchSize: 20})
	res := claimN(t, c, 6)
	before := st.N()
	c.process(ctx, res.items)
	if n := st.N() - before; n != 2 {
		t.Errorf("the batch sent %d statements, want 2 (the close, then the lookup of the one without a row): %q", n, st.Since(before))
	}
	got, err := e.cl.Get(ctx, "norow-1")
	if err != nil || got.State != client.StateBackoff || got.Attempts != 1 {
		t.Errorf("the serial without a row: %+v (%v), want backoff with 1 attempt", got, err)
	}
	if got := e.StatusCounts(); got["closed"] != 5 {
		t.Errorf("statuses %v, want 5 closed", got)
	}
}

// Custom statements keep the two-statement path: the close, its
// transaction id, then the lookup of what it did not close.
func TestCustomStatementsKeepTheLookup(t *testing.T) {
	t.Parallel()
	stmts := orderStatements()
	stmts.Lookup = `SELECT serial_no, status = 'pending' FROM orders WHERE serial_no = ANY($1::text[])`
	e, st := countingEnv(t, stmts)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("custom", 4, past)
	if _, err := e.DB.Exec(`UPDATE orders SET status = 'paid' WHERE serial_no = $1`, serials[0]); err != nil {
		t.Fatal(err)
	}
	e.Enqueue(serials, past)
	c := e.consumer(Config{BatchSize: 20})
	res := claimN(t, c, 4)
	before := st.N()
	c.process(ctx, res.items)
	if n := st.N() - before; n != 3 {
		t.Errorf("the batch sent %d statements, want 3 (close, transaction id, lookup): %q", n, st.Since(before))
	}
	if v := testutil.ToFloat64(e.m.Skipped.WithLabelValues(metrics.SkipSettled)); v != 1 {
		t.Errorf("skipped{settled} %v, want 1", v)
	}
	if got := e.StatusCounts(); got["closed"] != 3 {
		t.Errorf("statuses %v, want 3 closed", got)
	}
}

func anyArray(ss ...string) any { return pq.Array(ss) }

// An order paid while the close waits for its row (the payment held the
// lock): the update re-checks the newest row and leaves it alone; the one
// statement saw it pending, so it cannot call it settled and asks the
// lookup after the commit, which sees it paid: settled in this round, its
// entry removed, the rest of the batch closed.
func TestOrderPaidWhileTheCloseWaitsIsSettledByTheLookup(t *testing.T) {
	t.Parallel()
	e, st := countingEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("race", 3, past)
	e.Enqueue(serials, past)
	pay, err := e.DB.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer pay.Rollback() //nolint:errcheck
	var payPID int
	if err := pay.Get(&payPID, `SELECT pg_backend_pid()`); err != nil {
		t.Fatal(err)
	}
	if _, err := pay.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1`, serials[1]); err != nil {
		t.Fatal(err)
	}
	c := e.consumer(Config{BatchSize: 20})
	res := claimN(t, c, 3)
	before := st.N()
	processed := make(chan struct{})
	go func() { defer close(processed); c.process(ctx, res.items) }()
	e.waitBlockedBy(t, payPID)
	if err := pay.Commit(); err != nil {
		t.Fatal(err)
	}
	<-processed
	var sent []string // the consumer's, not the test's polls of pg_stat_activity
	for _, q := range st.Since(before) {
		if !strings.Contains(q, "pg_stat_activity") {
			sent = append(sent, q)
		}
	}
	if len(sent) != 2 {
		t.Errorf("%d statements, want 2 (the close, then the lookup of the order paid while it ran): %q", len(sent), sent)
	}
	if got := e.StatusCounts(); got["closed"] != 2 || got["paid"] != 1 {
		t.Fatalf("statuses %v, want the paid order left alone and the other two closed", got)
	}
	if v := testutil.ToFloat64(e.m.Skipped.WithLabelValues(metrics.SkipSettled)); v != 1 {
		t.Errorf("skipped{settled} %v, want 1", v)
	}
	if n := e.card(e.Keys.Queue) + e.held(); n != 0 {
		t.Errorf("%d entries left, want none: the paid order is settled", n)
	}
}
