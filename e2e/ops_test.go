package e2e

// The operator's toolkit (issue "The operator's toolkit"): each tool is
// driven through the CLI or the admin API against a running daemon, and the
// test checks its effect on Redis, PostgreSQL and the metrics.

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

func TestOpsPauseAndResume(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	d := w.start("ORDERDELAY_ADMIN_TOKEN="+adminToken, "ORDERDELAY_API_TOKEN="+tokenA, "ORDERDELAY_SCAN_INTERVAL=500ms")
	if code := d.call(http.MethodPost, "/admin/v1/pause", bearer(tokenA), `{}`, nil); code != http.StatusUnauthorized {
		t.Fatalf("pause with a producer token: %d, want 401", code)
	}
	var st struct {
		Paused bool   `json:"paused"`
		Reason string `json:"reason"`
	}
	if code := d.call(http.MethodPost, "/admin/v1/pause", bearer(adminToken), `{"reason":"PSP outage"}`, &st); code != http.StatusOK || !st.Paused {
		t.Fatalf("pause: %d %+v", code, st)
	}
	waitFor(t, "orderdelay_paused = 1", 10*time.Second, func() bool { return d.metrics()["orderdelay_paused"] == 1 })
	serials := w.createOrders("paused", 50, time.Now().Add(100*time.Millisecond))
	for _, s := range serials {
		if code := d.call(http.MethodPut, "/v1/timeouts/"+s, bearer(tokenA), `{"after":"100ms"}`, nil); code != http.StatusCreated {
			t.Fatalf("enqueue while paused: %d, want 201", code)
		}
	}
	// Deadlines pass; give the scanners three scan intervals to (not) act.
	waitFor(t, "deadlines passed by three scan intervals", 10*time.Second, func() bool {
		return w.count("SELECT count(*) FROM orders WHERE expires_at < now() - interval '1.5 seconds'") == 50
	})
	if n := w.closed(); n != 0 {
		t.Fatalf("%d orders closed while paused", n)
	}
	if n := w.queueLen(); n != 50 {
		t.Fatalf("queue holds %d while paused, want all 50", n)
	}
	if out := w.cli("inspect", "--queue-key", w.keys.Queue); !strings.Contains(out, "PAUSED") || !strings.Contains(out, "PSP outage") {
		t.Errorf("inspect does not show the pause:\n%s", out)
	}
	w.cli("resume", "--queue-key", w.keys.Queue)
	waitFor(t, "backlog closed after resume", 30*time.Second, func() bool {
		return w.closed() == 50
	})
	if v := d.metrics()["orderdelay_paused"]; v != 0 {
		t.Errorf("orderdelay_paused %v after resume, want 0", v)
	}
	w.checkInvariants()
	d.stop()
}

func TestOpsExtendMovesQueueAndRows(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	ctx := context.Background()
	now := time.Now()
	soon := w.createOrders("soon", 1200, now.Add(10*time.Minute))
	later := w.createOrders("later", 10, now.Add(3*time.Hour))
	w.zadd(soon, float64(queue.DeadlineMillis(now.Add(10*time.Minute))))
	w.zadd(later, float64(queue.DeadlineMillis(now.Add(3*time.Hour))))
	out := w.cli("extend", "--within", "1h", "--by", "15m", "--queue-key", w.keys.Queue)
	if !strings.Contains(out, "moved 1200 queue entries") || !strings.Contains(out, "1200 rows") {
		t.Fatalf("extend reported:\n%s", out)
	}
	for _, s := range []string{soon[0], soon[1199]} {
		score, _ := w.rdb.ZScore(ctx, w.keys.Queue, s).Result()
		if want := queue.DeadlineMillis(now.Add(25 * time.Minute)); int64(score) != want {
			t.Errorf("%s at %d, want %d (15 minutes later)", s, int64(score), want)
		}
	}
	score, _ := w.rdb.ZScore(ctx, w.keys.Queue, later[0]).Result()
	if int64(score) != queue.DeadlineMillis(now.Add(3*time.Hour)) {
		t.Errorf("an entry outside the window moved")
	}
	if n := w.count("SELECT count(*) FROM orders WHERE serial_no LIKE 'soon-%' AND expires_at > now() + interval '24 minutes'"); n != 1200 {
		t.Errorf("%d rows' expires_at moved in step, want 1200", n)
	}
}

