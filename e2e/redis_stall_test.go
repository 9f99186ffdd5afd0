package e2e

// Redis hanging, not going away. TestFaultRedisGoesAway cuts the
// connections; here they stay open and Redis's replies are held
// (testenv.Proxy.Stall): a stuck primary, a partition without RST, a long
// fork or AOF fsync stall. The server still runs every command it is sent;
// the client hears of it late, or never, and every call waits for the
// client's own timeouts. Each test has its private Redis, proxy and
// database, so they run in parallel with the rest.

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/lib/pq"
)

// What a daemon's stop may wait for while Redis answers nothing, with the
// settings TestFaultRedisHangsAtShutdown gives it: each wait is bounded,
// none by Redis.
const (
	redisReadTimeout = 5 * time.Second // go-redis's ReadTimeout (and dial's): the URL sets none
	bookkeeping      = 5 * time.Second // a hand-back's own deadline (consumer.bookkeepingTimeout)
	httpShutdown     = 5 * time.Second // requests in progress (cmd/orderdelay httpShutdownTimeout)
	poolClose        = 2 * time.Second // each of the two database pools (cmd/orderdelay poolCloseWait)
)

// TestFaultRedisHangsAtShutdown: SIGTERM reaches a daemon mid-drain while
// Redis answers nothing. It must still exit, within what its own timeouts
// add up to — the drain timeout, the Redis call in flight when it passes,
// the hand-back's deadline, the Redis check, the HTTP shutdown, the pools
// — and say that the hand-back failed. Its claims come back when their
// leases expire: the next daemon closes every unpaid order once, none
// paid, and leaves Redis empty.
func TestFaultRedisHangsAtShutdown(t *testing.T) {
	t.Parallel()
	w, px := privateWorld(t)
	w.withAudit()
	const n = 3000
	serials := w.spread("hang", n, time.Now().Add(-time.Second), time.Second)
	// Batches of 100 take 0.3 s each on 4 workers: the stall and SIGTERM
	// land with hundreds of claims in flight, most of the backlog queued.
	const drain = time.Second
	settings := []string{"ORDERDELAY_CLOSE_SQL=" + slowAuditClose, "ORDERDELAY_BATCH_SIZE=100",
		"ORDERDELAY_LEASE=5s", "ORDERDELAY_STATEMENT_TIMEOUT=2s", "ORDERDELAY_DRAIN_TIMEOUT=" + drain.String()}
	d := w.start(settings...)
	waitFor(t, "mid-drain: batches closed and hundreds of claims in flight", 60*time.Second, func() bool {
		return w.closed() >= 200 && d.metrics()["orderdelay_inflight_orders"] >= 300
	})
	// Redis hangs for longer than the daemon may take to stop: an exit
	// before it ends is the daemon's own doing. The test ends it below.
	const stall = 2 * time.Minute
	px.Stall(stall)
	stalled := time.Now()
	if err := d.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Payments go on meanwhile: orders claimed, queued or being closed.
	var paid []string
	for i := 3; i < n; i += 7 {
		paid = append(paid, serials[i])
	}
	res, err := w.db.Exec("UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = ANY($1) AND status = 'pending'", pq.Array(paid))
	if err != nil {
		t.Fatal(err)
	}
	nPaid, _ := res.RowsAffected()
	// Every wait of the stop in a row, each at its longest: the Redis call
	// a batch is in when the drain timeout passes, then its hand-back
	// (one more read past its deadline), the Redis check's call, HTTP, the
	// pools. Twice that says "it did not hang", not how fast it is.
	worst := drain + redisReadTimeout + (bookkeeping + redisReadTimeout) + redisReadTimeout + httpShutdown + 2*poolClose
	bound := 2 * worst
	if bound >= stall {
		t.Fatalf("bound %s not below the stall %s: an exit within it would not show the daemon did not wait for Redis", bound, stall)
	}
	code := d.exit(bound)
	took := time.Since(stalled)
	if code != 0 {
		t.Errorf("exit status %d after SIGTERM with Redis hanging, want 0 (a stop as asked; what it could not hand back comes back with the leases)", code)
	}
	log := d.Output()
	for _, want := range []string{
		`"msg":"signal received: stopping"`,
		`"msg":"drain timeout passed; handing back unfinished claims"`,
		`"msg":"hand-back failed; the entries return when their lease expires"`,
		`"msg":"stopped"`,
	} {
		if !strings.Contains(log, want) {
			t.Errorf("the log lacks %s", want)
		}
	}
	leased := held(t, w.rdb, w.keys) // on the test's own connection: Redis hangs for the daemon only
	closedFirst := w.closed()
	px.Stall(0)
	second := w.start(settings...)
	waitFor(t, "a second daemon finishes the backlog", 120*time.Second, func() bool { return w.queueLen() == 0 })
	w.checkInvariants()
	if dc := w.doubleCloses(); dc != 0 {
		t.Errorf("%d orders closed twice", dc)
	}
	if got := w.closed(); int64(got)+nPaid != n {
		t.Errorf("%d closed + %d paid during the stall, want %d", got, nPaid, n)
	}
	if got := w.count("SELECT count(*) FROM orders WHERE status = 'closed' AND paid_at IS NOT NULL"); got != 0 {
		t.Errorf("%d paid orders closed", got)
	}
	reclaimed := second.metrics()["orderdelay_reclaimed_total"]
	second.stopCleanly()
	keys, err := w.rdb.Keys(context.Background(), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 0 {
		t.Errorf("Redis holds %v once every order is settled, want nothing", keys)
	}
	t.Logf("SIGTERM with Redis hanging: exited (status %d) %s after it (bound %s: drain %s, Redis read timeout %s); "+
		"it closed %d before and left %d leased; the next daemon re-claimed %v when their leases expired and closed the rest",
		code, took.Round(time.Millisecond), bound, drain, redisReadTimeout, closedFirst, leased, reclaimed)
}
