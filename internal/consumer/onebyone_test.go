package consumer

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
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

// stallOnSettle is a Store that calls stall just before its nth Settle
// (from 1) goes to the database.
type stallOnSettle struct {
	Store
	n     int64
	calls atomic.Int64
	stall func()
}

func (s *stallOnSettle) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	if s.calls.Add(1) == s.n {
		s.stall()
	}
	return s.Store.Settle(ctx, serials, fence)
}

// PostgreSQL stalls (its answers held back) while oneByOne isolates a row:
// the BEGIN of an order tried alone answers after the batch's budget, an
// outage; or its connections are cut there. The orders of the batch
// oneByOne had not tried yet must be sent back before the worker waits out
// the dependency backoff — due after it, before the orders it tried, with
// no attempt spent — not left leased for the whole wait (where their lease
// runs out and another replica takes them over as if this one had died)
// and retried only after it. Shutdown during the wait ends it at once,
// with nothing of the batch still this replica's.
func TestOneByOneBeginStallSendsTheRestBackBeforeTheWait(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fault func(px *testenv.Proxy, st time.Duration)
	}{
		{"BEGIN answered past the batch's budget", func(px *testenv.Proxy, st time.Duration) { px.Stall(5 * st) }},
		{"connections cut", func(px *testenv.Proxy, _ time.Duration) { px.Down() }},
	} {
		t.Run(tc.name, func(t *testing.T) { testOneByOneOutageSendsTheRestBack(t, tc.fault) })
	}
}

func testOneByOneOutageSendsTheRestBack(t *testing.T, fault func(px *testenv.Proxy, st time.Duration)) {
	e, px := newProxiedEnv(t)
	const st = 400 * time.Millisecond // the first good order must start within 1.25 × ST of the batch (its deadline its own)
	e.store.SetTimeouts(st, st/2)
	past := e.redisNow().Add(-time.Second)
	bad := e.orders("a-bad", 1, past)[0]
	good := e.orders("b-good", 6, past)
	e.enqueue([]string{bad}, past.Add(-time.Second))
	e.enqueue(good, past)
	// A serialization failure of one row: the batch goes order by order
	// at once (it costs no timeout).
	e.failClose(bad, "40001")
	// Lease 6 × ST: the batch has 3.5 × ST, an order alone 2.25 × ST.
	c := e.consumer(Config{Owner: "A", BatchSize: 7, StatementTimeout: st, Lease: 6 * st})
	const wait = 5 * time.Second // well past the lease
	c.pgBack = fixedDependencyBackoff(wait)
	stop := make(chan struct{})
	c.stopping = stop
	// Settle 1 is the batch, 2 the bad row alone, 3 the first good order
	// alone: the fault comes just before it (a stall of 5 × ST: its BEGIN
	// answers past its deadline and the batch's).
	c.store = &stallOnSettle{Store: e.store, n: 3, stall: func() { fault(px, st) }}
	b := e.consumer(Config{Owner: "B", BatchSize: 7, StatementTimeout: st, Lease: 6 * st})
	ctx := context.Background()
	e.m.SetUp(metrics.DepPostgres, true)
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 7 || res.items[0].serial != bad {
		t.Fatalf("claim: %v, %d", err, len(res.items))
	}
	claimed, err := e.cl.Get(ctx, good[1])
	if err != nil || claimed.State != client.StateLeased {
		t.Fatalf("after the claim: %+v (%v)", claimed, err)
	}
	leaseEnd := claimed.Until
	done := make(chan struct{})
	start := time.Now()
	go func() { defer close(done); c.process(ctx, res.items) }()
	eventually(t, "PostgreSQL marked down by the stall", 10*time.Second, func() bool {
		return testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)) == 0
	})
	select {
	case <-done:
		t.Fatal("the round ended without waiting out the dependency backoff: the test proved nothing")
	default:
	}
	// A is in its wait now. Where are the orders?
	state := map[string]client.Entry{}
	for _, s := range append([]string{bad}, good...) {
		got, err := e.cl.Get(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		state[s] = got
		t.Logf("%s while A waits: %s, until %v, %d attempts", s, got.State, got.Until.Sub(e.redisNow()).Round(time.Millisecond), got.Attempts)
	}
	rest := good[1:]
	for _, s := range rest {
		if got := state[s]; got.State != client.StateBackoff || got.Attempts != 0 {
			t.Errorf("%s, not tried yet, while A waits out the dependency backoff: %s (%d attempts), want backoff with 0 attempts: sent back before the wait", s, got.State, got.Attempts)
		}
	}
	for _, tried := range []string{good[0], bad} {
		for _, s := range rest {
			if g, r := state[tried], state[s]; g.State == client.StateBackoff && r.State == client.StateBackoff && !r.Until.Before(g.Until) {
				t.Errorf("%s (untried) due at %v, not before %s (tried alone) at %v", s, r.Until, tried, g.Until)
			}
		}
	}
	// Past the batch's lease, A still waiting: another replica must find
	// nothing of it to take over.
	eventually(t, "the batch's lease is over", 10*time.Second, func() bool { return e.redisNow().After(leaseEnd.Add(50 * time.Millisecond)) })
	taken, err := b.claimBatch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(taken.items) > 0 || taken.reclaimed > 0 {
		t.Errorf("B took %d orders (%d of an expired lease) while A waited: A's untried orders were left leased for its wait", len(taken.items), taken.reclaimed)
	}
	// Shutdown during the wait ends it at once, with nothing of the batch
	// still A's.
	close(stop)
	select {
	case <-done:
	case <-time.After(wait):
		t.Fatal("shutdown did not cut the dependency backoff")
	}
	t.Logf("the round took %v", time.Since(start).Round(time.Millisecond))
	b.process(ctx, taken.items)
	for _, s := range append([]string{bad}, good...) {
		if e.status(s) == "closed" {
			continue
		}
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.Attempts != 0 || (got.State == client.StateLeased && got.Owner == res.items[0].token) {
			t.Errorf("%s after A's shutdown: %+v (%v), want not A's, 0 attempts", s, got, err)
		}
	}
	e.assertAllInRedisOrClosed(t, append([]string{bad}, good...))
}
