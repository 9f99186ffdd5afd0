package consumer

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

func TestRunClosesDueUnpaidOrdersOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	now := e.RedisNow()
	due := e.Orders("due", 1200, now.Add(-time.Second))
	paid := e.Orders("paid", 100, now.Add(-time.Second))
	future := e.Orders("future", 50, now.Add(time.Hour))
	if _, err := e.DB.Exec("UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no LIKE 'paid-%'"); err != nil {
		t.Fatal(err)
	}
	e.Enqueue(due, now.Add(-time.Second))
	e.Enqueue(paid, now.Add(-time.Second))
	e.Enqueue(future, now.Add(time.Hour))

	c := e.consumer(Config{BatchSize: 100, Workers: 3})
	stop := runConsumer(t, c)
	eventually(t, "due entries settled", 30*time.Second, func() bool {
		return e.card(e.Keys.Queue) == int64(len(future)) && e.held() == 0
	})
	stop()
	got := e.StatusCounts()
	if got["closed"] != len(due) || got["paid"] != len(paid) || got["pending"] != len(future) {
		t.Fatalf("statuses %v, want closed %d, paid %d, pending %d", got, len(due), len(paid), len(future))
	}
	if v := testutil.ToFloat64(e.m.Closed); v != float64(len(due)) {
		t.Errorf("orders_closed_total %v, want %d", v, len(due))
	}
	if v := testutil.ToFloat64(e.m.Skipped.WithLabelValues(metrics.SkipSettled)); v != float64(len(paid)) {
		t.Errorf("skipped{settled} %v, want %d", v, len(paid))
	}
	var early int
	if err := e.DB.Get(&early, "SELECT count(*) FROM orders WHERE closed_at < expires_at"); err != nil || early != 0 {
		t.Errorf("%d orders closed before their deadline (err %v)", early, err)
	}
	if v := testutil.ToFloat64(e.m.Inflight); v != 0 {
		t.Errorf("inflight gauge %v after drain, want 0", v)
	}
}

func TestScannerWakesForAPublishedEarlierDeadline(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	// A long scan interval and no head check: only the wake-up can make the
	// close prompt.
	c := e.consumer(Config{ScanInterval: time.Hour, HeadCheck: -1})
	serials := e.Orders("wake", 1, time.Now())
	stop := runConsumer(t, c)
	// Let the scanner go to sleep on an empty queue first.
	eventually(t, "first scan", 10*time.Second, func() bool { return testutil.ToFloat64(e.m.LastScan) > 0 })
	deadline := time.Now().Add(300 * time.Millisecond)
	if _, _, err := e.cl.Enqueue(ctx, serials[0], deadline, client.Create); err != nil {
		t.Fatal(err)
	}
	eventually(t, "order closed after a wake-up", 20*time.Second, func() bool { return e.Status(serials[0]) == "closed" })
	stop()
	var lateMs float64
	if err := e.DB.Get(&lateMs, "SELECT extract(epoch FROM closed_at - expires_at) * 1000 FROM orders WHERE serial_no = $1", serials[0]); err != nil {
		t.Fatal(err)
	}
	if lateMs < 0 {
		t.Fatalf("closed %.1f ms before its deadline", -lateMs)
	}
	t.Logf("closed %.1f ms after its deadline", lateMs)
}

func TestHeadCheckNoticesRawProducers(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	c := e.consumer(Config{ScanInterval: time.Hour, HeadCheck: 20 * time.Millisecond})
	serials := e.Orders("raw", 1, time.Now())
	stop := runConsumer(t, c)
	eventually(t, "first scan", 10*time.Second, func() bool { return testutil.ToFloat64(e.m.LastScan) > 0 })
	e.Enqueue(serials, time.Now().Add(200*time.Millisecond))
	eventually(t, "raw-ZADD order closed without waiting for the scan interval", 20*time.Second,
		func() bool { return e.Status(serials[0]) == "closed" })
	stop()
}

func TestOrderWithoutRowIsRetriedThenDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	e.Enqueue([]string{"ghost-1"}, e.RedisNow().Add(-time.Second))
	c := e.consumer(Config{MaxAttempts: 3})
	for attempt := 1; attempt <= 3; attempt++ {
		res, err := c.claimBatch(ctx)
		if err != nil || len(res.items) != 1 {
			t.Fatalf("attempt %d: claim %v, %d items", attempt, err, len(res.items))
		}
		c.process(ctx, res.items)
		got, err := e.cl.Get(ctx, "ghost-1")
		if err != nil {
			t.Fatal(err)
		}
		if attempt < 3 {
			if got.State != client.StateBackoff || got.Attempts != attempt {
				t.Fatalf("after attempt %d: %s with %d attempts, want backoff with %d", attempt, got.State, got.Attempts, attempt)
			}
			if d := time.Until(got.Until); d < 400*time.Millisecond {
				t.Fatalf("after attempt %d: retry in %s, want at least half of the first backoff", attempt, d)
			}
			// Move the retry time into the past rather than waiting for it.
			e.RDB.ZAdd(ctx, e.Keys.Inflight, redis.Z{Score: 1, Member: "ghost-1"})
			continue
		}
		if got.State != client.StateDead || got.Reason != queue.ReasonNotFound || got.Attempts != 3 {
			t.Fatalf("after the last attempt: %+v, want dead, not_found, 3 attempts", got)
		}
	}
	if v := testutil.ToFloat64(e.m.Skipped.WithLabelValues(metrics.SkipNotFound)); v != 3 {
		t.Errorf("skipped{not_found} %v, want 3", v)
	}
	if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(queue.ReasonNotFound)); v != 1 {
		t.Errorf("dead_lettered{not_found} %v, want 1", v)
	}
	if v := testutil.ToFloat64(e.m.Reclaimed); v != 0 {
		t.Errorf("reclaimed_total %v: a backoff retry is not a re-claim", v)
	}
}

// poisonClose fails with division by zero for any serial starting "poison".
const poisonClose = `UPDATE orders SET status = 'closed', closed_at = now()
WHERE serial_no = ANY($1) AND status = 'pending'
  AND (CASE WHEN serial_no LIKE 'poison%' THEN 1/(length(serial_no) - length(serial_no)) ELSE 1 END) = 1
RETURNING serial_no`

func TestPermanentErrorIsIsolatedByBisection(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orders.Statements{Close: poisonClose})
	ctx := context.Background()
	now := e.RedisNow()
	good := e.Orders("good", 99, now.Add(-time.Second))
	bad := e.Orders("poison", 1, now.Add(-time.Second))
	e.Enqueue(append(append([]string{}, good[:50]...), append(bad, good[50:]...)...), now.Add(-time.Second))
	c := e.consumer(Config{BatchSize: 100})
	res := claimN(t, c, 100)
	c.process(ctx, res.items)
	if got := e.StatusCounts(); got["closed"] != 99 || got["pending"] != 1 {
		t.Fatalf("statuses %v, want 99 closed and the poison pending", got)
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 99 {
		t.Errorf("closed_total %v after the halves closed 99, want 99: each half counts its own closes", v)
	}
	dead, err := e.cl.Get(ctx, bad[0])
	if err != nil || dead.State != client.StateDead || dead.Reason != queue.ReasonCloseFailed ||
		!strings.Contains(dead.LastError, "division by zero") {
		t.Fatalf("poison entry %+v (%v), want dead with close_failed and the error", dead, err)
	}
	if n := e.held() + e.card(e.Keys.Queue); n != 0 {
		t.Fatalf("%d entries left in the queue", n)
	}
}

// slowClose sleeps past any short statement timeout.
const slowClose = `SELECT s FROM unnest($1::text[]) s WHERE length(s) + (SELECT 0 FROM pg_sleep(5)) < 0`

func TestTransientErrorRetriesWithoutSpendingAnAttempt(t *testing.T) {
	e := newEnv(t, orders.Statements{Close: slowClose})
	// The server cuts the statement (57014): the answer is definite.
	e.Store.SetTimeouts(100*time.Millisecond, 25*time.Millisecond)
	ctx := context.Background()
	e.Orders("slow", 1, time.Now())
	e.Enqueue([]string{"slow-00000"}, e.RedisNow().Add(-time.Second))
	c := e.consumer(Config{StatementTimeout: 100 * time.Millisecond})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v", err)
	}
	c.stopping = make(chan struct{}) // not shutting down
	e.m.SetUp(metrics.DepPostgres, true)
	c.process(ctx, res.items)
	got, err := e.cl.Get(ctx, "slow-00000")
	if err != nil {
		t.Fatal(err)
	}
	if got.State != client.StateBackoff || got.Attempts != 0 {
		t.Fatalf("after a timeout: %s with %d attempts, want backoff with 0", got.State, got.Attempts)
	}
	// One order timing out is taken for a slow row, not a slow database
	// (two orders of a batch timing out alone are: see
	// TestFastPathBacksOffADatabaseSlowForEveryRow).
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("dependency_up{postgres} = %v after one order timed out, want 1", v)
	}
	if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClose)); v != 1 {
		t.Errorf("errors_total{close} = %v, want 1", v)
	}
}

