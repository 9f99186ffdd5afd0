package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/client"
)

// Errors that one row can cause while the database is up: a shop's trigger
// that fails a serialization check (40001) or deadlocks (40P01) on one
// order, or one order whose close is slow enough that the server's
// statement timeout cuts the statement (57014). They are transient — the
// same order may close later — but they are the row's, so a batch that
// holds it must not be held back with it.

// slowCloseOf makes the close of serial sleep for five seconds (a shop's
// trigger calling out, a hot row): any short statement timeout cuts the
// statement that closes it, and only that one.
func (e *env) slowCloseOf(serial string) {
	e.t.Helper()
	_, err := e.db.Exec(`CREATE FUNCTION slow_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND NEW.serial_no = '` + serial + `' THEN
    PERFORM pg_sleep(5);
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER slow_close BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION slow_close();`)
	if err != nil {
		e.t.Fatal(err)
	}
}

// Fast path: the batch is split until the row is alone; the other 19 close
// in this round, the row backs off with no attempt spent.
func TestContendedRowIsIsolatedFromItsBatch(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(e *env, serial string)
	}{
		{"serialization failure", func(e *env, s string) { e.failClose(s, "40001") }},
		{"deadlock", func(e *env, s string) { e.failClose(s, "40P01") }},
		{"statement timeout", func(e *env, s string) { e.slowCloseOf(s) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, orderStatements())
			e.store.SetTimeouts(300*time.Millisecond, 50*time.Millisecond)
			ctx := context.Background()
			past := e.redisNow().Add(-time.Second)
			serials := e.orders("contended", 20, past)
			e.enqueue(serials, past)
			bad := serials[7]
			tc.setup(e, bad)
			c := e.consumer(Config{BatchSize: 20, StatementTimeout: 300 * time.Millisecond, Lease: 30 * time.Second})
			c.stopping = make(chan struct{})
			res, err := c.claimBatch(ctx)
			if err != nil || len(res.items) != 20 {
				t.Fatalf("claim: %v, %d items", err, len(res.items))
			}
			c.process(ctx, res.items)
			if got := e.statusCounts(); got["closed"] != 19 || got["pending"] != 1 {
				t.Fatalf("statuses %v, want the 19 other orders closed in this round", got)
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

// Reconciler: the page is bisected under its savepoint, the row is skipped
// for this pass and reported, and every other lost order is closed.
func TestReconcilerIsolatesAContendedOrder(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(e *env, serial string)
	}{
		{"serialization failure", func(e *env, s string) { e.failClose(s, "40001") }},
		{"statement timeout", func(e *env, s string) { e.slowCloseOf(s) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, orderStatements())
			e.store.SetTimeouts(300*time.Millisecond, 50*time.Millisecond)
			ctx := context.Background()
			bad := e.orders("contended", 1, time.Now().Add(-time.Hour))[0]
			lost := e.orders("lost", 20, time.Now().Add(-10*time.Minute))
			tc.setup(e, bad)
			core, logs := observer.New(zap.WarnLevel)
			r := NewReconciler(ReconcilerConfig{Keys: e.keys, Grace: 5 * time.Minute, PageSize: 8}, e.rdb, e.store, e.m, zap.New(core))
			n, err := r.RunOnce(ctx)
			if err != nil {
				t.Fatalf("pass: %v (one order's transient failure must not end the pass)", err)
			}
			if n != len(lost) {
				t.Errorf("the pass closed %d orders, want %d", n, len(lost))
			}
			if st := e.status(bad); st != "pending" {
				t.Errorf("the contended order is %s, want pending", st)
			}
			if k := logs.FilterField(zap.String("serial", bad)).Len(); k != 1 {
				t.Errorf("the contended order was reported %d times, want 1; logs: %v", k, logs.All())
			}
		})
	}
}

// A database slow for every row is not bisected through the whole page: the
// pass ends after a bounded number of statement timeouts, as it did before
// contended errors were isolated.
func TestReconcilerStopsBisectingWhenEveryRowTimesOut(t *testing.T) {
	e := newEnv(t, orderStatements())
	e.store.SetTimeouts(100*time.Millisecond, 50*time.Millisecond)
	ctx := context.Background()
	lost := e.orders("slow", 64, time.Now().Add(-10*time.Minute))
	_, err := e.db.Exec(`CREATE SEQUENCE slow_closes;
CREATE FUNCTION slow_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' THEN
    PERFORM nextval('slow_closes');
    PERFORM pg_sleep(5);
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER slow_close BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION slow_close();`)
	if err != nil {
		t.Fatal(err)
	}
	r := NewReconciler(ReconcilerConfig{Keys: e.keys, Grace: 5 * time.Minute, PageSize: 64}, e.rdb, e.store, e.m, zap.NewNop())
	n, err := r.RunOnce(ctx)
	if err == nil || n != 0 {
		t.Fatalf("pass = %d, %v; want the pass to end with the timeout", n, err)
	}
	var statements int
	if err := e.db.Get(&statements, `SELECT last_value FROM slow_closes`); err != nil {
		t.Fatal(err)
	}
	// 64 orders: a budget of 2*(7+1) = 16 timeouts, then the pass ends
	// (a full bisection would run 127 statements).
	if statements > 17 {
		t.Errorf("%d statements timed out in one pass, want at most 17", statements)
	}
	for _, s := range lost {
		if st := e.status(s); st != "pending" {
			t.Fatalf("%s is %s, want pending", s, st)
		}
	}
}
