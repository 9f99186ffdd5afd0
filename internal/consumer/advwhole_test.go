package consumer

import (
	"context"
	"strings"
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

// Adversarial review (advwhole) of everything since 5ead5a7.

// Invariants "never closed before the latest deadline a producer wrote"
// and "never removed before the close committed", for the work stage the
// daemon now abandons (8cd82c2, lifecycle.Stage.StopWithin): a batch's
// close statement has run at the server (its row updated, its transaction
// idle) when PostgreSQL stops answering; a producer reschedules the
// leased order an hour ahead with a raw ZADD; the stop cuts the batch
// (drain timeout) and the daemon would abandon it. The goroutine is still
// there, and hears the close's answer only later, while the process lives
// on. It must then commit nothing — the fence it would ask is long past
// its batch's time, and the producer's later deadline stands — and its
// hand-back must keep the producer's entry.
func TestAdvWholeAbandonedBatchHeardAfterTheCutCommitsNothing(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	db, viaProxy, _, px := testenv.PostgresViaProxy(t)
	t.Cleanup(func() { px.Stall(0) })
	e.DB = db
	e.closeAudit()
	e.Store = orders.NewStore(viaProxy, orders.Statements{})
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	s := e.Orders("abandon", 1, past)[0]
	// The close is in flight (it sleeps in a trigger, after counting
	// itself in a sequence, which no rollback undoes) when PostgreSQL
	// stops answering.
	if _, err := db.Exec(`CREATE SEQUENCE close_started;
CREATE FUNCTION slow_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' THEN
    PERFORM nextval('close_started');
    PERFORM pg_sleep(0.3);
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER slow_close BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION slow_close();`); err != nil {
		t.Fatal(err)
	}
	e.Enqueue([]string{s}, past)
	core, logs := observer.New(zap.InfoLevel)
	c, err := New(Config{Keys: e.Keys, HeadCheck: 20 * time.Millisecond, Workers: 1, BatchSize: 10,
		StatementTimeout: 5 * time.Second, Lease: 30 * time.Second, DrainTimeout: 100 * time.Millisecond},
		e.RDB, e.Store, e.m, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	go func() { defer close(done); c.Run(runCtx) }()
	eventually(t, "the close in flight", 30*time.Second, func() bool {
		var called bool
		return db.Get(&called, "SELECT is_called FROM close_started") == nil && called
	})
	px.Stall(time.Hour) // every answer PostgreSQL sends from now on is held
	eventually(t, "the close statement done at the server, its answer held", 30*time.Second, func() bool {
		var n int
		err := db.Get(&n, `SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND state = 'idle in transaction' AND backend_xid IS NOT NULL`)
		return err == nil && n == 1
	})
	later := e.RedisNow().Add(time.Hour)
	if err := e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(queue.DeadlineMillis(later)), Member: s}).Err(); err != nil {
		t.Fatal(err)
	}
	cancel()
	eventually(t, "the drain's cut", 30*time.Second, func() bool {
		return logs.FilterMessageSnippet("drain timeout passed").Len() > 0
	})
	select {
	case <-done:
		t.Fatal("Run returned while its batch's close waited on PostgreSQL: the test proved nothing")
	default:
	}
	px.Stall(0) // the abandoned batch hears the close's answer
	<-done

	if st := e.Status(s); st != "pending" {
		t.Errorf("%s is %s: the batch cut by the stop committed its close once it heard PostgreSQL, after a producer moved its deadline an hour ahead", s, st)
	}
	if n := e.audited(); n != 0 {
		t.Errorf("%d closes committed, want 0", n)
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 0 {
		t.Errorf("closed_total %v, want 0", v)
	}
	score, err := e.RDB.ZScore(ctx, e.Keys.Queue, s).Result()
	if err != nil || int64(score) != queue.DeadlineMillis(later) {
		t.Errorf("queue entry of %s: %v, %v; want the producer's deadline %d", s, score, err, queue.DeadlineMillis(later))
	}
	if e.RDB.HExists(ctx, e.Keys.Lease, s).Val() {
		t.Errorf("%s still has a lease record after the hand-back", s)
	}
}

// Invariant "poison never blocks", fast path, for the reconciler's
// TestAdvWholeSessionEndingPoisonPageMatesAreClosed poison: an order whose
// close ends its backend's session (a shop's trigger or extension that
// crashes it). lib/pq answers "bad connection", which the worker took for
// the database's (orders.Transient): the batch was retried whole with a
// dependency backoff, no attempt spent, no split, and its batch mates,
// due with it and claimed with it again every time, were never closed
// (failed before this change). Now the database answers a fresh
// connection at once, so the batch is split down to the order, which is
// retried alone with no attempt spent, round after round, never
// dead-lettered (a session ended from outside looks the same: advsess),
// its row left pending; PostgreSQL is never marked down.
func TestAdvWholeSessionEndingPoisonDoesNotHoldItsBatchMates(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	poison := e.Orders("poison", 1, past)[0]
	good := e.Orders("good", 5, past)
	e.CloseTrigger("kill_close", "NEW.serial_no = '"+poison+"'", "PERFORM pg_terminate_backend(pg_backend_pid())")
	e.Enqueue(append([]string{poison}, good...), past)
	const maxAttempts = 2
	core, logs := observer.New(zap.InfoLevel)
	c := e.consumer(Config{BatchSize: 10, Workers: 1, StatementTimeout: 2 * time.Second, Lease: 10 * time.Second,
		BackoffMax: 50 * time.Millisecond, MaxAttempts: maxAttempts})
	c.log = zap.New(core)
	runConsumer(t, c)
	eventually(t, "the poisonous order's batch mates closed", 20*time.Second, e.allClosed(good))
	eventually(t, "the poisonous order retried alone more often than MaxAttempts", 20*time.Second, func() bool {
		return logs.FilterMessageSnippet("ended its database session while the database answers; retrying it alone").Len() > maxAttempts
	})
	got, err := e.cl.Get(ctx, poison)
	if err != nil || got.State == client.StateDead || got.Attempts != 0 || !strings.Contains(got.LastError, "ended its database session") {
		t.Errorf("entry of %s: %+v (%v); want it kept, no attempt spent, its last error saying its close ended its session", poison, got, err)
	}
	if st := e.Status(poison); st != "pending" {
		t.Errorf("the poisonous order is %s, want pending", st)
	}
	if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(queue.ReasonCloseFailed)); v != 0 {
		t.Errorf("dead_lettered_total{close_failed} %v, want 0", v)
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("PostgreSQL marked down (%v) by one order's close ending its own session", v)
	}
}

