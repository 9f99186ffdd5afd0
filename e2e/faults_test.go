package e2e

// Fault tests (issue "Never lose an order"): each injects what production
// does to the daemon and then checks the same invariants. Destructive faults
// hit private servers or proxies the test owns, never the shared ones.
// Each has its own database, queue key and private servers, so they run in
// parallel with the other end-to-end tests, except TestFaultSlowDatabase.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

func TestFaultSIGKILLMidBatchRepeatedly(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.withAudit()
	const n = 20000
	w.spread("kill", n, time.Now().Add(500*time.Millisecond), 4*time.Second)
	settings := []string{"ORDERDELAY_CLOSE_SQL=" + auditClose, "ORDERDELAY_LEASE=3s",
		"ORDERDELAY_STATEMENT_TIMEOUT=2s", "ORDERDELAY_DRAIN_TIMEOUT=1s", "ORDERDELAY_BATCH_SIZE=100"}
	kills := 0
	for range 6 {
		d := w.start(settings...)
		// A random moment while batches are in flight: the point of the test.
		time.Sleep(time.Duration(100+rand.N(400)) * time.Millisecond)
		d.kill()
		kills++
	}
	killedAt := time.Now()
	d := w.start(settings...)
	waitFor(t, "queue drained after the kills", 120*time.Second, func() bool { return w.queueLen() == 0 })
	recovery := time.Since(killedAt)
	w.checkInvariants()
	if n := w.closed(); n != 20000 {
		t.Errorf("%d orders closed, want 20000", n)
	}
	if dc := w.doubleCloses(); dc != 0 {
		t.Errorf("%d orders closed twice", dc)
	}
	m := d.metrics()
	t.Logf("%d SIGKILLs; recovered (queue empty) %s after the last, with a 3s lease; the survivor re-claimed %v entries",
		kills, recovery.Round(time.Millisecond), m["orderdelay_reclaimed_total"])
	if m["orderdelay_reclaimed_total"] == 0 {
		t.Errorf("no SIGKILL left a lease behind for the survivor to re-claim: no kill landed mid-batch, and the test proved nothing")
	}
	d.stopCleanly()
}

func TestFaultThreeReplicasOneQueue(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.withAudit()
	const n = 20000
	throughput := map[int]float64{}
	for _, replicas := range []int{1, 3} {
		prefix := fmt.Sprintf("r%d", replicas)
		w.spread(prefix, n, time.Now().Add(-time.Minute), time.Second) // a backlog
		var ds []*daemon
		for range replicas {
			ds = append(ds, w.start("ORDERDELAY_CLOSE_SQL="+auditClose))
		}
		start := time.Now()
		waitFor(t, "backlog drained", 120*time.Second, func() bool { return w.queueLen() == 0 })
		throughput[replicas] = n / time.Since(start).Seconds()
		var claimed, reclaimed float64
		for _, d := range ds {
			m := d.metrics()
			claimed += m["orderdelay_claimed_total"]
			reclaimed += m["orderdelay_reclaimed_total"]
			d.stopCleanly()
		}
		if claimed != n || reclaimed != 0 {
			t.Errorf("%d replicas: %v claims and %v re-claims for %d serials, want each claimed once", replicas, claimed, reclaimed, n)
		}
	}
	w.checkInvariants()
	if dc := w.doubleCloses(); dc != 0 {
		t.Errorf("%d orders closed twice", dc)
	}
	if got := w.count("SELECT count(DISTINCT replica) FROM close_audit WHERE serial_no LIKE 'r3-%'"); got < 2 {
		t.Errorf("only %d replica(s) closed orders of the 3-replica run", got)
	}
	t.Logf("drain throughput (race-instrumented binary): 1 replica %.0f orders/s, 3 replicas %.0f orders/s", throughput[1], throughput[3])
}

