package consumer

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Adversarial review (advsess) of 82024e8: a close whose statement's
// session ends is pinged and, the database answering, bisected down to the
// order. 82024e8 had that order spend an attempt and dead-lettered it
// after MaxAttempts, which the first test broke (sessions ended from
// outside dead-lettered healthy orders); it is now retried alone with no
// attempt spent, never dead-lettered.

// closeTries counts the close statements' rows reached (a sequence: no
// rollback or ended session undoes it).
func (e *env) closeTries() int {
	e.T.Helper()
	var n int64
	var called bool
	if err := e.DB.QueryRow(`SELECT last_value, is_called FROM close_tries`).Scan(&n, &called); err != nil {
		e.T.Fatal(err)
	}
	if !called {
		return 0
	}
	return int(n)
}

// background runs f in a goroutine until the returned stop is called
// (also at cleanup); f gets a context that stop cancels.
func background(t *testing.T, f func(ctx context.Context)) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); f(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); wg.Wait() }) }
	t.Cleanup(stop)
	return stop
}

// Invariants "never dead-letter an order unless it is poisonous" and
// "never spend attempts on an outage", for the faults that end sessions
// from outside while the database answers a fresh connection at once:
//
//   - an operator's (or a pooler's query_timeout's) watchdog that
//     terminates every statement running longer than 150 ms, on a
//     database slow enough (every close takes 300 ms a row) that each
//     close is one of them — the same slowness cut by the server's own
//     statement_timeout (57014) spends nothing and dead-letters nothing;
//   - a proxy (a load balancer flapping, a Service repointed again and
//     again) that cuts every connection every 100 ms and accepts new ones
//     at once.
//
// Each cut close is followed by a ping that answers, so the batch is
// bisected; at 82024e8 every leaf the next cut landed on spent an attempt,
// and healthy orders were dead-lettered close_failed, never closed once
// the fault was gone (failed there). Contract: whatever number of rounds the fault lasts, no
// order spends an attempt on it; every order closes once it is over.
func TestAdvSessCutsFromOutsideWhileTheDatabaseAnswersDeadLetterNothing(t *testing.T) {
	t.Parallel()
	const maxAttempts = 3
	for _, tc := range []struct {
		name  string
		fault func(ctx context.Context, e *env, px *testenv.Proxy)
	}{
		{"watchdog terminating statements running 150ms", func(ctx context.Context, e *env, _ *testenv.Proxy) {
			for ctx.Err() == nil {
				e.DB.ExecContext(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
  AND state = 'active' AND now() - query_start > interval '150 milliseconds'`) //nolint:errcheck // the watchdog's own errors
				select {
				case <-ctx.Done():
				case <-time.After(20 * time.Millisecond):
				}
			}
		}},
		{"proxy cutting every connection every 100ms", func(ctx context.Context, _ *env, px *testenv.Proxy) {
			for ctx.Err() == nil {
				select {
				case <-ctx.Done():
				case <-time.After(100 * time.Millisecond): // the flap's period: part of the fault
				}
				px.Down()
				px.Up()
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e, px := newProxiedEnv(t)
			past := e.RedisNow().Add(-time.Second)
			serials := e.Orders("slow", 4, past)
			if _, err := e.DB.Exec(`CREATE SEQUENCE close_tries`); err != nil {
				t.Fatal(err)
			}
			// A database under load: every close takes 300 ms a row.
			e.CloseTrigger("slow_db", "true", "PERFORM nextval('close_tries'); PERFORM pg_sleep(0.3)")
			e.Enqueue(serials, past)
			core, logs := observer.New(zap.InfoLevel)
			c := e.consumer(Config{BatchSize: 10, Workers: 1, StatementTimeout: 2 * time.Second, Lease: 10 * time.Second,
				BackoffMax: 50 * time.Millisecond, MaxAttempts: maxAttempts})
			c.log = zap.New(core)
			stopFault := background(t, func(ctx context.Context) { tc.fault(ctx, e, px) })
			runConsumer(t, c)
			// Enough tries for every order to have spent every attempt
			// twice over, had a bisected round spent one each (a round of
			// four takes seven closes); or the first dead letter.
			want := 2 * 2 * len(serials) * maxAttempts
			eventually(t, "the orders tried again and again while the fault lasts", 60*time.Second, func() bool {
				return e.closeTries() >= want || testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(queue.ReasonCloseFailed)) > 0
			})
			stopFault()
			dead := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(queue.ReasonCloseFailed))
			spent := 0
			for _, s := range serials {
				got, err := e.cl.Get(context.Background(), s)
				if err == nil {
					spent += got.Attempts
					if got.State == client.StateDead {
						t.Errorf("healthy order %s dead-lettered by a fault from outside while the database answered: reason %q, %d attempts, last error %q",
							s, got.Reason, got.Attempts, got.LastError)
					}
				}
			}
			t.Logf("%d close tries, %d attempts spent, %v dead-lettered, %d 'retrying it alone' warnings, %d splits",
				e.closeTries(), spent, dead,
				logs.FilterMessageSnippet("retrying it alone").Len(),
				logs.FilterMessageSnippet("splitting the batch to isolate the order that ends it").Len())
			if dead != 0 {
				t.Errorf("dead_lettered_total{close_failed} %v after a fault that never was an order's, want 0", dead)
				return
			}
			if _, err := e.DB.Exec(`DROP TRIGGER slow_db ON orders`); err != nil {
				t.Fatal(err)
			}
			eventually(t, "every order closed once the fault is over", 30*time.Second, func() bool {
				for _, s := range serials {
					if e.Status(s) != "closed" {
						return false
					}
				}
				return true
			})
		})
	}
}

// Invariant "poison never blocks" on oneByOne's path: a batch whose close
// first meets a row a payment holds locked (lock_timeout: contended, so
// the batch goes order by order) and also holds an order whose close ends
// its session. oneByOne must take the session-ender for that order's
// (rowSessionError) and go on: the good orders close, the locked one and
// the session-ender are retried alone with no attempt spent, neither is
// dead-lettered, and PostgreSQL is never marked down.
func TestAdvSessSessionEnderInTheContendedPath(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	locked := e.Orders("a-locked", 1, past)[0]
	good := e.Orders("g-good", 4, past)
	poison := e.Orders("p-poison", 1, past)[0]
	e.CloseTrigger("kill_close", "NEW.serial_no = '"+poison+"'", "PERFORM pg_terminate_backend(pg_backend_pid())")
	payment, err := e.DB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer payment.Rollback() //nolint:errcheck
	if _, err := payment.Exec(`SELECT 1 FROM orders WHERE serial_no = $1 FOR UPDATE`, locked); err != nil {
		t.Fatal(err)
	}
	e.Enqueue(append(append([]string{locked}, good...), poison), past)
	const maxAttempts = 3
	core, logs := observer.New(zap.InfoLevel)
	c := e.consumer(Config{BatchSize: 10, Workers: 1, StatementTimeout: 400 * time.Millisecond, Lease: 5 * time.Second,
		BackoffMax: 50 * time.Millisecond, MaxAttempts: maxAttempts})
	c.log = zap.New(core)
	e.m.SetUp(metrics.DepPostgres, true)
	runConsumer(t, c)
	eventually(t, "the good orders closed", 30*time.Second, e.allClosed(good))
	eventually(t, "the session-ender retried alone more often than MaxAttempts", 30*time.Second, func() bool {
		return logs.FilterMessageSnippet("ended its database session while the database answers; retrying it alone").Len() > maxAttempts
	})
	if got, err := e.cl.Get(ctx, poison); err != nil || got.Attempts != 0 || got.State == client.StateDead {
		t.Errorf("the session-ender: %+v (%v); want it kept, no attempt spent", got, err)
	}
	if logs.FilterMessageSnippet("closing the batch order by order").Len() == 0 {
		t.Errorf("the batch never went order by order: the test proved nothing about oneByOne")
	}
	if got, err := e.cl.Get(ctx, locked); err != nil || got.Attempts != 0 || got.State == client.StateDead {
		t.Errorf("the locked order: %+v (%v); want it kept, no attempt spent", got, err)
	}
	if st := e.Status(locked); st != "pending" {
		t.Errorf("the locked order is %s, want pending", st)
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("PostgreSQL marked down (%v) by one order's close ending its own session on oneByOne's path", v)
	}
	if n := logs.FilterMessageSnippet("database or queue unavailable").Len(); n != 0 {
		t.Errorf("%d batches taken for an outage", n)
	}
}

// Invariants "never mark the database down wrongly" and "poison never
// blocks", at the lookup stage, which the change leaves out: with a custom
// close statement, an order the close did not close (paid already) is
// looked up; a lookup statement that ends its session on one serial (a
// shop's function in its ORDERDELAY_LOOKUP_SQL that crashes or terminates
// its backend on one row) answers "bad connection", which is taken for an
// outage while the database answers everything else: PostgreSQL is marked
// down on every round and the orders looked up with it — paid, settled —
// are never taken out of the queue.
func TestAdvSessLookupThatEndsItsSessionIsNotAnOutage(t *testing.T) {
	t.Parallel()
	stmts := orderStatements()
	stmts.Lookup = `SELECT serial_no, status = 'pending' FROM orders WHERE serial_no = ANY($1) AND lookup_guard(serial_no)`
	e := newEnv(t, stmts)
	past := e.RedisNow().Add(-time.Second)
	poison := e.Orders("a-poison", 1, past)[0]
	paid := e.Orders("b-paid", 3, past)
	if _, err := e.DB.Exec(`UPDATE orders SET status = 'paid' WHERE serial_no LIKE 'a-%' OR serial_no LIKE 'b-%';
CREATE FUNCTION lookup_guard(s text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
  IF s = '` + poison + `' THEN PERFORM pg_terminate_backend(pg_backend_pid()); END IF;
  RETURN true;
END $$;`); err != nil {
		t.Fatal(err)
	}
	e.Enqueue(append([]string{poison}, paid...), past)
	core, logs := observer.New(zap.InfoLevel)
	c := e.consumer(Config{BatchSize: 10, Workers: 1, StatementTimeout: 2 * time.Second, Lease: 10 * time.Second,
		BackoffMax: 50 * time.Millisecond, MaxAttempts: 3})
	c.log = zap.New(core)
	e.m.SetUp(metrics.DepPostgres, true)
	runConsumer(t, c)
	eventually(t, "the paid orders settled, or three rounds taken for outages", 30*time.Second, func() bool {
		gone := 0
		for _, s := range paid {
			if _, err := e.cl.Get(context.Background(), s); err == client.ErrNotFound {
				gone++
			}
		}
		return gone == len(paid) || logs.FilterMessageSnippet("database or queue unavailable").Len() >= 3
	})
	for _, s := range paid {
		if got, err := e.cl.Get(context.Background(), s); err != client.ErrNotFound {
			t.Errorf("paid order %s still in the queue (%+v, %v): its lookup mate's lookup ends its session and is taken for an outage", s, got, err)
		}
	}
	if n := logs.FilterMessageSnippet("database or queue unavailable").Len(); n != 0 {
		t.Errorf("%d rounds took a lookup that ends its own session for an outage while the database answered", n)
	}
}

// countingStore counts a Store's closes and pings.
type countingStore struct {
	*orders.Store
	settles, pings atomic.Int64
	onPing         func() // if set, run before each ping
}

func (s *countingStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	s.settles.Add(1)
	return s.Store.Settle(ctx, serials, fence)
}

func (s *countingStore) Ping(ctx context.Context) error {
	s.pings.Add(1)
	if s.onPing != nil {
		s.onPing()
	}
	return s.Store.Ping(ctx)
}

// Invariant "bounded work per batch": a shop's trigger that ends the
// session of every close (every order of the batch "poisonous"). Each
// failed close is pinged and bisected; the halving tree of a batch of N
// has 2N-1 nodes, so one round runs at most 2N-1 closes and as many
// pings, and ends within its lease; every order is then retried alone,
// no attempt spent, none dead-lettered, none taken for an outage.
func TestAdvSessEveryCloseEndingItsSessionIsBoundedWork(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	const n = 16
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("all", n, past)
	e.CloseTrigger("kill_every_close", "true", "PERFORM pg_terminate_backend(pg_backend_pid())")
	e.Enqueue(serials, past)
	cs := &countingStore{Store: e.Store}
	core, logs := observer.New(zap.InfoLevel)
	c, err := New(Config{Keys: e.Keys, HeadCheck: 20 * time.Millisecond, BatchSize: n, Workers: 1,
		StatementTimeout: 2 * time.Second, Lease: 10 * time.Second, BackoffMax: 50 * time.Millisecond, MaxAttempts: 1},
		e.RDB, cs, e.m, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	close(stop)
	c.stopping = stop // no backoff wait
	e.m.SetUp(metrics.DepPostgres, true)
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != n {
		t.Fatalf("claim: %v, %d", err, len(res.items))
	}
	start := time.Now()
	c.process(ctx, res.items)
	took := time.Since(start)
	t.Logf("batch of %d: %d closes, %d pings, %s", n, cs.settles.Load(), cs.pings.Load(), took.Round(time.Millisecond))
	if s, p := cs.settles.Load(), cs.pings.Load(); s > 2*n-1 || p > s {
		t.Errorf("%d closes and %d pings for a batch of %d, want at most %d closes and no more pings than closes", s, p, n, 2*n-1)
	}
	if took > 10*time.Second {
		t.Errorf("the round took %s, longer than its lease", took)
	}
	if k := logs.FilterMessageSnippet("retrying it alone").Len(); k != n {
		t.Errorf("%d orders retried alone, want all %d", k, n)
	}
	if k := logs.FilterMessageSnippet("database or queue unavailable").Len(); k != 0 {
		t.Errorf("%d rounds taken for an outage", k)
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v == 0 {
		t.Errorf("PostgreSQL marked down")
	}
	for _, s := range serials {
		if st := e.Status(s); st != "pending" {
			t.Errorf("%s is %s, want pending", s, st)
		}
		if got, err := e.cl.Get(ctx, s); err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
			t.Errorf("%s: %+v (%v); want it backing off, no attempt spent", s, got, err)
		}
	}
}

// splitWithPingHook runs a consumer (one worker, batches of 10) over e's
// queue whose first database ping runs hook: the window between a close
// that ended its session and the bisection's closes. It returns the store,
// which counts the pings.
func splitWithPingHook(t *testing.T, e *env, hook func()) *countingStore {
	t.Helper()
	cs := &countingStore{Store: e.Store}
	var once sync.Once
	cs.onPing = func() { once.Do(hook) }
	c, err := New(Config{Keys: e.Keys, HeadCheck: 20 * time.Millisecond, BatchSize: 10, Workers: 1,
		StatementTimeout: 2 * time.Second, Lease: 10 * time.Second, BackoffMax: 50 * time.Millisecond, MaxAttempts: 2},
		e.RDB, cs, e.m, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, c)
	return cs
}

// Invariants "never close before the latest acknowledged deadline" and
// "never close a paid order", in the window the change opens: between the
// close that ended its session and the bisection's closes, the worker
// pings the database. Meanwhile a producer reschedules one batch mate an
// hour ahead (Reschedule, acknowledged) and a payment settles another.
// The bisection's closes must leave both: the rescheduled one pending with
// the producer's deadline, the paid one paid; the others close.
func TestAdvSessRescheduleAndPaymentDuringThePingAreKept(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	poison := e.Orders("a-poison", 1, past)[0]
	moved := e.Orders("b-moved", 1, past)[0]
	paid := e.Orders("c-paid", 1, past)[0]
	good := e.Orders("d-good", 3, past)
	e.CloseTrigger("kill_close", "NEW.serial_no = '"+poison+"'", "PERFORM pg_terminate_backend(pg_backend_pid())")
	e.Enqueue(append([]string{poison, moved, paid}, good...), past)
	later := e.RedisNow().Add(time.Hour)
	cs := splitWithPingHook(t, e, func() {
		if _, _, err := e.cl.Enqueue(ctx, moved, later, client.Reschedule); err != nil {
			t.Error(err)
		}
		if _, err := e.DB.Exec(`UPDATE orders SET status = 'paid' WHERE serial_no = $1`, paid); err != nil {
			t.Error(err)
		}
	})
	eventually(t, "the good orders closed", 30*time.Second, e.allClosed(good))
	if got, err := e.cl.Get(ctx, poison); err != nil || got.Attempts != 0 || got.State == client.StateDead {
		t.Errorf("the session-ender: %+v (%v); want it kept, no attempt spent", got, err)
	}
	if cs.pings.Load() == 0 {
		t.Fatal("no ping: the test proved nothing")
	}
	if st := e.Status(moved); st != "pending" {
		t.Errorf("%s is %s: closed by the bisection after its producer moved its deadline an hour ahead during the ping", moved, st)
	}
	if got, err := e.cl.Get(ctx, moved); err != nil || got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
		t.Errorf("entry of %s: %+v (%v); want the producer's deadline %s", moved, got, err, later)
	}
	if st := e.Status(paid); st != "paid" {
		t.Errorf("%s is %s: a payment during the ping was overwritten", paid, st)
	}
}

// The same window, with the producers the design names beside the Go
// client: a raw ZADD that moves a batch mate an hour ahead (a producer
// writing the queue key itself), and an order enqueued before its row
// committed, whose INSERT commits during the ping. The bisection's closes
// must leave the moved one pending with the raw deadline in the queue
// key, and close the late-committed one once it is there (its missing row
// is retried, not dropped); the session-ender spends no attempt.
func TestAdvSessRawRescheduleAndALateCommitDuringThePing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	poison := e.Orders("a-poison", 1, past)[0]
	moved := e.Orders("b-moved", 1, past)[0]
	good := e.Orders("d-good", 3, past)
	const late = "c-late-00000" // enqueued before its row committed
	e.CloseTrigger("kill_close", "NEW.serial_no = '"+poison+"'", "PERFORM pg_terminate_backend(pg_backend_pid())")
	e.Enqueue(append([]string{poison, moved, late}, good...), past)
	later := queue.DeadlineMillis(e.RedisNow().Add(time.Hour))
	cs := splitWithPingHook(t, e, func() {
		if err := e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(later), Member: moved}).Err(); err != nil {
			t.Error(err)
		}
		if _, err := e.DB.Exec(`INSERT INTO orders (serial_no, expires_at) VALUES ($1, $2)`, late, past); err != nil {
			t.Error(err)
		}
	})
	eventually(t, "the good orders and the late-committed one closed", 30*time.Second, e.allClosed(append(good, late)))
	if cs.pings.Load() == 0 {
		t.Fatal("no ping: the test proved nothing")
	}
	if got, err := e.cl.Get(ctx, poison); err != nil || got.Attempts != 0 || got.State == client.StateDead {
		t.Errorf("the session-ender: %+v (%v); want it kept, no attempt spent", got, err)
	}
	if st := e.Status(moved); st != "pending" {
		t.Errorf("%s is %s: closed by the bisection after a raw ZADD moved its deadline an hour ahead during the ping", moved, st)
	}
	if sc, err := e.RDB.ZScore(ctx, e.Keys.Queue, moved).Result(); err != nil || int64(sc) != later {
		t.Errorf("queue score of %s: %v (%v); want the raw ZADD's %d", moved, sc, err, later)
	}
}
