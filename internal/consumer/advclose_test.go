package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Adversarial tests of the slow-row memory (gaps) and the isolation of a
// slow row: see docs/reliability.md.

// A lease under about three statement timeouts (Lease 3 × ST here; an
// operator's 30s lease with the default 10s timeout is the same) leaves a
// batch whose statement the server cut at its timeout (ST) with less than
// the 1.1 × ST that oneByOne needs for a single statement: before the fix
// nothing of the batch was tried alone, every order went back untried, the
// slow row was never found (so never remembered), and the next round went
// the same way — the good orders of a batch holding one row that always
// times out never closed (the reconciler leaves backing-off entries
// alone, so nothing else closed them either).
func TestAdvSlowRowIsFoundWhenTheLeaseLeavesNoTimeToIsolateIt(t *testing.T) {
	e := newEnv(t, orderStatements())
	const st = 100 * time.Millisecond
	e.store.SetTimeouts(st, st/2)
	ctx := context.Background()
	past := e.redisNow().Add(-time.Second)
	poison := e.orders("a-poison", 1, past)
	good := e.orders("b-good", 6, past)
	all := append(append([]string{}, poison...), good...)
	e.enqueue(all, past)
	e.slowClosesOf(poison)
	c := e.consumer(Config{BatchSize: len(all), StatementTimeout: st, Lease: 3 * st, BackoffMax: time.Hour})
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
	for round := 1; round <= rounds && closedGood() < len(good); round++ {
		res, err := c.claimBatch(ctx)
		if err != nil {
			t.Fatalf("round %d claim: %v", round, err)
		}
		if len(res.items) == 0 {
			t.Fatalf("round %d: nothing to claim, %d of %d good orders closed", round, closedGood(), len(good))
		}
		c.process(ctx, res.items)
		t.Logf("round %d: %d claimed, %d statements cut, %d of %d good orders closed", round,
			len(res.items), e.slowCloses(), closedGood(), len(good))
		for _, s := range all {
			if got, err := e.cl.Get(ctx, s); err == nil && got.State == client.StateBackoff {
				e.expire(s)
			}
		}
	}
	if n := closedGood(); n != len(good) {
		t.Fatalf("%d of %d good orders closed after %d rounds: a slow row holds its batch back when the lease leaves no time to isolate it",
			n, len(good), rounds)
	}
	if st := e.status(poison[0]); st != "pending" {
		t.Errorf("the slow row is %s, want pending", st)
	}
	if got, err := e.cl.Get(ctx, poison[0]); err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
		t.Errorf("the slow row: %+v (%v), want backoff with no attempt spent", got, err)
	}
	if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(queue.ReasonCloseFailed)); v != 0 {
		t.Errorf("%v orders dead-lettered", v)
	}
}

// Suspects never hide a row known to be slow (it stays last), a suspect
// that times out alone becomes known (and counts as a new offender once),
// and many distinct suspects stay within the memory's bound.
func TestAdvSuspectsAreBoundedAndNeverDowngradeASlowRow(t *testing.T) {
	var s slowRows
	now := time.Now()
	s.mark("slow", now)
	s.suspect([]string{"slow", "a", "b"}, now)
	if k := s.kind("slow", now); k != rowSlow {
		t.Fatalf("a known slow row became %v when its batch timed out", k)
	}
	if k := s.kind("a", now); k != rowSuspect || s.known("a", now) {
		t.Fatalf("a = %v, want a suspect, not known to be slow", k)
	}
	if !s.mark("a", now) || s.kind("a", now) != rowSlow || s.mark("a", now) {
		t.Fatal("a suspect that times out alone is a new offender once, then known")
	}
	many := make([]string, 3*maxSkipped)
	for i := range many {
		many[i] = "m" + string(rune('A'+i%26)) + time.Duration(i).String()
	}
	s.suspect(many, now)
	if n := s.size(); n > maxSkipped {
		t.Fatalf("%d rows remembered, want at most %d", n, maxSkipped)
	}
	if s.kind("slow", now) != rowSlow {
		t.Fatal("suspects pushed out a known slow row")
	}
	later := now.Add(slowRowMemory + time.Second)
	s.suspect([]string{"late"}, later)
	if s.kind("late", later) != rowSuspect {
		t.Fatal("expired entries were not dropped to make room for a suspect")
	}
}