// lockedClose waits for an advisory lock the test holds.
const lockedClose = `SELECT s FROM unnest($1::text[]) s
WHERE length(s) + (SELECT 0 FROM pg_advisory_xact_lock(4242)) < 0`

func TestShutdownHandsBackUnfinishedClaims(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orders.Statements{Close: lockedClose})
	ctx := context.Background()
	now := e.RedisNow()
	serials := e.Orders("drain", 10, now.Add(-time.Second))
	e.Enqueue(serials, now.Add(-time.Second))
	lock, err := e.DB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_lock(4242)"); err != nil {
		t.Fatal(err)
	}
	c := e.consumer(Config{DrainTimeout: 300 * time.Millisecond})
	stop := runConsumer(t, c)
	eventually(t, "batch in flight", 10*time.Second, func() bool { return testutil.ToFloat64(e.m.Inflight) == 10 })
	stop()
	if n := e.held(); n != 0 {
		t.Fatalf("%d entries still leased after shutdown, want all handed back", n)
	}
	for _, s := range serials {
		score, err := e.RDB.ZScore(ctx, e.Keys.Queue, s).Result()
		if err != nil || int64(score) != queue.DeadlineMillis(now.Add(-time.Second)) {
			t.Fatalf("%s: score %v (%v), want its true deadline back in the queue", s, int64(score), err)
		}
	}
}

func TestStatsCountLeasedEntriesAsOverdue(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	now := e.RedisNow()
	e.Enqueue([]string{"s-1", "s-2"}, now.Add(-10*time.Second))
	e.Enqueue([]string{"s-3"}, now.Add(-time.Second))
	e.Enqueue([]string{"s-4"}, now.Add(time.Hour))
	c := e.consumer(Config{BatchSize: 1})
	if _, err := c.claimBatch(ctx); err != nil { // leases s-1 or s-2
		t.Fatal(err)
	}
	e.RDB.ZAdd(ctx, e.Keys.Dead, redis.Z{Score: 1, Member: "d-1"})
	st, err := queue.ReadStats(ctx, e.RDB, e.Keys)
	if err != nil {
		t.Fatal(err)
	}
	if st.Depth != 4 || st.Overdue != 3 || st.DeadLetters != 1 {
		t.Fatalf("stats %+v, want depth 4, overdue 3, dead 1", st)
	}
	if st.OldestDue < 9900*time.Millisecond || st.OldestDue > time.Minute {
		t.Errorf("oldest overdue %s, want about 10s", st.OldestDue)
	}
	if st.NextDeadline.UnixMilli() != queue.DeadlineMillis(now.Add(time.Hour)) {
		t.Errorf("next deadline %s, want %s", st.NextDeadline, now.Add(time.Hour))
	}
}

// A batch the drain's cut reaches before its BEGIN was sent (on a loaded
// machine the worker can take longer than the drain timeout to get
// there): the BEGIN fails with the cancelled context, which the close's
// own-deadline rule took for a database that did not answer — the batch
// was retried (backing off, still held) and PostgreSQL marked down,
// instead of handed back (TestShutdownHandsBackUnfinishedClaims flaked
// on it under load).
func TestCutBeforeBeginHandsTheBatchBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	due := e.RedisNow().Add(-time.Second)
	serials := e.Orders("cut", 5, due)
	e.Enqueue(serials, due)
	c := e.consumer(Config{BatchSize: 10})
	e.m.SetUp(metrics.DepPostgres, true)
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != len(serials) {
		t.Fatalf("claim: %v, %d", err, len(res.items))
	}
	workCtx, cut := context.WithCancel(ctx)
	cut() // the drain timeout passed before the worker sent its BEGIN
	c.processClaim(workCtx, res.items, time.Now())
	if n := e.held(); n != 0 {
		t.Errorf("%d entries still held after the cut, want all handed back", n)
	}
	for _, s := range serials {
		score, err := e.RDB.ZScore(ctx, e.Keys.Queue, s).Result()
		if err != nil || int64(score) != queue.DeadlineMillis(due) {
			t.Errorf("%s: queue score %v (%v), want its deadline %d", s, score, err, queue.DeadlineMillis(due))
		}
		if st := e.Status(s); st != "pending" {
			t.Errorf("%s is %s, want pending", s, st)
		}
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("PostgreSQL marked down by a shutdown's cut")
	}
}