func TestFaultPaymentRacesTheTimeout(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.withAudit()
	const n = 5000
	start := time.Now().Add(time.Second)
	serials := w.spread("race", n, start, 2*time.Second)
	d := w.start("ORDERDELAY_CLOSE_SQL="+auditClose, "ORDERDELAY_BATCH_SIZE=50")
	// Payers pay half the orders, each within ±20 ms of its deadline.
	var paid atomic.Int64
	const payers = 16
	inParallel(payers, payers, func(p int) {
		for i := p; i < n; i += payers {
			if i%2 == 0 {
				continue
			}
			due := start.Add(2 * time.Second * time.Duration(i) / n)
			if wait := time.Until(due.Add(time.Duration(rand.N(40)-20) * time.Millisecond)); wait > 0 {
				time.Sleep(wait) // the race is with wall-clock deadlines
			}
			res, err := w.db.Exec("UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1 AND status = 'pending'", serials[i])
			if err != nil {
				t.Error(err)
				return
			}
			if k, _ := res.RowsAffected(); k == 1 {
				paid.Add(1)
			}
		}
	})
	waitFor(t, "queue drained", 60*time.Second, func() bool { return w.queueLen() == 0 })
	if both := w.count("SELECT count(*) FROM orders WHERE paid_at IS NOT NULL AND closed_at IS NOT NULL"); both != 0 {
		t.Errorf("%d orders both paid and closed", both)
	}
	if other := w.count("SELECT count(*) FROM orders WHERE status NOT IN ('paid', 'closed')"); other != 0 {
		t.Errorf("%d orders neither paid nor closed", other)
	}
	w.checkInvariants()
	m := d.metrics()
	closed, settled := m["orderdelay_orders_closed_total"], m[`orderdelay_orders_skipped_total{reason="settled"}`]
	if closed+settled != n || int64(settled) != paid.Load() {
		t.Errorf("closed %v + settled %v, want %d in all with settled = %d paid", closed, settled, n, paid.Load())
	}
	late := w.count("SELECT count(*) FROM orders WHERE paid_at > expires_at")
	t.Logf("%d paid in the race window (%d of them after their deadline but before the close), %v closed", paid.Load(), late, closed)
	d.stopCleanly()
}

func TestFaultRedisLosesTheQueue(t *testing.T) {
	t.Parallel()
	w, _ := privateWorld(t)
	ctx := context.Background()
	deadline := time.Now().Add(time.Second)
	w.spread("lost", 10000, deadline, 10*time.Millisecond)
	w.createOrders("never-enqueued", 50, deadline)    // the checkout died before its ZADD
	if err := w.rdb.FlushAll(ctx).Err(); err != nil { // private server: Redis loses everything
		t.Fatal(err)
	}
	d := w.start("ORDERDELAY_LEASE=1s", "ORDERDELAY_STATEMENT_TIMEOUT=500ms", "ORDERDELAY_DRAIN_TIMEOUT=500ms",
		"ORDERDELAY_RECONCILE_INTERVAL=500ms", "ORDERDELAY_RECONCILE_GRACE=2s")
	waitFor(t, "the reconciler closes what Redis lost", 90*time.Second, func() bool {
		return w.count("SELECT count(*) FROM orders WHERE status = 'pending'") == 0
	})
	w.checkInvariants()
	if v := d.metrics()["orderdelay_orders_reconciled_total"]; v != 10050 {
		t.Errorf("orders_reconciled_total %v, want 10050", v)
	}
	if n := w.count("SELECT count(*) FROM orders WHERE closed_at < expires_at + interval '2 seconds'"); n != 0 {
		t.Errorf("%d closed within the grace", n)
	}
	d.stopCleanly()
}

