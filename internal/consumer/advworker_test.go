package consumer

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
)

// probeHooks is a Store whose Settle calls afterSettle (if set) once the
// nth Settle (from 1) has returned, and whose Lookup calls beforeLookup
// (if set) first.
type probeHooks struct {
	Store
	n            int64
	settles      atomic.Int64
	afterSettle  func(err error)
	beforeLookup func()
	lookups      atomic.Int64
}

func (s *probeHooks) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	out, err := s.Store.Settle(ctx, serials, fence)
	if s.settles.Add(1) == s.n && s.afterSettle != nil {
		s.afterSettle(err)
	}
	return out, err
}

func (s *probeHooks) Lookup(ctx context.Context, serials []string) ([]orders.Found, error) {
	s.lookups.Add(1)
	if s.beforeLookup != nil {
		s.beforeLookup()
	}
	return s.Store.Lookup(ctx, serials)
}

// slowFrontBatch is two rows whose close always times out ahead of four
// good orders, claimed by a consumer whose dependency backoff is a fixed
// wait, not cut by stopping: the round that takes it goes order by order
// and meets the two slow rows first, then probes them.
func slowFrontBatch(t *testing.T, st time.Duration, lease time.Duration) (e *env, c *Consumer, slow, good []string, items []item) {
	e = newEnv(t, orderStatements())
	e.store.SetTimeouts(st, st/2)
	past := e.redisNow().Add(-time.Second)
	slow = e.orders("a-slow", 2, past)
	good = e.orders("b-good", 4, past)
	e.enqueue(append(append([]string{}, slow...), good...), past)
	e.slowClosesOf(slow)
	c = e.consumer(Config{BatchSize: 6, StatementTimeout: st, Lease: lease})
	c.pgBack = fixedDependencyBackoff(3 * time.Second)
	c.stopping = make(chan struct{})
	res, err := c.claimBatch(context.Background())
	if err != nil || len(res.items) != 6 || res.items[0].serial != slow[0] {
		t.Fatalf("claim: %v, %d", err, len(res.items))
	}
	e.m.SetUp(metrics.DepPostgres, true)
	return e, c, slow, good, res.items
}

// Shutdown (the drain timeout ran out: workCtx cancelled) while oneByOne
// probes two rows that timed out alone: the probe fails because the
// process is stopping, which says nothing about the database. PostgreSQL
// must stay up and the untried orders be handed back with their true
// deadlines (as shutdown does everywhere else), not sent to wait out a
// dependency backoff a stopping process invented.
func TestAdvWorkerShutdownDuringTheProbeHandsBack(t *testing.T) {
	const st = 100 * time.Millisecond
	e, c, slow, good, items := slowFrontBatch(t, st, 3*time.Second)
	workCtx, stop := context.WithCancel(context.Background())
	defer stop()
	hooks := &probeHooks{Store: e.store, beforeLookup: stop}
	c.store = hooks
	start := time.Now()
	c.process(workCtx, items)
	took := time.Since(start)
	if hooks.lookups.Load() == 0 {
		t.Fatal("no probe: the test proved nothing")
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("dependency_up{postgres} = %v after a shutdown during the probe, want 1: a stopping process is not a slow database", v)
	}
	ctx := context.Background()
	for _, s := range good {
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.State != client.StateQueued || got.Attempts != 0 {
			t.Errorf("%s, untried, after a shutdown during the probe: %+v (%v), want handed back (queued, 0 attempts)", s, got, err)
		}
	}
	e.assertSlowRowsKept(t, slow)
	t.Logf("the round took %v", took.Round(time.Millisecond))
}

// The reply of the second row that timed out alone comes back with the
// batch's time all used (a loaded machine: the reply read late): the
// probe then has no time at all, and fails on the batch's deadline, not
// its own — no sign the database cannot answer a read within a
// statement's time. That must not be taken for a slow database
// (PostgreSQL down, the worker waiting out the dependency backoff): the
// rest goes back untried, as when the batch's time runs out isolating
// rows.
func TestAdvWorkerProbeWithoutTimeIsNoVerdict(t *testing.T) {
	const st = 100 * time.Millisecond
	e, c, slow, good, items := slowFrontBatch(t, st, 3*time.Second)
	batch, _ := c.batchBudget()
	var start time.Time
	// Settle 1 is the batch, 2 and 3 the slow rows alone.
	hooks := &probeHooks{Store: e.store, n: 3, afterSettle: func(err error) {
		if !orders.TimedOut(err) {
			t.Errorf("the second slow row alone: %v, want a statement timeout", err)
		}
		time.Sleep(time.Until(start.Add(batch + 20*time.Millisecond)))
	}}
	c.store = hooks
	start = time.Now()
	c.process(context.Background(), items)
	took := time.Since(start)
	if hooks.lookups.Load() == 0 {
		t.Fatal("no probe: the test proved nothing")
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("dependency_up{postgres} = %v after a probe the batch left no time, want 1", v)
	}
	if took >= batch+3*time.Second {
		t.Errorf("the round took %v: the worker waited out the dependency backoff (3s) for a probe the batch left no time", took.Round(time.Millisecond))
	}
	ctx := context.Background()
	for _, s := range good {
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.State != client.StateBackoff || got.Attempts != 0 || got.Until.Sub(e.redisNow()) > time.Second {
			t.Errorf("%s, untried: %+v (%v), want backoff due within a second, 0 attempts", s, got, err)
		}
	}
	e.assertSlowRowsKept(t, slow)
}