func TestOpsCloseDelayDryRunAndRateLimit(t *testing.T) {
	t.Parallel()
	together(t, subtest{"close delay", func(t *testing.T) {
		w := newWorld(t)
		d := w.start("ORDERDELAY_CLOSE_DELAY=1s")
		deadline := time.Now().Add(200 * time.Millisecond)
		w.zadd(w.createOrders("delay", 20, deadline), float64(queue.DeadlineMillis(deadline)))
		waitFor(t, "closed", 30*time.Second, func() bool { return w.closed() == 20 })
		if n := w.count("SELECT count(*) FROM orders WHERE closed_at < expires_at + interval '1 second'"); n != 0 {
			t.Errorf("%d orders closed before deadline + close delay", n)
		}
		d.stop()
	}}, subtest{"dry run", func(t *testing.T) {
		w := newWorld(t)
		w.withAudit()
		past := time.Now().Add(-time.Minute)
		serials := w.createOrders("dry", 300, past)
		if _, err := w.db.Exec("UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no LIKE 'dry-000%'"); err != nil {
			t.Fatal(err)
		}
		w.zadd(serials, float64(queue.DeadlineMillis(past)))
		// A dead letter past the default retention (168h): a dry run must
		// leave it, like everything else in Redis.
		ctx := context.Background()
		oldDead := float64(time.Now().Add(-30 * 24 * time.Hour).UnixMilli())
		w.rdb.ZAdd(ctx, w.keys.Dead, redis.Z{Score: oldDead, Member: "dead-old"})
		w.rdb.HSet(ctx, w.keys.DeadInfo, "dead-old", "not_found|10|1|no order row")
		d := w.start("ORDERDELAY_DRY_RUN=true", "ORDERDELAY_CLOSE_SQL="+auditClose, "ORDERDELAY_BATCH_SIZE=64")
		waitFor(t, "dry run reports", 30*time.Second, func() bool {
			m := d.metrics()
			return m["orderdelay_dry_run_would_close_total"] == 200 && m[`orderdelay_orders_skipped_total{reason="settled"}`] == 100
		})
		if n := w.closed(); n != 0 {
			t.Errorf("%d orders closed in a dry run", n)
		}
		if n := w.count("SELECT count(*) FROM close_audit"); n != 0 {
			t.Errorf("%d audit rows: the custom statement's side effects were not rolled back", n)
		}
		if n := w.queueLen(); n != 300 {
			t.Errorf("queue holds %d after a dry run, want 300 untouched", n)
		}
		if v := d.metrics()["orderdelay_orders_closed_total"]; v != 0 {
			t.Errorf("orders_closed_total %v in a dry run", v)
		}
		d.stop()
		if n, _ := w.rdb.ZCard(ctx, w.keys.Dead).Result(); n != 1 {
			t.Errorf("%d dead letters after a dry run, want the 1 seeded: the janitor purged in a dry run", n)
		}
		if ok, _ := w.rdb.HExists(ctx, w.keys.DeadInfo, "dead-old").Result(); !ok {
			t.Errorf("the dead letter's record was purged in a dry run")
		}
	}}, subtest{"max close rate", func(t *testing.T) {
		w := newWorld(t)
		past := time.Now().Add(-time.Minute)
		w.zadd(w.createOrders("rate", 600, past), float64(queue.DeadlineMillis(past)))
		start := time.Now()
		d := w.start("ORDERDELAY_MAX_CLOSE_RATE=200", "ORDERDELAY_BATCH_SIZE=100")
		waitFor(t, "all closed", 60*time.Second, func() bool { return w.closed() == 600 })
		// A burst of 100 then 200/s: 500 more orders need 2.5 s at least.
		if took := time.Since(start); took < 2*time.Second {
			t.Errorf("600 orders closed in %s at 200/s", took)
		}
		if v := d.metrics()["orderdelay_close_rate_limited_total"]; v == 0 {
			t.Errorf("orderdelay_close_rate_limited_total is 0 although the limit bit")
		}
		d.stop()
	}})
}