func TestFaultPostgresGoesAway(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	pgHost, _ := url.Parse(w.dbURL)
	px := testenv.NewProxy(t, pgHost.Host)
	w.dbURL = viaProxy(t, w.dbURL, px.Addr())
	d := w.start("ORDERDELAY_BACKOFF_MAX=2s")
	waitFor(t, "consumer scanning", 30*time.Second, func() bool {
		return d.metrics()["orderdelay_last_scan_timestamp_seconds"] > 0
	})
	px.Down()
	// Orders fall due while the database is away.
	deadline := time.Now().Add(300 * time.Millisecond)
	w.spread("pgdown", 2000, deadline, 100*time.Millisecond)
	waitFor(t, "postgres reported down", 30*time.Second, func() bool {
		return d.metrics()[`orderdelay_dependency_up{dependency="postgres"}`] == 0
	})
	if code := d.call(http.MethodGet, "/readyz", "", "", nil); code != http.StatusOK {
		t.Errorf("/readyz %d while only PostgreSQL is down, want 200", code)
	}
	if code := d.call(http.MethodPut, "/v1/timeouts/enq-while-down", "", `{"after":"1h"}`, nil); code != http.StatusCreated {
		t.Errorf("enqueue while PostgreSQL is down: %d, want 201", code)
	}
	outageStart := time.Now()
	before := d.metrics()[`orderdelay_errors_total{stage="close"}`]
	// Stay down long enough for several backoff rounds.
	waitFor(t, "backoff rounds", 30*time.Second, func() bool { return time.Since(outageStart) > 4*time.Second })
	errs := d.metrics()[`orderdelay_errors_total{stage="close"}`] - before
	rate := errs / time.Since(outageStart).Seconds()
	if rate > 10 {
		t.Errorf("%.1f close errors per second while PostgreSQL was down, want backoff to keep it bounded (<= 10/s)", rate)
	}
	if n := w.queueLen(); n != 2001 {
		t.Errorf("queue holds %d entries during the outage, want 2001: nothing leaves Redis without a committed close", n)
	}
	px.Up()
	waitFor(t, "caught up after recovery", 60*time.Second, func() bool {
		return w.closed() == 2000
	})
	w.checkInvariants()
	t.Logf("%.1f close errors/s during the outage", rate)
	d.stopCleanly()
}

func TestFaultRedisGoesAway(t *testing.T) {
	t.Parallel()
	w, px := privateWorld(t)
	d := w.start()
	// The consumers start once the start-up checks have Redis's answers
	// (TestFaultRedisAwayAtStart is the outage that comes first); then
	// their claims meet this one.
	waitFor(t, "dependency_up{redis} 1", 30*time.Second, func() bool {
		return d.metrics()[`orderdelay_dependency_up{dependency="redis"}`] == 1
	})
	px.Down()
	waitFor(t, "readiness 503 while Redis is away", 30*time.Second, func() bool {
		return d.call(http.MethodGet, "/readyz", "", "", nil) == http.StatusServiceUnavailable
	})
	if code := d.call(http.MethodPut, "/v1/timeouts/redis-down", "", `{"after":"1s"}`, nil); code != http.StatusServiceUnavailable {
		t.Errorf("enqueue while Redis is away: %d, want 503", code)
	}
	if code := d.call(http.MethodGet, "/healthz", "", "", nil); code != http.StatusOK {
		t.Errorf("/healthz %d while Redis is away, want 200 (liveness is not a dependency check)", code)
	}
	px.Up()
	waitFor(t, "ready again", 30*time.Second, func() bool {
		return d.call(http.MethodGet, "/readyz", "", "", nil) == http.StatusOK
	})
	serials := w.createOrders("back", 100, time.Now().Add(200*time.Millisecond))
	for _, s := range serials {
		if code := d.call(http.MethodPut, "/v1/timeouts/"+s, "", `{"after":"200ms"}`, nil); code != http.StatusCreated {
			t.Fatalf("enqueue after recovery: %d", code)
		}
	}
	waitFor(t, "closing resumed", 60*time.Second, func() bool {
		return w.closed() == 100
	})
	if v := d.metrics()[`orderdelay_errors_total{stage="claim"}`]; v == 0 {
		t.Errorf("errors_total{claim} is 0: the outage went unnoticed")
	}
	d.stopCleanly()
}

// TestFaultRedisAwayAtStart: a daemon that starts while Redis is away
// serves its API (readiness 503) and holds its consumers until the Redis
// user's permission check has its answers. Nothing claims meanwhile, so it
// is the check that says Redis is down; once Redis is back, the consumers
// start and close what comes due.
func TestFaultRedisAwayAtStart(t *testing.T) {
	t.Parallel()
	w, px := privateWorld(t)
	px.Down()
	d := w.launch(t, nil)
	waitFor(t, "the permission check waiting for Redis", 60*time.Second, func() bool {
		return strings.Contains(d.Output(), "redis permissions not checked yet; retrying")
	})
	if code := d.call(http.MethodGet, "/readyz", "", "", nil); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz %d while Redis is away, want 503", code)
	}
	if v := d.metrics()[`orderdelay_dependency_up{dependency="redis"}`]; v != 0 {
		t.Errorf("dependency_up{redis} %v while Redis is away, want 0", v)
	}
	px.Up()
	d.waitReady()
	serials := w.createOrders("late-start", 50, time.Now().Add(200*time.Millisecond))
	for _, s := range serials {
		if code := d.call(http.MethodPut, "/v1/timeouts/"+s, "", `{"after":"200ms"}`, nil); code != http.StatusCreated {
			t.Fatalf("enqueue after Redis came back: %d", code)
		}
	}
	waitFor(t, "closing after Redis came back", 60*time.Second, func() bool {
		return w.closed() == 50
	})
	if v := d.metrics()[`orderdelay_dependency_up{dependency="redis"}`]; v != 1 {
		t.Errorf("dependency_up{redis} %v once closing runs, want 1", v)
	}
	d.stopCleanly()
}

