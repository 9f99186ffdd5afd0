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
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// What a daemon's stop may wait for while Redis answers nothing, with the
// settings TestFaultRedisHangsAtShutdown gives it: each wait is bounded,
// none by Redis.
const (
	redisReadTimeout = 5 * time.Second // go-redis's ReadTimeout (and dial's): the URL sets none
	bookkeeping      = 5 * time.Second // a hand-back's own deadline (consumer.BookkeepingTimeout)
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

// TestFaultRedisStallLongerThanTheLease: replica A's Redis answers nothing
// for longer than the lease while A has a claim in flight (Redis ran the
// claim and A has not heard; or A is closing its batch and has not heard
// its fence), and replica B, on its own connection, re-claims and closes
// what that claim held once its lease expires. Meanwhile a payment and two
// reschedules (the API, a raw ZADD) hit orders of that claim. When the
// stall ends A hears the replies, long after its lease, and acts on them.
// Nothing is closed twice, nothing paid is closed, nothing rescheduled
// closes before its new deadline, nothing is lost.
func TestFaultRedisStallLongerThanTheLease(t *testing.T) {
	t.Parallel()
	rdb, addr := testenv.PrivateRedis(t)
	px := testenv.NewProxy(t, addr)
	// Replica A reaches Redis through the proxy and waits up to a minute
	// for a reply (read_timeout), so it hears what Redis did during the
	// stall once the test ends it. Replica B reaches Redis directly.
	w := withDatabase(t, rdb, "redis://"+px.Addr()+"/0?read_timeout=1m", queue.NewKeys(queue.DefaultKey))
	w.withAudit()
	const n = 20000
	w.spread("stall", n, time.Now().Add(-time.Second), time.Second)
	// Long enough that the claim followed below still has seconds of its
	// lease left when the producers act on it (A first quiesces, which a
	// busy machine makes slow): B must not re-claim it in between.
	const lease = 5 * time.Second
	settings := []string{"ORDERDELAY_CLOSE_SQL=" + auditClose, "ORDERDELAY_LEASE=" + lease.String(),
		"ORDERDELAY_STATEMENT_TIMEOUT=500ms", "ORDERDELAY_DRAIN_TIMEOUT=500ms", "ORDERDELAY_BATCH_SIZE=50",
		"ORDERDELAY_BACKOFF_MAX=1s"}
	// A has workers to spare, so its scanner is claiming (not waiting for
	// a worker) when the stall begins.
	a := w.start(append(settings, "ORDERDELAY_WORKERS=8")...)
	b := w.start(append(settings, "ORDERDELAY_REDIS_URL=redis://"+addr+"/0")...)
	waitFor(t, "both replicas claiming", 30*time.Second, func() bool {
		return a.metrics()["orderdelay_claimed_total"] > 0 && b.metrics()["orderdelay_claimed_total"] > 0
	})
	host, _ := os.Hostname()
	nameA, nameB := fmt.Sprintf("orderdelay/%s/%d", host, a.Pid()), fmt.Sprintf("orderdelay/%s/%d", host, b.Pid())

	px.Stall(2 * time.Minute) // ended below
	stallStart := time.Now()
	// Every close needs its fence's answer before it commits, and those
	// are held now: once A has no transaction open, A can close nothing
	// until the stall ends. (A scrape of A would wait on the stall too: A
	// is watched through Redis and the database until it ends.)
	waitFor(t, "replica A with no transaction open", 30*time.Second, func() bool {
		return w.count(`SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = $1 AND xact_start IS NOT NULL`, nameA) == 0
	})
	// The orders A still holds are those of the claims it has not heard
	// of, or whose batch waits for its fence: the latest of them (the
	// claim A's scanner waits on, most likely) is the one followed.
	var tok string
	var x []string
	var expiry float64
	selected, err := w.rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	// A claim whose lease ends within 2 s could be re-claimed by B and
	// closed while the producers below write PostgreSQL and then Redis:
	// closed under the deadline still acknowledged then, which the
	// audit, reading PostgreSQL's new deadline, would call early.
	soonest := float64(selected.Add(2 * time.Second).UnixMilli())
	for _, z := range w.leases() {
		tk := z.Member.(string)
		serials := w.leasedUnder(tk)
		if !strings.HasPrefix(tk, nameA+":") || len(serials) < 12 || z.Score < expiry || z.Score < soonest ||
			w.count("SELECT count(*) FROM orders WHERE serial_no = ANY($1) AND status = 'pending'", pq.Array(serials)) != len(serials) {
			continue
		}
		tok, x, expiry = tk, serials, z.Score
	}
	if tok == "" {
		t.Fatalf("no claim of A's holds 12 pending orders in the stall: leases %v", w.leases())
	}
	// While A waits for that reply, producers act on its orders: three are
	// paid, three rescheduled an hour later through B's API, three by a
	// raw ZADD; the rest are left to close.
	paid, viaAPI, viaZADD, plain := x[0:3], x[3:6], x[6:9], x[9:]
	moved := append(slices.Clone(viaAPI), viaZADD...)
	w.pay(paid)
	later := time.Now().Add(time.Hour)
	w.setDeadlines(moved, later)
	for _, s := range viaAPI {
		body := `{"at":"` + later.UTC().Format(time.RFC3339Nano) + `","reschedule":true}`
		if code := b.call(http.MethodPut, "/v1/timeouts/"+s, "", body, nil); code != http.StatusOK && code != http.StatusCreated {
			t.Fatalf("reschedule %s through the API: %d", s, code)
		}
	}
	w.zadd(viaZADD, float64(queue.DeadlineMillis(later)))
	// A's lease runs out; B re-claims the orders and closes those left.
	waitFor(t, "B re-claims and closes the unpaid orders of A's stalled claim, the stall outlasting the lease", 60*time.Second, func() bool {
		return time.Since(stallStart) > lease && w.count("SELECT count(*) FROM close_audit WHERE serial_no = ANY($1) AND replica = $2", pq.Array(plain), nameB) == len(plain)
	})
	redisNow, err := w.rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	if ms := redisNow.UnixMilli(); float64(ms) <= expiry {
		t.Fatalf("the stall ends at %d, before the lease of A's claim expired (%.0f): the test proved nothing", ms, expiry)
	}
	stalled := time.Since(stallStart)
	px.Stall(0)
	stallEnd := time.Now()
	// A hears the replies now, long after its lease, acts on them, and
	// claims again.
	waitFor(t, "A back at work after the stall, nothing in flight", 60*time.Second, func() bool {
		m := a.metrics()
		return m["orderdelay_last_scan_timestamp_seconds"] > float64(stallEnd.UnixNano())/1e9 && m["orderdelay_inflight_orders"] == 0
	})
	for _, s := range moved {
		if st := w.status(s); st != "pending" {
			t.Errorf("%s, rescheduled an hour later during the stall, is %s", s, st)
		}
		score, err := w.rdb.ZScore(context.Background(), w.keys.Queue, s).Result()
		if err != nil || int64(score) != queue.DeadlineMillis(later) {
			t.Errorf("%s queued at %v (%v), want the deadline its producer wrote during the stall, %d", s, score, err, queue.DeadlineMillis(later))
		}
	}
	for _, s := range paid {
		if st := w.status(s); st != "paid" {
			t.Errorf("%s, paid during the stall, is %s", s, st)
		}
	}
	byA := w.count("SELECT count(*) FROM close_audit WHERE serial_no = ANY($1) AND replica = $2", pq.Array(x), nameA)
	// The rescheduled orders fall due again: they close now, once, at
	// their new deadline.
	soon := time.Now().Add(time.Second)
	w.setDeadlines(moved, soon)
	w.zadd(moved, float64(queue.DeadlineMillis(soon)))
	waitFor(t, "everything settled", 60*time.Second, func() bool { return w.queueLen() == 0 })
	w.checkInvariants()
	if dc := w.doubleCloses(); dc != 0 {
		t.Errorf("%d orders closed twice", dc)
	}
	if got := w.closed(); got != n-len(paid) {
		t.Errorf("%d closed, want %d (all but the %d paid)", got, n-len(paid), len(paid))
	}
	mA, mB := a.metrics(), b.metrics()
	a.stopCleanly()
	b.stopCleanly()
	t.Logf("A's claim %s (%d orders) ran in the stall, its lease expiring at %.0f; B re-claimed %v entries in all; "+
		"the stall ended %s after it began and A, hearing the replies then, closed %d of that claim's orders; "+
		"closed in all by A %v, by B %v", tok, len(x), expiry, mB["orderdelay_reclaimed_total"], stalled.Round(time.Millisecond), byA,
		mA["orderdelay_orders_closed_total"], mB["orderdelay_orders_closed_total"])
}

// leases are the queue's batch leases: each claim's token, scored by its
// lease's expiry (Unix ms, Redis's clock).
func (w *world) leases() []redis.Z {
	w.t.Helper()
	z, err := w.rdb.ZRangeWithScores(context.Background(), w.keys.Leases, 0, -1).Result()
	if err != nil {
		w.t.Fatal(err)
	}
	return z
}

// leasedUnder are the serials whose lease record carries tok, sorted.
func (w *world) leasedUnder(tok string) []string {
	w.t.Helper()
	recs, err := w.rdb.HGetAll(context.Background(), w.keys.Lease).Result()
	if err != nil {
		w.t.Fatal(err)
	}
	var out []string
	for s, r := range recs {
		if rec, ok := queue.ParseLeaseRecord(r); ok && rec.Token == tok {
			out = append(out, s)
		}
	}
	slices.Sort(out)
	return out
}

// setDeadlines moves the rows' deadlines, as a checkout that reschedules
// does before it writes the queue.
func (w *world) setDeadlines(serials []string, at time.Time) {
	w.t.Helper()
	if _, err := w.db.Exec("UPDATE orders SET expires_at = $2 WHERE serial_no = ANY($1)", pq.Array(serials), at); err != nil {
		w.t.Fatal(err)
	}
}