// The probe that finds the database slow is a lookup statement that
// failed: counted in errors_total{stage="lookup"}, as every failed
// statement is, so the rate of failed statements an operator graphs does
// not leave out the one that marked PostgreSQL down. The orders table
// locked (a migration's ACCESS EXCLUSIVE lock) just after the two rows
// timed out alone: the probe waits on the lock, and fails.
func TestAdvWorkerFailedProbeIsCounted(t *testing.T) {
	const st = 100 * time.Millisecond
	e, c, slow, good, items := slowFrontBatch(t, st, 3*time.Second)
	ctx := context.Background()
	if _, err := e.store.Lookup(ctx, good); err != nil { // prepared before the lock
		t.Fatal(err)
	}
	lock, err := e.db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lock.Rollback() })
	hooks := &probeHooks{Store: e.store, n: 3, afterSettle: func(error) {
		if _, err := lock.Exec(`LOCK TABLE orders IN ACCESS EXCLUSIVE MODE`); err != nil {
			t.Error(err)
		}
	}}
	c.store = hooks
	stopped := make(chan struct{})
	close(stopped)
	c.stopping = stopped // the test needs no wait
	before := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageLookup))
	c.process(ctx, items)
	if hooks.lookups.Load() != 1 {
		t.Fatalf("%d lookups, want the probe alone", hooks.lookups.Load())
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 0 {
		t.Errorf("dependency_up{postgres} = %v with the orders table locked, want 0", v)
	}
	if k := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageLookup)) - before; k != 1 {
		t.Errorf("errors_total{stage=lookup} grew by %v for the failed probe, want 1", k)
	}
	lock.Rollback()
	e.assertSlowRowsKept(t, slow)
	e.assertAllInRedisOrClosed(t, append(append([]string{}, slow...), good...))
}

// failFenceOnSettle is a Store whose nth Settle (from 1) runs with a
// fence that fails as it would with Redis gone: the close rolls back
// (orders.FenceError).
type failFenceOnSettle struct {
	Store
	n     int64
	calls atomic.Int64
}

func (s *failFenceOnSettle) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	if s.calls.Add(1) == s.n {
		fence = func(context.Context, []string) ([]string, error) {
			return nil, errors.New("injected: redis gone during the fence")
		}
	}
	return s.Store.Settle(ctx, serials, fence)
}

// The queue (not the database) goes away while oneByOne tries an order
// alone: its fence fails and the close rolls back. On the away path
// (0601633) that order is held and the untried rest sent back before the
// wait — but the fault is Redis's: PostgreSQL must stay up, no attempt
// is spent, and every order closes on the next round.
func TestAdvWorkerFenceErrorAloneIsNotPostgresDown(t *testing.T) {
	e := newEnv(t, orderStatements())
	const st = 200 * time.Millisecond
	e.store.SetTimeouts(st, st/2)
	past := e.redisNow().Add(-time.Second)
	bad := e.orders("a-bad", 1, past)[0]
	good := e.orders("b-good", 6, past)
	e.enqueue([]string{bad}, past.Add(-time.Second))
	e.enqueue(good, past)
	e.failClose(bad, "40001") // the batch goes order by order at once
	c := e.consumer(Config{BatchSize: 7, StatementTimeout: st, Lease: 10 * st})
	c.pgBack = fixedDependencyBackoff(300 * time.Millisecond)
	c.stopping = make(chan struct{})
	// Settle 1 is the batch, 2 the bad row alone, 3 the first good order.
	store := &failFenceOnSettle{Store: e.store, n: 3}
	c.store = store
	ctx := context.Background()
	e.m.SetUp(metrics.DepPostgres, true)
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 7 || res.items[0].serial != bad {
		t.Fatalf("claim: %v, %d", err, len(res.items))
	}
	start := time.Now()
	c.process(ctx, res.items)
	took := time.Since(start)
	if store.calls.Load() != 3 {
		t.Fatalf("%d closes, want 3: the round went on after the queue went away", store.calls.Load())
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("dependency_up{postgres} = %v after a fence error (Redis's), want 1", v)
	}
	if took < 300*time.Millisecond {
		t.Errorf("the round took %v: the worker did not wait out the dependency backoff for the queue", took)
	}
	state := map[string]client.Entry{}
	for _, s := range append([]string{bad}, good...) {
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
			t.Errorf("%s after the round: %+v (%v), want backoff, 0 attempts", s, got, err)
		}
		state[s] = got
	}
	for _, s := range good[1:] {
		if !state[s].Until.Before(state[good[0]].Until) {
			t.Errorf("%s (untried) due at %v, not before %s (its fence failed) at %v", s, state[s].Until, good[0], state[good[0]].Until)
		}
	}
	c.store = e.store
	e.dueAll()
	again, err := c.claimBatch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c.process(ctx, again.items)
	for _, s := range good {
		if st := e.status(s); st != "closed" {
			t.Errorf("%s is %s after the next round, want closed", s, st)
		}
	}
	e.assertAllInRedisOrClosed(t, append([]string{bad}, good...))
}