// TestFaultSlowDatabase does not run in parallel: its claim that no lease
// expires rests on a 500 ms margin (lease 1 s, statement timeout 500 ms),
// which a machine loaded by other tests' daemons does not promise.
func TestFaultSlowDatabase(t *testing.T) {
	w := newWorld(t)
	w.withAudit()
	w.spread("slow", 3000, time.Now().Add(-time.Second), time.Second)
	// Each batch takes 0.3 s; with a 1 s lease and statement timeout 500 ms,
	// batches end (or are cut) before their lease, so no replica ever
	// re-claims what another is still closing.
	settings := []string{"ORDERDELAY_CLOSE_SQL=" + slowAuditClose, "ORDERDELAY_LEASE=1s",
		"ORDERDELAY_STATEMENT_TIMEOUT=500ms", "ORDERDELAY_DRAIN_TIMEOUT=500ms", "ORDERDELAY_BATCH_SIZE=100"}
	a, b := w.start(settings...), w.start(settings...)
	waitFor(t, "queue drained", 120*time.Second, func() bool { return w.queueLen() == 0 })
	w.checkInvariants()
	if dc := w.doubleCloses(); dc != 0 {
		t.Errorf("%d orders closed twice", dc)
	}
	for _, d := range []*daemon{a, b} {
		if v := d.metrics()["orderdelay_reclaimed_total"]; v != 0 {
			t.Errorf("reclaimed_total %v: leases expired under a slow database", v)
		}
		d.stopCleanly()
	}
}

func TestFaultPoisonInputNeverBlocksTheQueue(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	ctx := context.Background()
	past := float64(queue.DeadlineMillis(time.Now().Add(-time.Hour)))
	poison := []redis.Z{
		{Score: past - 5, Member: ""},
		{Score: past - 4, Member: strings.Repeat("x", 129)},
		{Score: past - 3, Member: "bad\xffutf8"},
		{Score: past - 2, Member: "nul\x00byte"},
		{Score: past - 1, Member: "ghost-without-row"},
		{Score: 1700000000, Member: "seconds"},
	}
	if err := w.rdb.ZAdd(ctx, w.keys.Queue, poison...).Err(); err != nil {
		t.Fatal(err)
	}
	injection := "x'); DROP TABLE orders; --"
	good := w.createOrders("good", 500, time.Now().Add(-time.Minute))
	good = append(good, w.createOrders(injection, 1, time.Now().Add(-time.Minute))...)
	w.zadd(good, past)
	d := w.start("ORDERDELAY_MAX_ATTEMPTS=2", "ORDERDELAY_BACKOFF_MAX=1s")
	waitFor(t, "good orders closed", 60*time.Second, func() bool {
		return w.closed() == len(good)
	})
	waitFor(t, "poison dead-lettered", 60*time.Second, func() bool { return w.queueLen() == 0 })
	out := w.cli("inspect", "--dead", "--queue-key", w.keys.Queue, "--redis-url", w.redisURL)
	for _, want := range []string{"malformed", "score_out_of_range", "not_found", `"ghost-without-row"`} {
		if !strings.Contains(out, want) {
			t.Errorf("inspect --dead lacks %q:\n%s", want, out)
		}
	}
	// The order shows up after all: requeue it and it closes.
	if _, err := w.db.Exec("INSERT INTO orders (serial_no, expires_at) VALUES ('ghost-without-row', now() - interval '1 hour')"); err != nil {
		t.Fatal(err)
	}
	if out := w.cli("requeue", "ghost-without-row", "--queue-key", w.keys.Queue, "--redis-url", w.redisURL); !strings.Contains(out, "requeued 1") {
		t.Fatalf("requeue:\n%s", out)
	}
	waitFor(t, "requeued order closed", 30*time.Second, func() bool { return w.status("ghost-without-row") == "closed" })
	w.checkInvariants()
	d.stopCleanly()
}

