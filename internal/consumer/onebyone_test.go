package consumer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/internal/metrics"
)

// fixedDependencyBackoff is a dependency backoff of d every time, so a
// test can tell the worker's wait from the statements' time.
func fixedDependencyBackoff(d time.Duration) *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.RandomizationFactor, b.Multiplier = d, d, 0, 1
	return b
}

// Rows whose close always times out at the front of a backlog's batch (the
// claim hands out expired retries first, so rows that keep coming back lead
// their batch) are the rows', not the database's: two of them timing out
// alone, one after the other, while the database answers a read of them at
// once, must not mark PostgreSQL down nor make the worker wait out the
// dependency backoff. Before the fix every round that met two of them did
// both — k such rows in a row gave about k/2 rounds of "PostgreSQL down",
// and even a round that closed every good order between them ended so.
func TestOneByOneSlowRowsAtTheFrontAreNotAnOutage(t *testing.T) {
	for _, nSlow := range []int{2, 4} {
		t.Run(fmt.Sprintf("%d slow rows", nSlow), func(t *testing.T) {
			e := newEnv(t, orderStatements())
			const st = 100 * time.Millisecond
			e.store.SetTimeouts(st, st/2)
			past := e.redisNow().Add(-time.Second)
			slow := e.orders("a-slow", nSlow, past)
			good := e.orders("b-good", 12, past)
			e.enqueue(append(append([]string{}, slow...), good...), past)
			e.slowClosesOf(slow)
			c := e.consumer(Config{BatchSize: nSlow + len(good), StatementTimeout: st, Lease: 3 * time.Second})
			// The wait is not cut (stopping stays open), and lasts 3 s:
			// far longer than a round's statements.
			const wait = 3 * time.Second
			c.pgBack = fixedDependencyBackoff(wait)
			c.stopping = make(chan struct{})
			ctx := context.Background()
			closedGood := func() int {
				n := 0
				for _, s := range good {
					if e.status(s) == "closed" {
						n++
					}
				}
				return n
			}
			rounds := nSlow/2 + 1
			downs, waited, cut := 0, 0, 0
			for round := 1; round <= rounds && closedGood() < len(good); round++ {
				e.m.SetUp(metrics.DepPostgres, true)
				res, err := c.claimBatch(ctx)
				if err != nil || len(res.items) == 0 {
					t.Fatalf("round %d claim: %v, %d", round, err, len(res.items))
				}
				start := time.Now()
				c.process(ctx, res.items)
				took := time.Since(start)
				down := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)) == 0
				if down {
					downs++
				}
				if took >= wait {
					waited++
				}
				k := e.slowCloses()
				t.Logf("round %d: %d orders, %d statements cut, %d of %d good orders closed, postgres down %v, round took %v",
					round, len(res.items), k-cut, closedGood(), len(good), down, took.Round(time.Millisecond))
				cut = k
				e.dueAll()
			}
			if n := closedGood(); n < len(good) {
				t.Errorf("%d of %d good orders closed after %d rounds", n, len(good), rounds)
			}
			if downs > 0 || waited > 0 {
				t.Errorf("%d slow rows ahead of %d good orders: PostgreSQL marked down in %d rounds, the worker waited out the dependency backoff (%v) in %d: "+
					"rows that time out alone while the database answers were taken for a slow database", nSlow, len(good), downs, wait, waited)
			}
			e.assertSlowRowsKept(t, slow)
		})
	}
}