// The same outage as TestOneByOneBeginStallSendsTheRestBackBeforeTheWait,
// met by a split instead of oneByOne: a batch fails on one row's data
// (22003, a shop's trigger), is split in halves, and PostgreSQL goes away
// (connections cut) as the first half is closed. The second half, not
// tried yet, must not stay leased while the worker waits out the
// dependency backoff: a wait past its lease has another replica take it
// over as if this one had died.
func TestAdvWorkerSplitOutageSendsTheOtherHalfBackBeforeTheWait(t *testing.T) {
	// at: the Settle the outage comes before (1 the batch, 2 its first
	// half, 3 that half's first half); untried: the good orders put off
	// by then (items 4–7, and 2–3 a level deeper).
	for _, tc := range []struct {
		name    string
		at      int64
		untried []int
	}{
		{"first half", 2, []int{3, 4, 5, 6}},
		{"first quarter", 3, []int{1, 2, 3, 4, 5, 6}},
	} {
		t.Run(tc.name, func(t *testing.T) { testSplitOutage(t, tc.at, tc.untried) })
	}
}

func testSplitOutage(t *testing.T, at int64, untried []int) {
	e, px := newProxiedEnv(t)
	const st = 400 * time.Millisecond
	e.store.SetTimeouts(st, st/2)
	past := e.redisNow().Add(-time.Second)
	bad := e.orders("a-bad", 1, past)[0]
	good := e.orders("b-good", 7, past)
	e.enqueue([]string{bad}, past.Add(-time.Second))
	e.enqueue(good, past)
	e.failClose(bad, "22003")
	c := e.consumer(Config{Owner: "A", BatchSize: 8, StatementTimeout: st, Lease: 6 * st})
	const wait = 5 * time.Second // well past the lease
	c.pgBack = fixedDependencyBackoff(wait)
	stop := make(chan struct{})
	c.stopping = stop
	c.store = &stallOnSettle{Store: e.store, n: at, stall: func() { px.Down() }}
	b := e.consumer(Config{Owner: "B", BatchSize: 8, StatementTimeout: st, Lease: 6 * st})
	ctx := context.Background()
	e.m.SetUp(metrics.DepPostgres, true)
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 8 || res.items[0].serial != bad {
		t.Fatalf("claim: %v, %d", err, len(res.items))
	}
	claimed, err := e.cl.Get(ctx, good[6])
	if err != nil || claimed.State != client.StateLeased {
		t.Fatalf("after the claim: %+v (%v)", claimed, err)
	}
	done := make(chan struct{})
	go func() { defer close(done); c.process(ctx, res.items) }()
	eventually(t, "PostgreSQL marked down by the outage", 10*time.Second, func() bool {
		return testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)) == 0
	})
	select {
	case <-done:
		t.Fatal("the round ended without waiting out the dependency backoff: the test proved nothing")
	default:
	}
	for _, i := range untried {
		s := good[i]
		got, err := e.cl.Get(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		if got.State != client.StateBackoff || got.Attempts != 0 {
			t.Errorf("%s, in the half not tried yet, while A waits out the dependency backoff: %s (%d attempts), want backoff with 0 attempts: sent back before the wait", s, got.State, got.Attempts)
		}
	}
	eventually(t, "the batch's lease is over", 10*time.Second, func() bool { return e.redisNow().After(claimed.Until.Add(50 * time.Millisecond)) })
	taken, err := b.claimBatch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(taken.items) > 0 || taken.reclaimed > 0 {
		t.Errorf("B took %d orders (%d of an expired lease) while A waited: A's untried halves were left leased for its wait", len(taken.items), taken.reclaimed)
	}
	close(stop)
	<-done
	px.Up()
	b.process(ctx, taken.items)
	e.assertAllInRedisOrClosed(t, append([]string{bad}, good...))
}