// The other side of the same case: the close statement's connection is cut
// while it runs (every connection at the proxy, which then refuses new
// ones: an outage, a failover in progress). The ping finds no database, so
// the batch is not taken for a poisonous order's: it is retried whole after
// the dependency backoff, PostgreSQL marked down, no attempt spent, nothing
// split or dead-lettered; and it closes once the database is back.
func TestAdvWholeSessionCutByAnOutageIsNotAnOrdersFault(t *testing.T) {
	t.Parallel()
	e, px := newProxiedEnv(t)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("cut", 6, past)
	if _, err := e.DB.Exec(`CREATE SEQUENCE close_started`); err != nil {
		t.Fatal(err)
	}
	// Only the first try is slow: the statement is in flight when the
	// proxy goes down.
	e.CloseTrigger("slow_first", "NEW.serial_no = '"+serials[0]+"'",
		"IF nextval('close_started') = 1 THEN PERFORM pg_sleep(2); END IF")
	e.Enqueue(serials, past)
	core, logs := observer.New(zap.InfoLevel)
	c := e.consumer(Config{BatchSize: 10, Workers: 1, StatementTimeout: 5 * time.Second, Lease: 20 * time.Second,
		BackoffMax: 100 * time.Millisecond, MaxAttempts: 2})
	c.log = zap.New(core)
	e.m.SetUp(metrics.DepPostgres, true)
	runConsumer(t, c)
	eventually(t, "the close in flight", 20*time.Second, func() bool {
		var called bool
		return e.DB.Get(&called, "SELECT is_called FROM close_started") == nil && called
	})
	px.Down()
	eventually(t, "the batch given back for the outage", 20*time.Second, func() bool {
		return logs.FilterMessageSnippet("database or queue unavailable").Len() > 0
	})
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 0 {
		t.Errorf("PostgreSQL not marked down by an outage that cut the close")
	}
	for _, s := range serials {
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.Attempts != 0 || got.State == client.StateDead {
			t.Errorf("%s after the cut: %+v (%v); want it kept with no attempt spent", s, got, err)
		}
	}
	px.Up()
	eventually(t, "every order closed once the database is back", 20*time.Second, e.allClosed(serials))
	if n := logs.FilterMessageSnippet("splitting the batch to isolate the order that ends it").Len(); n != 0 {
		t.Errorf("an outage was taken for an order's close ending its session %d times", n)
	}
	if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(queue.ReasonCloseFailed)); v != 0 {
		t.Errorf("dead_lettered_total{close_failed} %v after an outage, want 0", v)
	}
}