func TestOpsResyncAndForensics(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	ctx := context.Background()
	deadline := time.Now().Add(time.Hour)
	missing := w.createOrders("missing", 2500, deadline)
	present := w.createOrders("present", 5, deadline)
	moved := deadline.Add(time.Hour)
	w.zadd(present, float64(queue.DeadlineMillis(moved))) // rescheduled in Redis
	out := w.cli("resync", "--rate", "0", "--queue-key", w.keys.Queue)
	if !strings.Contains(out, "added 2500 missing entries, 5 already queued") {
		t.Fatalf("resync reported:\n%s", out)
	}
	if n, _ := w.rdb.ZCard(ctx, w.keys.Queue).Result(); n != 2505 {
		t.Fatalf("queue holds %d after resync, want 2505", n)
	}
	if s, _ := w.rdb.ZScore(ctx, w.keys.Queue, present[0]).Result(); int64(s) != queue.DeadlineMillis(moved) {
		t.Errorf("resync moved an existing entry's deadline")
	}
	if s, _ := w.rdb.ZScore(ctx, w.keys.Queue, missing[7]).Result(); int64(s) != queue.DeadlineMillis(deadline) {
		t.Errorf("resynced entry at %d, want the row's expires_at %d", int64(s), queue.DeadlineMillis(deadline))
	}

	// Forensics: a closed order and a queued one.
	past := time.Now().Add(-time.Minute)
	closed := w.createOrders("forensic", 1, past)
	w.zadd(closed, float64(queue.DeadlineMillis(past)))
	d := w.start("ORDERDELAY_ADMIN_TOKEN=" + adminToken)
	waitFor(t, "closed", 30*time.Second, func() bool { return w.status(closed[0]) == "closed" })
	text := w.cli("inspect", closed[0], "--queue-key", w.keys.Queue)
	if !strings.Contains(text, "not in the queue") || !strings.Contains(text, "closed") || !strings.Contains(text, "by orderdelay/") {
		t.Errorf("inspect of a closed order:\n%s", text)
	}
	var rep struct {
		Queue *struct {
			State    string    `json:"State"`
			Deadline time.Time `json:"Deadline"`
		} `json:"queue"`
		Row *struct {
			Status string `json:"status"`
		} `json:"row"`
	}
	if code := d.call(http.MethodGet, "/admin/v1/orders/"+missing[0], bearer(adminToken), "", &rep); code != http.StatusOK {
		t.Fatalf("GET /admin/v1/orders: %d", code)
	}
	if rep.Queue == nil || rep.Queue.State != "queued" || rep.Row == nil || rep.Row.Status != "pending" {
		t.Errorf("forensics of a queued order: %+v %+v", rep.Queue, rep.Row)
	}
	if code := d.call(http.MethodGet, "/admin/v1/orders/no-such-order", bearer(adminToken), "", nil); code != http.StatusNotFound {
		t.Errorf("unknown order: %d, want 404", code)
	}
	d.stop()
}