// Issue 11 item 3, black-box: an order whose close always fails (a shop
// trigger refuses it; the fast path has dead-lettered it, so it is in no
// queue key) is the oldest overdue row, in every reconciler page. It must not
// stop the reconciler: the 20 lost orders behind it are closed, and it is
// reported.
func TestFaultPoisonedOrderDoesNotStopTheReconciler(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	poison := w.createOrders("poison", 1, time.Now().Add(-time.Hour))[0]
	lost := w.createOrders("lost", 20, time.Now().Add(-10*time.Minute))
	if _, err := w.db.Exec(`CREATE FUNCTION refuse_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND NEW.serial_no = '` + poison + `' THEN
    RAISE EXCEPTION 'shop trigger: order % cannot be closed', NEW.serial_no;
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER refuse_close BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION refuse_close();`); err != nil {
		t.Fatal(err)
	}
	d := w.start("ORDERDELAY_LEASE=1s", "ORDERDELAY_STATEMENT_TIMEOUT=500ms", "ORDERDELAY_DRAIN_TIMEOUT=500ms",
		"ORDERDELAY_RECONCILE_INTERVAL=500ms", "ORDERDELAY_RECONCILE_GRACE=2s")
	waitFor(t, "the reconciler closes the lost orders behind the poisoned one", 60*time.Second, func() bool {
		return w.count("SELECT count(*) FROM orders WHERE serial_no = ANY($1) AND status = 'closed'", pq.Array(lost)) == len(lost)
	})
	if st := w.status(poison); st != "pending" {
		t.Errorf("the poisoned order is %s, want pending", st)
	}
	waitFor(t, "the poisoned order reported", 30*time.Second, func() bool {
		return d.metrics()[`orderdelay_errors_total{stage="reconcile"}`] >= 1
	})
	if v := d.metrics()["orderdelay_orders_reconciled_total"]; v != float64(len(lost)) {
		t.Errorf("orders_reconciled_total %v, want %d", v, len(lost))
	}
	d.stopCleanly()
}

func TestFaultGracefulShutdownUnderLoad(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.withAudit()
	const n = 3000
	w.spread("load", n, time.Now().Add(-time.Second), time.Second)
	// Batches of 100 take 0.3 s each on 4 workers: SIGTERM lands with
	// hundreds of claims in flight and most of the backlog still queued.
	settings := []string{"ORDERDELAY_CLOSE_SQL=" + slowAuditClose, "ORDERDELAY_BATCH_SIZE=100", "ORDERDELAY_DRAIN_TIMEOUT=5s"}
	d := w.start(settings...)
	waitFor(t, "hundreds of claims in flight", 30*time.Second, func() bool {
		return d.metrics()["orderdelay_inflight_orders"] >= 300
	})
	start := time.Now()
	if code := d.stop(); code != 0 {
		t.Fatalf("exit status %d, want 0", code)
	}
	took := time.Since(start)
	if n := held(t, w.rdb, w.keys); n != 0 {
		t.Fatalf("%d entries still leased after a graceful stop: in-flight batches neither finished nor handed back", n)
	}
	closedFirst := w.closed()
	second := w.start(settings...)
	waitFor(t, "a second replica finishes the backlog", 60*time.Second, func() bool { return w.queueLen() == 0 })
	w.checkInvariants()
	if dc := w.doubleCloses(); dc != 0 {
		t.Errorf("%d orders closed twice", dc)
	}
	if v := second.metrics()["orderdelay_reclaimed_total"]; v != 0 {
		t.Errorf("the second replica re-claimed %v entries: nothing should wait for a lease to expire", v)
	}
	t.Logf("SIGTERM with in-flight batches: exited in %s having closed %d; the next replica closed the remaining %d at once",
		took.Round(time.Millisecond), closedFirst, n-closedFirst)
	second.stopCleanly()
}
