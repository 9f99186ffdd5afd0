package consumer

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// slowClosesOf makes the close of each of serials sleep five seconds (any
// short statement timeout cuts it), counting the statements that reached
// one of them in the sequence slow_closes.
func (e *env) slowClosesOf(serials []string) {
	e.t.Helper()
	if _, err := e.db.Exec(`CREATE SEQUENCE slow_closes`); err != nil {
		e.t.Fatal(err)
	}
	e.closeTrigger("slow_close", "NEW.serial_no IN ('"+strings.Join(serials, "','")+"')",
		"PERFORM nextval('slow_closes'); PERFORM pg_sleep(5)")
}

// Three rows whose close always hits the statement timeout, in one batch
// with ten good orders, ahead of them (the claim hands out expired
// backoffs first, and equal deadlines in serial order, so poison rows
// that keep coming back lead their batch). Before the fix every round
// went the same way: the batch timed out, the first two rows alone timed
// out, and the rest — the third row and every good order — went back
// untried while the worker backed off as for a down database; the good
// orders never closed. Now a row that timed out alone is remembered and
// tried alone, after the rest of its batch, and timeouts of rows already
// known to be slow (or any order closing in between) say nothing about
// the database.
func TestPoisonRowsAheadOfTheirBatchDoNotHoldItBack(t *testing.T) {
	e := newEnv(t, orderStatements())
	e.store.SetTimeouts(100*time.Millisecond, 50*time.Millisecond)
	ctx := context.Background()
	past := e.redisNow().Add(-time.Second)
	poison := e.orders("a-poison", 3, past)
	good := e.orders("b-good", 10, past)
	all := append(append([]string{}, poison...), good...)
	e.enqueue(all, past)
	e.slowClosesOf(poison)
	c := e.consumer(Config{BatchSize: len(all), StatementTimeout: 100 * time.Millisecond, Lease: 3 * time.Second})
	c.stopping = make(chan struct{})
	closedGood := func() int {
		n := 0
		for _, s := range good {
			if e.status(s) == "closed" {
				n++
			}
		}
		return n
	}
	const rounds = 4
	cut := 0
	for round := 1; round <= rounds; round++ {
		res, err := c.claimBatch(ctx)
		if err != nil || len(res.items) == 0 {
			t.Fatalf("round %d claim: %v, %d items", round, err, len(res.items))
		}
		c.process(ctx, res.items)
		k := e.slowCloses()
		t.Logf("round %d: %d claimed, %d statements cut, %d of %d good orders closed, postgres up %v", round,
			len(res.items), k-cut, closedGood(), len(good), testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)))
		if k-cut > 1+2*maxCostly {
			t.Errorf("round %d cut %d statements, want at most %d", round, k-cut, 1+2*maxCostly)
		}
		cut = k
		if round >= 2 {
			break
		}
		// Every backoff ends now (the data moves, not the clock), in the
		// order the claim then reads them: serial order.
		for _, s := range all {
			if got, err := e.cl.Get(ctx, s); err == nil && got.State == client.StateBackoff {
				e.expire(s)
			}
		}
	}
	if n := closedGood(); n != len(good) {
		t.Fatalf("%d of %d good orders closed after two rounds: poison rows ahead of them hold them back", n, len(good))
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("dependency_up{postgres} = %v: rows known to be slow, with good orders closing, are not a down database", v)
	}
	for _, s := range poison {
		if st := e.status(s); st != "pending" {
			t.Errorf("%s is %s, want pending", s, st)
		}
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
			t.Errorf("%s: %+v (%v), want backoff with no attempt spent", s, got, err)
		}
	}
	if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(queue.ReasonCloseFailed)); v != 0 {
		t.Errorf("%v orders dead-lettered", v)
	}
}

// Rows known to be slow are tried alone, each a statement of its own, never
// in a batch statement with good orders, and at most maxCostly of them
// per batch; the others go back on the contended backoff (growing with
// lateness), not at once.
func TestKnownSlowRowsAreTriedAloneAfterTheirBatch(t *testing.T) {
	e := newEnv(t, orderStatements())
	e.store.SetTimeouts(100*time.Millisecond, 50*time.Millisecond)
	ctx := context.Background()
	past := e.redisNow().Add(-10 * time.Minute)
	poison := e.orders("a-poison", 4, past)
	good := e.orders("b-good", 5, past)
	all := append(append([]string{}, poison...), good...)
	e.enqueue(all, past)
	e.slowClosesOf(poison)
	c := e.consumer(Config{BatchSize: len(all), StatementTimeout: 100 * time.Millisecond, Lease: 3 * time.Second, BackoffMax: time.Hour})
	c.stopping = make(chan struct{})
	for _, s := range poison {
		c.slow.mark(s, c.now())
	}
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != len(all) {
		t.Fatalf("claim: %v, %d", err, len(res.items))
	}
	now := e.redisNow()
	c.process(ctx, res.items)
	for _, s := range good {
		if st := e.status(s); st != "closed" {
			t.Errorf("%s is %s, want closed by the batch's own statement", s, st)
		}
	}
	if k := e.slowCloses(); k != maxCostly {
		t.Errorf("%d statements cut, want %d (the known rows alone, up to the budget)", k, maxCostly)
	}
	for _, s := range poison {
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
			t.Fatalf("%s: %+v (%v), want backoff with 0 attempts", s, got, err)
		}
		// Ten minutes overdue: 2.5 to 5 minutes, tried or not.
		if d := got.Until.Sub(now); d < 2*time.Minute {
			t.Errorf("%s retried in %v, want the contended backoff", s, d)
		}
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("dependency_up{postgres} = %v, want 1", v)
	}
}

// The memory of slow rows is bounded, forgets a row once it closes, and
// forgets it after a while.
func TestSlowRowMemoryIsBounded(t *testing.T) {
	var s slowRows
	now := time.Now()
	if !s.mark("x", now) || s.mark("x", now) {
		t.Fatal("mark reports the first time only")
	}
	if !s.known("x", now) || s.known("x", now.Add(slowRowMemory+time.Second)) {
		t.Fatal("a row is known until slowRowMemory after its last timeout")
	}
	s.forget("x")
	if s.known("x", now) {
		t.Fatal("forget")
	}
	for i := range maxSkipped + 10 {
		s.mark(fmt.Sprint(i), now)
	}
	if n := s.size(); n > maxSkipped {
		t.Fatalf("%d rows remembered, want at most %d", n, maxSkipped)
	}
	// Expired entries make room.
	if !s.mark("late", now.Add(slowRowMemory+time.Second)) || !s.known("late", now.Add(slowRowMemory+time.Second)) {
		t.Fatal("expired entries were not dropped to make room")
	}
}