// TestOpsRedisPermissions: the binary on a Redis user refused HDEL (which
// the scripts call) exits 2 at start, naming the command and the user,
// and writes nothing; on a user refused only OBJECT (which the claim asks
// with pcall) it starts, warns and raises redis_permissions.
func TestOpsRedisPermissions(t *testing.T) {
	t.Parallel()
	w, px := privateWorld(t)
	ctx := context.Background()
	for user, rule := range map[string]string{"nohdel": "-hdel", "noobject": "-object"} {
		if err := w.rdb.Do(ctx, "acl", "setuser", user, "on", ">pw", "~*", "&*", "+@all", rule).Err(); err != nil { // private server
			t.Fatal(err)
		}
	}
	d := w.launch(t, nil, "ORDERDELAY_REDIS_URL=redis://nohdel:pw@"+px.Addr()+"/0")
	if code := d.exit(60 * time.Second); code != 2 {
		t.Fatalf("exit status %d with a user refused HDEL, want 2\n%s", code, testenv.LastLines(d.Output(), 20))
	}
	if out := d.Output(); !strings.Contains(out, "HDEL") || !strings.Contains(out, "nohdel") {
		t.Errorf("the output does not name HDEL and the user:\n%s", testenv.LastLines(out, 20))
	}
	if n := w.rdb.DBSize(ctx).Val(); n != 0 {
		t.Errorf("%d keys written by a daemon that did not start, want none", n)
	}

	d = w.start("ORDERDELAY_REDIS_URL=redis://noobject:pw@" + px.Addr() + "/0")
	waitFor(t, "the redis_permissions warning", 30*time.Second, func() bool {
		return d.metrics()[`orderdelay_config_warning{check="redis_permissions"}`] == 1
	})
	if out := d.Output(); !strings.Contains(out, "may not run OBJECT ENCODING") {
		t.Errorf("no warning naming OBJECT ENCODING:\n%s", testenv.LastLines(out, 20))
	}
	d.stopCleanly()
}

func TestOpsStartupChecksAndRetention(t *testing.T) {
	t.Parallel()
	w, _ := privateWorld(t)
	ctx := context.Background()
	if err := w.rdb.ConfigSet(ctx, "maxmemory-policy", "allkeys-lru").Err(); err != nil { // private server
		t.Fatal(err)
	}
	if _, err := w.db.Exec("DROP INDEX orders_pending_expires_at"); err != nil {
		t.Fatal(err)
	}
	old := float64(time.Now().Add(-30 * 24 * time.Hour).UnixMilli())
	for i, s := range []string{"dead-a", "dead-b", "dead-c", "dead-d"} {
		w.rdb.ZAdd(ctx, w.keys.Dead, redis.Z{Score: old + float64(i), Member: s})
		w.rdb.HSet(ctx, w.keys.DeadInfo, s, "not_found|10|1|no order row")
	}
	w.rdb.ZAdd(ctx, w.keys.Dead, redis.Z{Score: float64(time.Now().UnixMilli()), Member: "dead-new"})
	d := w.start("ORDERDELAY_DEAD_LETTER_MAX=3", "ORDERDELAY_DEAD_LETTER_RETENTION=0")
	waitFor(t, "config warnings raised", 30*time.Second, func() bool {
		m := d.metrics()
		return m[`orderdelay_config_warning{check="redis_eviction"}`] == 1 &&
			m[`orderdelay_config_warning{check="redis_persistence"}`] == 1 &&
			m[`orderdelay_config_warning{check="pending_index"}`] == 1
	})
	m := d.metrics()
	if m[`orderdelay_config_warning{check="schema_version"}`] != 0 || m[`orderdelay_config_warning{check="redis_version"}`] != 0 {
		t.Errorf("false warnings: %v", m)
	}
	if out := d.Output(); !strings.Contains(out, "maxmemory-policy is not noeviction") || !strings.Contains(out, "partial index") {
		t.Errorf("warnings not logged:\n%s", testenv.LastLines(out, 20))
	}
	waitFor(t, "the janitor caps dead letters at 3", 30*time.Second, func() bool {
		n, _ := w.rdb.ZCard(ctx, w.keys.Dead).Result()
		return n == 3
	})
	if ok, _ := w.rdb.HExists(ctx, w.keys.DeadInfo, "dead-a").Result(); ok {
		t.Errorf("the oldest dead letter's record survived its purge")
	}
	d.stop()
	out := w.cli("purge", "--dead", "--older-than", "168h", "--queue-key", w.keys.Queue)
	if !strings.Contains(out, "purged 2") {
		t.Errorf("purge --dead --older-than 168h: %s", out)
	}
	if n, _ := w.rdb.ZCard(ctx, w.keys.Dead).Result(); n != 1 {
		t.Errorf("%d dead letters left, want only the new one", n)
	}
}
