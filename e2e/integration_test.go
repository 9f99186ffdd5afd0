package e2e

// The order queue end to end: orders enqueued through the API and by raw
// ZADD are closed once due unless paid, across replicas, through SIGTERM,
// and bad settings stop the daemon at start.

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

func TestIntegrationClosesUnpaidOrders(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	d := w.start()
	// Set up far ahead of any deadline (no race with a loaded machine),
	// then move every deadline to just ahead of now in one step.
	deadline := time.Now().Add(time.Hour)
	serials := w.createOrders("it", 1000, deadline)
	var even, odd []string
	for i, s := range serials {
		if i%2 == 0 {
			even = append(even, s)
		} else {
			odd = append(odd, s)
		}
	}
	putTimeouts(t, []*daemon{d}, even, deadline)
	w.zadd(odd, float64(queue.DeadlineMillis(deadline)))
	// 100 are paid before their deadline (and stay queued: the SQL decides).
	w.pay(serials[:100])
	moveDeadlines(t, w.db, w.rdb, []string{w.keys.Queue}, serials, time.Now().Add(300*time.Millisecond))
	waitFor(t, "queue drained", 60*time.Second, func() bool { return w.queueLen() == 0 })
	if n := w.closed(); n != 900 {
		t.Errorf("%d orders closed, want 900", n)
	}
	if n := w.count("SELECT count(*) FROM orders WHERE status = 'paid'"); n != 100 {
		t.Errorf("%d orders paid, want the 100 untouched", n)
	}
	w.checkInvariants()
	m := d.metrics()
	if v := m["orderdelay_orders_closed_total"]; v != 900 {
		t.Errorf("orderdelay_orders_closed_total %v, want 900", v)
	}
	if v := m[`orderdelay_orders_skipped_total{reason="settled"}`]; v != 100 {
		t.Errorf("skipped{settled} %v, want 100", v)
	}
	if v := m["orderdelay_enqueued_total"]; v != 500 {
		t.Errorf("orderdelay_enqueued_total %v, want 500 (the API half)", v)
	}
	p50, p99 := w.lateness("%")
	t.Logf("lateness over 900 closes: p50 %s, p99 %s", p50.Round(time.Millisecond), p99.Round(time.Millisecond))
	checkGolden(t, repoFile("testdata", "metrics.txt"), d.families())
	if code := d.stop(); code != 0 {
		t.Fatalf("exit status %d after SIGTERM, want 0", code)
	}
}

func TestIntegrationSecondsInsteadOfMillisIsDeadLettered(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	serials := w.createOrders("secs", 1, time.Now().Add(-time.Minute))
	w.zadd(serials, float64(time.Now().Unix())) // seconds: the classic mistake
	d := w.start()
	waitFor(t, "entry dead-lettered", 30*time.Second, func() bool {
		return d.metrics()[`orderdelay_dead_lettered_total{reason="score_out_of_range"}`] == 1
	})
	if st := w.count("SELECT count(*) FROM orders WHERE status = 'pending'"); st != 1 {
		t.Errorf("the order was touched: %d pending, want 1", st)
	}
	out := w.cli("inspect", "--json", "--queue-key", w.keys.Queue, "--redis-url", testenv.RedisURL())
	var got struct {
		Depth       int64 `json:"depth"`
		DeadLetters int64 `json:"dead_letters"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("inspect --json: %v\n%s", err, out)
	}
	if got.Depth != 0 || got.DeadLetters != 1 {
		t.Errorf("inspect: depth %d, dead letters %d; want 0 and 1", got.Depth, got.DeadLetters)
	}
	info, err := w.rdb.HGet(context.Background(), w.keys.DeadInfo, serials[0]).Result()
	if err != nil || !strings.HasPrefix(info, "score_out_of_range|") {
		t.Errorf("dead-letter record %q (%v), want reason score_out_of_range", info, err)
	}
	if code := d.stop(); code != 0 {
		t.Fatalf("exit status %d, want 0", code)
	}
}

func TestIntegrationTwoReplicas(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.withAudit()
	a := w.start("ORDERDELAY_CLOSE_SQL="+auditClose, "ORDERDELAY_BATCH_SIZE=50")
	b := w.start("ORDERDELAY_CLOSE_SQL="+auditClose, "ORDERDELAY_BATCH_SIZE=50")
	// Set up against a far deadline, moved near once the payments are in:
	// a slow machine cannot let an order fall due before it is paid.
	deadline := time.Now().Add(time.Hour)
	serials := w.createOrders("two", 3000, deadline)
	w.zadd(serials, float64(queue.DeadlineMillis(deadline)))
	w.pay(serials[:300])
	moveDeadlines(t, w.db, w.rdb, []string{w.keys.Queue}, serials, time.Now().Add(300*time.Millisecond))
	waitFor(t, "queue drained", 60*time.Second, func() bool { return w.queueLen() == 0 })
	w.checkInvariants()
	if n := w.doubleCloses(); n != 0 {
		t.Errorf("%d orders closed twice", n)
	}
	if n := w.count("SELECT count(*) FROM close_audit"); n != 2700 {
		t.Errorf("%d closes audited, want 2700", n)
	}
	ma, mb := a.metrics(), b.metrics()
	claimed := ma["orderdelay_claimed_total"] + mb["orderdelay_claimed_total"]
	if claimed != 3000 {
		t.Errorf("claims summed over replicas %v, want 3000 (each serial claimed once)", claimed)
	}
	t.Logf("replica a closed %v, b closed %v", ma["orderdelay_orders_closed_total"], mb["orderdelay_orders_closed_total"])
	for _, d := range []*daemon{a, b} {
		d.stopCleanly()
	}
}

func TestIntegrationInvalidSettingsExit2(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	noQueues := filepath.Join(t.TempDir(), "queues.yaml")
	if err := os.WriteFile(noQueues, []byte("queues: []\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name    string
		args    []string
		env     []string
		mention string
	}{
		{"bad number", nil, []string{"ORDERDELAY_WORKERS=many"}, "ORDERDELAY_WORKERS"},
		{"bad duration", nil, []string{"ORDERDELAY_LEASE=forever"}, "ORDERDELAY_LEASE"},
		{"flag beats env and is checked", []string{"--batch-size", "0"}, []string{"ORDERDELAY_BATCH_SIZE=10"}, "--batch-size"},
		{"statement timeout not below lease", nil, []string{"ORDERDELAY_STATEMENT_TIMEOUT=60s", "ORDERDELAY_LEASE=60s"}, "ORDERDELAY_STATEMENT_TIMEOUT"},
		{"drain not below lease", nil, []string{"ORDERDELAY_DRAIN_TIMEOUT=2m"}, "ORDERDELAY_DRAIN_TIMEOUT"},
		{"reminder queue with an empty queues file", nil,
			[]string{"ORDERDELAY_QUEUES_FILE=" + noQueues, "ORDERDELAY_REMINDER_QUEUE=remind"}, "ORDERDELAY_REMINDER_QUEUE"},
		{"bad redis url", nil, []string{"ORDERDELAY_REDIS_URL=http://u:hunter2hunter2@x"}, "ORDERDELAY_REDIS_URL"},
		{"close statement with the wrong parameter type", nil,
			[]string{"ORDERDELAY_CLOSE_SQL=SELECT serial_no FROM orders WHERE serial_no = ANY($1::int[]::text[]) AND $1::int[] IS NOT NULL"},
			"ORDERDELAY_CLOSE_SQL"},
		{"close statement returning two columns", nil,
			[]string{"ORDERDELAY_CLOSE_SQL=SELECT serial_no, status FROM orders WHERE serial_no = ANY($1)"}, "ORDERDELAY_CLOSE_SQL"},
		// The overdue statement's contract before keyset paging (no cursor,
		// serial only): refused, saying what it must take and return.
		{"overdue statement without a cursor", nil,
			[]string{"ORDERDELAY_OVERDUE_SQL=SELECT serial_no FROM orders WHERE status = 'pending' AND expires_at < now() - $1::bigint * interval '1 millisecond' ORDER BY expires_at LIMIT $2::bigint FOR UPDATE SKIP LOCKED"},
			"ORDERDELAY_OVERDUE_SQL"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := w.launch(t, c.args, c.env...)
			if code := d.exit(60 * time.Second); code != 2 {
				t.Fatalf("exit status %d, want 2; output:\n%s", code, d.Output())
			}
			if !strings.Contains(d.Output(), c.mention) {
				t.Fatalf("output does not name %s:\n%s", c.mention, d.Output())
			}
			if strings.Contains(d.Output(), "hunter2") {
				t.Fatalf("output leaks a password:\n%s", d.Output())
			}
		})
	}
}

// lockedClose waits on an advisory lock the test holds, so a batch is
// certainly in flight when SIGTERM arrives.
const lockedClose = `SELECT s FROM unnest($1::text[]) s
WHERE length(s) + (SELECT 0 FROM pg_advisory_xact_lock(777)) < 0`

func TestIntegrationSIGTERMHandsBackUnfinishedClaims(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	ctx := context.Background()
	deadline := time.Now().Add(-time.Second)
	serials := w.createOrders("term", 200, deadline)
	w.zadd(serials, float64(queue.DeadlineMillis(deadline)))
	lock, err := w.db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_lock(777)"); err != nil {
		t.Fatal(err)
	}
	d := w.start("ORDERDELAY_CLOSE_SQL="+lockedClose, "ORDERDELAY_DRAIN_TIMEOUT=1s", "ORDERDELAY_BATCH_SIZE=100", "ORDERDELAY_WORKERS=2")
	waitFor(t, "both batches in flight", 30*time.Second, func() bool {
		return d.metrics()["orderdelay_inflight_orders"] == 200
	})
	if code := d.stop(); code != 0 {
		t.Fatalf("exit status %d, want 0", code)
	}
	if n := held(t, w.rdb, w.keys); n != 0 {
		t.Fatalf("%d entries still leased after shutdown, want all handed back", n)
	}
	for _, s := range serials {
		score, err := w.rdb.ZScore(ctx, w.keys.Queue, s).Result()
		if err != nil || int64(score) != queue.DeadlineMillis(deadline) {
			t.Fatalf("%s: score %d (%v), want its true deadline %d", s, int64(score), err, queue.DeadlineMillis(deadline))
		}
	}
	if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_unlock(777)"); err != nil {
		t.Fatal(err)
	}
	second := w.start()
	waitFor(t, "second run closes them", 60*time.Second, func() bool { return w.queueLen() == 0 })
	if n := w.closed(); n != len(serials) {
		t.Errorf("%d closed by the second run, want %d", n, len(serials))
	}
	w.checkInvariants()
	if code := second.stop(); code != 0 {
		t.Fatalf("exit status %d, want 0", code)
	}
}
