package e2e

// The fault campaign (issue 11): a seeded random checkout workload and a
// seeded random nemesis run against two daemon replicas sharing one queue,
// every operation is recorded with its start and end, and a checker reads
// the history and the final tables and keys for contract violations, the
// way Jepsen checks databases.
//
//	go test -count=1 -run TestCampaign ./e2e/                    # ~45 s of workload
//	ORDERDELAY_CAMPAIGN=30m go test -count=1 -timeout 2h -run TestCampaign ./e2e/
//	ORDERDELAY_CAMPAIGN_SEED=N ...                               # replay a seed
//	ORDERDELAY_CAMPAIGN_FAULTS=sigkill,stall ...                 # only these faults ("none": no faults)
//	ORDERDELAY_CAMPAIGN_FULL_LOGS=1 ...                          # a failure logs the replicas' whole logs, not their tails
//
// The seed fixes every choice the workload and the nemesis make (which
// order gets which life, which fault when); the interleaving with the
// daemons is still up to the scheduler, so a seed reproduces a failure
// with high probability rather than certainty.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Daemon settings: small, so every fault outlasts a lease, a statement
// timeout or a backoff within seconds.
const (
	cLease          = 2 * time.Second
	cStmtTimeout    = 1 * time.Second
	cBackoffMax     = 2 * time.Second
	cReconcileEvery = 1 * time.Second
	cReconcileGrace = 3 * time.Second
	cScanInterval   = 1 * time.Second
	// cSettle is how long after the faults stop (or after its final
	// deadline, whichever is later) an unpaid order must be closed: lease +
	// backoff cap + grace + reconcile interval (+20% jitter) + scan
	// interval, plus a margin for a loaded machine (15 s: with both cores
	// busy and two race-built replicas, 4 s was missed by a few seconds).
	cSettle = cLease + cBackoffMax + cReconcileGrace + cReconcileEvery*6/5 + cScanInterval + 15*time.Second
)

func campaignSettings() []string {
	return []string{
		"ORDERDELAY_LEASE=" + cLease.String(),
		"ORDERDELAY_STATEMENT_TIMEOUT=" + cStmtTimeout.String(),
		"ORDERDELAY_DRAIN_TIMEOUT=1s",
		"ORDERDELAY_BACKOFF_MAX=" + cBackoffMax.String(),
		"ORDERDELAY_RECONCILE_INTERVAL=" + cReconcileEvery.String(),
		"ORDERDELAY_RECONCILE_GRACE=" + cReconcileGrace.String(),
		"ORDERDELAY_SCAN_INTERVAL=" + cScanInterval.String(),
		"ORDERDELAY_MAX_ATTEMPTS=20",
		"ORDERDELAY_BATCH_SIZE=50",
		"ORDERDELAY_LOG_LEVEL=warn",
	}
}

// apiTimeout bounds the checkout's calls to a daemon's API.
const apiTimeout = 20 * time.Second

// campaignSchema records every close with when its statement began, the
// clock inside it, and the clock at commit (a deferred constraint trigger
// runs just before the commit), and makes orders named poison-* impossible
// to close.
const campaignSchema = `
CREATE TABLE close_audit (
    id        bigserial PRIMARY KEY,
    serial_no text NOT NULL,
    stmt_at   timestamptz NOT NULL,
    clock_at  timestamptz NOT NULL,
    commit_at timestamptz,
    app       text NOT NULL
);
CREATE FUNCTION campaign_poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'order % is poisonous: it cannot be closed', NEW.serial_no;
END $$;
CREATE TRIGGER orders_poison BEFORE UPDATE OF status ON orders FOR EACH ROW
    WHEN (NEW.status = 'closed' AND NEW.serial_no LIKE 'poison-%')
    EXECUTE FUNCTION campaign_poison();
CREATE FUNCTION campaign_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO close_audit (serial_no, stmt_at, clock_at, app)
    VALUES (NEW.serial_no, statement_timestamp(), clock_timestamp(), current_setting('application_name'));
    RETURN NULL;
END $$;
CREATE TRIGGER orders_close_audit AFTER UPDATE OF status ON orders FOR EACH ROW
    WHEN (NEW.status = 'closed' AND OLD.status IS DISTINCT FROM 'closed')
    EXECUTE FUNCTION campaign_audit();
CREATE FUNCTION campaign_commit_clock() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE close_audit SET commit_at = clock_timestamp() WHERE id = NEW.id;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER close_audit_commit AFTER INSERT ON close_audit
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION campaign_commit_clock();
-- The read-only fault: the daemons' closes run in transactions lib/pq opens
-- with BEGIN READ WRITE, which overrides default_transaction_read_only, so
-- while a row is in campaign_read_only their writes are refused with 25006,
-- as a standby refuses them. The checkout (application_name campaign*) is
-- not a standby's client and keeps writing.
CREATE TABLE campaign_read_only (on_ boolean);
CREATE FUNCTION campaign_refuse_writes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('application_name') NOT LIKE 'campaign%' AND EXISTS (SELECT 1 FROM campaign_read_only) THEN
        RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction' USING ERRCODE = '25006';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER orders_refuse_writes BEFORE UPDATE ON orders FOR EACH ROW
    EXECUTE FUNCTION campaign_refuse_writes();
`

// Outcomes of a deadline write.
const (
	acked      = iota // the producer was told it took effect
	unknown           // failed or timed out: it may or may not have taken effect
	notApplied        // certainly did not take effect
)

// cop is one recorded operation.
type cop struct {
	kind     string // create, create-before-commit, create-died, reschedule, pay, cancel, remove, pay-after-close
	path     string // zadd, api, client (the Redis write), or "" for SQL only
	start    time.Time
	end      time.Time
	deadline time.Time // create / reschedule: the deadline written
	outcome  int       // create / reschedule: acked, unknown, notApplied
	took     bool      // pay: the UPDATE changed the row
	note     string
}

func (o cop) writesDeadline() bool {
	return strings.HasPrefix(o.kind, "create") || o.kind == "reschedule"
}

// corder is one order's history. Only its own goroutine writes it until
// the workload ends.
type corder struct {
	serial string
	poison bool
	died   bool // the checkout died between commit and enqueue
	ops    []cop
}

type fault struct {
	kind       string
	start, end time.Time
	note       string
	// stopped: a replica went away (its closes since its counters were
	// scraped are counted nowhere).
	stopped bool
}

type campaign struct {
	t      *testing.T
	w      *world
	seed   uint64
	t0     time.Time
	db     *sqlx.DB // the checkout's own connections, never read-only
	dbName string
	cli    *client.Client
	redis  *campaignRedis
	pgPx   *testenv.Proxy

	mu      sync.Mutex
	daemons []*daemon
	orders  []*corder
	faults  []fault
	// losses are the windows in which a redis-failover may have lost
	// writes Redis had acknowledged.
	losses []lossWindow
	// counted sums orders_closed_total + orders_reconciled_total of each
	// daemon process the nemesis signalled, scraped before the signal
	// (the live ones are scraped at the end: closeCounts).
	counted float64
}

func (c *campaign) rel(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return fmt.Sprintf("+%.3fs", t.Sub(c.t0).Seconds())
}

func (c *campaign) line(o cop) string {
	s := fmt.Sprintf("  %s..%s %s", c.rel(o.start), c.rel(o.end), o.kind)
	if o.path != "" {
		s += " via " + o.path
	}
	if o.writesDeadline() {
		s += fmt.Sprintf(" deadline %s %s", c.rel(o.deadline), [...]string{"acked", "UNKNOWN", "not applied"}[o.outcome])
	}
	if o.kind == "pay" || o.kind == "cancel" || o.kind == "pay-after-close" {
		s += fmt.Sprintf(" took=%v", o.took)
	}
	if o.note != "" {
		s += " (" + o.note + ")"
	}
	return s
}

func ms(t time.Time) time.Time { return time.UnixMilli(t.UnixMilli()) }

func randDur(rng *rand.Rand, lo, hi time.Duration) time.Duration {
	if hi <= lo {
		return lo
	}
	return lo + time.Duration(rng.Int64N(int64(hi-lo)))
}

func sleepUntil(t time.Time) {
	if d := time.Until(t); d > 0 {
		time.Sleep(d)
	}
}

func TestCampaignHistoryUnderFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("campaign: not in -short")
	}
	// Its own database, key prefix and proxies: it runs in parallel with
	// the other end-to-end tests (its bounds allow for a busy machine).
	t.Parallel()
	duration := 45 * time.Second
	if v := os.Getenv("ORDERDELAY_CAMPAIGN"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("ORDERDELAY_CAMPAIGN=%q: want a duration such as 30m", v)
		}
		duration = d
	}
	seed := rand.Uint64() % 1_000_000_000
	if v := os.Getenv("ORDERDELAY_CAMPAIGN_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("ORDERDELAY_CAMPAIGN_SEED=%q: want a number", v)
		}
		seed = n
	}
	if dl, ok := t.Deadline(); ok && time.Until(dl) < duration+3*time.Minute {
		t.Fatalf("ORDERDELAY_CAMPAIGN=%s does not fit in the test timeout (%s left): pass -timeout %s",
			duration, time.Until(dl).Round(time.Second), (duration + 10*time.Minute).Round(time.Minute))
	}
	t.Logf("campaign seed %d, workload %s, faults %v (replay: ORDERDELAY_CAMPAIGN_SEED=%d)", seed, duration, campaignFaults(t), seed)

	// A private Redis (the nemesis changes its ACL and fails it over);
	// the daemons reach it as a user of their own through a proxy, the
	// checkout through another.
	cr := newCampaignRedis(t, slices.Contains(campaignFaults(t), "redis-failover"))
	w := withDatabase(t, cr.checkout, cr.daemonURL(), queue.NewKeys(queue.DefaultKey))
	c := &campaign{t: t, w: w, seed: seed, redis: cr}
	u, _ := url.Parse(w.dbURL)
	c.dbName = strings.TrimPrefix(u.Path, "/")
	// The checkout's connections stay writable while the nemesis makes the
	// database read-only for new sessions (the daemons').
	q := u.Query()
	q.Set("application_name", "campaign-checkout")
	q.Set("options", "-c default_transaction_read_only=off")
	u.RawQuery = q.Encode()
	db, err := sqlx.Open("postgres", u.String())
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(40)
	t.Cleanup(func() { db.Close() })
	c.db = db
	if _, err := db.Exec(campaignSchema); err != nil {
		t.Fatal(err)
	}
	defer func() { // the database is dropped anyway; keep the test's own state sane
		db.Exec(fmt.Sprintf("ALTER DATABASE %s RESET default_transaction_read_only", c.dbName)) //nolint:errcheck
	}()
	if c.cli, err = client.New(w.rdb, w.keys.Queue); err != nil {
		t.Fatal(err)
	}
	// The daemons reach PostgreSQL through a proxy the test owns; the
	// checkout goes direct.
	c.pgPx = testenv.NewProxy(t, u.Host)
	w.dbURL = viaProxy(t, w.dbURL, c.pgPx.Addr())

	for range 2 {
		c.daemons = append(c.daemons, c.startDaemon())
	}
	c.t0 = time.Now()

	ctx, stopWorkload := context.WithCancel(context.Background())
	var lives sync.WaitGroup
	var checkouts sync.WaitGroup
	const checkoutWorkers = 4
	for k := range checkoutWorkers {
		checkouts.Add(1)
		go func() {
			defer checkouts.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(k)))
			sem := make(chan struct{}, 150) // lives in flight per worker
			for i := 0; ctx.Err() == nil; i++ {
				time.Sleep(randDur(rng, 20*time.Millisecond, 120*time.Millisecond))
				sem <- struct{}{}
				lives.Add(1)
				lifeSeed := rng.Uint64()
				go func() {
					defer func() { <-sem; lives.Done() }()
					c.life(fmt.Sprintf("%d-%06d", k, i), rand.New(rand.NewPCG(seed, lifeSeed)))
				}()
			}
		}()
	}

	c.nemesis(rand.New(rand.NewPCG(seed, 1<<40)), c.t0.Add(duration))
	faultsEnd := time.Now()
	stopWorkload()
	checkouts.Wait()
	lives.Wait()
	t.Logf("workload and faults stopped at %s; %d orders; quiescing", c.rel(faultsEnd), len(c.orders))
	c.check(faultsEnd)
}

// life drives one order through a random checkout life.
func (c *campaign) life(id string, rng *rand.Rand) {
	o := &corder{serial: "c-" + id}
	roll := rng.Float64()
	switch {
	case roll < 0.01:
		o.poison, o.serial = true, "poison-"+id
	case roll < 0.04:
		o.died = true
	}
	c.mu.Lock()
	c.orders = append(c.orders, o)
	c.mu.Unlock()

	deadline := ms(time.Now().Add(randDur(rng, 300*time.Millisecond, 2500*time.Millisecond)))
	path := c.pickPath(rng)
	switch {
	case o.died:
		c.createDied(o, deadline)
		return
	case !o.poison && rng.Float64() < 0.2:
		c.createBeforeCommit(o, deadline, path, randDur(rng, 50*time.Millisecond, 800*time.Millisecond))
	default:
		c.createAfterCommit(o, deadline, path)
	}
	if o.poison {
		return
	}
	if rng.Float64() < 0.5 {
		for range 1 + rng.IntN(2) {
			at := time.Now().Add(randDur(rng, 0, max(0, time.Until(deadline))+600*time.Millisecond))
			earlierOrLater := randDur(rng, 100*time.Millisecond, 2500*time.Millisecond)
			p := c.pickPath(rng)
			sleepUntil(at)
			next := ms(time.Now().Add(earlierOrLater))
			if !c.reschedule(o, next, p) {
				return // settled meanwhile: a checkout does not reschedule it
			}
			deadline = next
		}
	}
	fin := rng.Float64()
	jitter := randDur(rng, 0, 600*time.Millisecond) - 300*time.Millisecond
	p := c.pickPath(rng)
	switch {
	case fin < 0.3:
		sleepUntil(deadline.Add(jitter))
		c.pay(o, "pay")
	case fin < 0.4:
		sleepUntil(time.Now().Add(time.Duration(rng.Float64() * float64(max(0, time.Until(deadline))))))
		if c.pay(o, "cancel") {
			c.remove(o, p)
		}
	case fin < 0.5:
		// Pay after the close: wait (bounded) until it is closed.
		until := time.Now().Add(30 * time.Second)
		for time.Now().Before(until) {
			var st string
			if err := c.db.Get(&st, "SELECT status FROM orders WHERE serial_no = $1", o.serial); err == nil && st == "closed" {
				c.pay(o, "pay-after-close")
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

func (c *campaign) pickPath(rng *rand.Rand) string {
	return [...]string{"zadd", "api", "client"}[rng.IntN(3)]
}

func (c *campaign) record(o *corder, op cop) { o.ops = append(o.ops, op) }

// enqueue writes the deadline to Redis by one of the three producer paths.
// It returns acked, unknown or notApplied.
func (c *campaign) enqueue(serial string, deadline time.Time, path string, reschedule bool) (int, string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	switch path {
	case "zadd":
		if err := c.w.rdb.ZAdd(ctx, c.w.keys.Queue, redis.Z{Score: float64(deadline.UnixMilli()), Member: serial}).Err(); err != nil {
			return unknown, err.Error()
		}
		return acked, ""
	case "client":
		mode := client.Create
		if reschedule {
			mode = client.Reschedule
		}
		res, at, err := c.cli.Enqueue(ctx, serial, deadline, mode)
		if err != nil {
			return unknown, err.Error()
		}
		if !at.Equal(deadline) {
			return acked, fmt.Sprintf("client says %s, deadline %s", res, c.rel(at))
		}
		return acked, ""
	default:
		body := map[string]any{"at": deadline.UTC().Format(time.RFC3339Nano)}
		if reschedule {
			body["reschedule"] = true
		}
		b, _ := json.Marshal(body)
		actx, acancel := context.WithTimeout(context.Background(), apiTimeout)
		defer acancel()
		code, rb, err := c.pickDaemon().try(actx, http.MethodPut, "/v1/timeouts/"+serial, "", string(b))
		if err != nil {
			return unknown, err.Error()
		}
		switch {
		case code == http.StatusOK || code == http.StatusCreated:
			var got struct {
				DeadlineMS int64 `json:"deadline_ms"`
			}
			if json.Unmarshal(rb, &got) == nil && got.DeadlineMS != deadline.UnixMilli() {
				return acked, fmt.Sprintf("api kept deadline %s", c.rel(time.UnixMilli(got.DeadlineMS)))
			}
			return acked, ""
		case code >= 400 && code < 500:
			return notApplied, fmt.Sprintf("api %d %s", code, strings.TrimSpace(string(rb)))
		default: // 503: Redis unreachable, but the command may have reached it
			return unknown, fmt.Sprintf("api %d", code)
		}
	}
}

func (c *campaign) pickDaemon() *daemon {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.daemons[rand.IntN(len(c.daemons))]
}

func (c *campaign) createAfterCommit(o *corder, deadline time.Time, path string) {
	op := cop{kind: "create", path: path, start: time.Now(), deadline: deadline}
	if err := insertOrders(c.db, []string{o.serial}, deadline); err != nil {
		op.end, op.outcome, op.note = time.Now(), notApplied, err.Error()
		c.record(o, op)
		return
	}
	// The row is committed: the deadline holds whatever Redis says.
	var r int
	r, op.note = c.enqueue(o.serial, deadline, path, false)
	op.end, op.outcome = time.Now(), acked
	if r != acked {
		op.note = "enqueue failed, the reconciler must close it: " + op.note
	}
	c.record(o, op)
}

func (c *campaign) createBeforeCommit(o *corder, deadline time.Time, path string, hold time.Duration) {
	op := cop{kind: "create-before-commit", path: path, start: time.Now(), deadline: deadline}
	tx, err := c.db.Begin()
	if err == nil {
		err = insertOrders(tx, []string{o.serial}, deadline)
	}
	if err != nil {
		if tx != nil {
			tx.Rollback() //nolint:errcheck
		}
		op.end, op.outcome, op.note = time.Now(), notApplied, err.Error()
		c.record(o, op)
		return
	}
	r, note := c.enqueue(o.serial, deadline, path, false)
	time.Sleep(hold)
	if err := tx.Commit(); err != nil {
		op.end, op.outcome, op.note = time.Now(), unknown, "commit: "+err.Error()
		c.record(o, op)
		return
	}
	op.end, op.outcome, op.note = time.Now(), acked, note
	if r != acked {
		op.note = "enqueue failed, the reconciler must close it: " + note
	}
	c.record(o, op)
}

func (c *campaign) createDied(o *corder, deadline time.Time) {
	op := cop{kind: "create-died", start: time.Now(), deadline: deadline, outcome: acked}
	if err := insertOrders(c.db, []string{o.serial}, deadline); err != nil {
		op.outcome, op.note = notApplied, err.Error()
	}
	op.end = time.Now()
	c.record(o, op)
}

// reschedule moves the deadline as a checkout would: the row first, then
// Redis. It reports false when the order was no longer pending.
func (c *campaign) reschedule(o *corder, deadline time.Time, path string) bool {
	op := cop{kind: "reschedule", path: path, start: time.Now(), deadline: deadline}
	res, err := c.db.Exec("UPDATE orders SET expires_at = $2 WHERE serial_no = $1 AND status = 'pending'", o.serial, deadline)
	var n int64
	if err == nil {
		n, err = res.RowsAffected()
	}
	if err != nil || n == 0 {
		op.end, op.outcome, op.note = time.Now(), notApplied, "order no longer pending"
		if err != nil {
			op.note = err.Error()
		}
		c.record(o, op)
		return false
	}
	op.outcome, op.note = c.enqueue(o.serial, deadline, path, true)
	if op.outcome == notApplied {
		// The row moved but Redis refused: the row's deadline is still a
		// producer's word, so count it as possibly in effect.
		op.outcome = unknown
	}
	op.end = time.Now()
	c.record(o, op)
	return true
}

func (c *campaign) pay(o *corder, kind string) bool {
	op := cop{kind: kind, start: time.Now()}
	res, err := c.db.Exec("UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1 AND status = 'pending'", o.serial)
	if err == nil {
		var n int64
		n, err = res.RowsAffected()
		op.took = n == 1
	}
	if err != nil {
		op.note = err.Error()
	}
	op.end = time.Now()
	c.record(o, op)
	return op.took
}

func (c *campaign) remove(o *corder, path string) {
	op := cop{kind: "remove", path: path, start: time.Now()}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var err error
	switch path {
	case "zadd":
		op.path = "zrem"
		err = c.w.rdb.ZRem(ctx, c.w.keys.Queue, o.serial).Err()
	case "client":
		if err = c.cli.Cancel(ctx, o.serial); errors.Is(err, client.ErrNotFound) {
			err, op.note = nil, "not found"
		}
	default:
		actx, acancel := context.WithTimeout(context.Background(), apiTimeout)
		defer acancel()
		var code int
		if code, _, err = c.pickDaemon().try(actx, http.MethodDelete, "/v1/timeouts/"+o.serial, "", ""); err == nil {
			op.note = fmt.Sprintf("api %d", code)
		}
	}
	if err != nil {
		op.note = err.Error()
	}
	op.end = time.Now()
	c.record(o, op)
}

// scrape reads one daemon's close counters (false if it cannot be reached).
func (c *campaign) scrape(d *daemon) (float64, bool) {
	m, ok := c.metricsOf(d)
	return m["orderdelay_orders_closed_total"] + m["orderdelay_orders_reconciled_total"], ok
}

// metricsOf is one daemon's metrics (false if it cannot be reached).
func (c *campaign) metricsOf(d *daemon) (map[string]float64, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	code, b, err := d.try(ctx, http.MethodGet, "/metrics", "", "")
	if err != nil || code != http.StatusOK {
		return nil, false
	}
	return parseMetrics(string(b)), true
}

// errorsOf sums orderdelay_errors_total over the replicas, to tell
// whether a fault reached them.
func (c *campaign) errorsOf() float64 {
	c.mu.Lock()
	ds := slices.Clone(c.daemons)
	c.mu.Unlock()
	var n float64
	for _, d := range ds {
		m, _ := c.metricsOf(d)
		n += m["orderdelay_errors_total"]
	}
	return n
}

// leaseDetail describes a lease record for a violation's report: the
// record, and its batch's expiry and count, against Redis's clock.
func (c *campaign) leaseDetail(rec string) string {
	ctx := context.Background()
	k := c.w.keys
	now, _ := c.w.rdb.Time(ctx).Result()
	out := fmt.Sprintf("%q (Redis time %d)", rec, now.UnixMilli())
	r, ok := queue.ParseLeaseRecord(rec)
	if !ok || r.Backoff() {
		return out
	}
	if exp, err := c.w.rdb.ZScore(ctx, k.Leases, r.Token).Result(); err == nil {
		out += fmt.Sprintf(", batch expires %.0f", exp)
	} else {
		out += ", batch in no lease index"
	}
	n, err := c.w.rdb.HGet(ctx, k.LeaseBatch, "#"+r.Token).Result()
	if err != nil {
		n = "none"
	}
	return out + ", batch count " + n
}

// stopDaemon scrapes replica i's close counters and kills it (SIGKILL)
// or stops it (SIGTERM, saying how it exited).
func (c *campaign) stopDaemon(i int, kill bool) string {
	c.mu.Lock()
	d := c.daemons[i]
	c.mu.Unlock()
	n, _ := c.scrape(d)
	c.counted += n
	if kill {
		d.kill()
		return ""
	}
	return fmt.Sprintf("exit %d", d.stop())
}

// startDaemon starts a replica with the campaign's settings and waits
// until it is ready.
func (c *campaign) startDaemon() *daemon {
	d := c.w.start(campaignSettings()...)
	if os.Getenv("ORDERDELAY_CAMPAIGN_FULL_LOGS") == "1" {
		d.LogTail = 0
	}
	return d
}

// restartDaemon starts a new replica i and waits until it is ready.
func (c *campaign) restartDaemon(i int) {
	nd := c.startDaemon()
	c.mu.Lock()
	c.daemons[i] = nd
	c.mu.Unlock()
}

// nemesis injects one fault at a time until end, healing each before the
// next. It runs on the test goroutine (it restarts daemons).
func (c *campaign) nemesis(rng *rand.Rand, end time.Time) {
	kinds := campaignFaults(c.t)
	for time.Until(end) > 0 {
		time.Sleep(randDur(rng, 500*time.Millisecond, 2500*time.Millisecond))
		if time.Until(end) <= 0 {
			break
		}
		if len(kinds) == 0 {
			continue
		}
		kind := kinds[rng.IntN(len(kinds))]
		i := rng.IntN(len(c.daemons))
		hold := randDur(rng, 500*time.Millisecond, 3*time.Second)
		f := fault{kind: kind, start: time.Now()}
		switch kind {
		case "sigkill", "sigterm":
			f.note, f.stopped = c.stopDaemon(i, kind == "sigkill"), true
			time.Sleep(hold / 3)
			c.restartDaemon(i)
		case "sigstop":
			c.mu.Lock()
			d := c.daemons[i]
			c.mu.Unlock()
			d.Signal(syscall.SIGSTOP)
			time.Sleep(cLease + hold)
			d.Signal(syscall.SIGCONT)
		case "redis-cut":
			c.redis.daemonPx.Down()
			time.Sleep(hold)
			c.redis.daemonPx.Up()
		case "redis-refuse":
			// Sometimes for longer than a lease, so a claim's lease runs
			// out while its finish is refused.
			if rng.IntN(2) == 0 {
				hold += cLease
			}
			cmd := refusable[rng.IntN(len(refusable))]
			errs := c.errorsOf()
			c.redis.acl("-" + cmd)
			f.note = "-" + cmd
			// A third of the time a replica is stopped while refused: its
			// drain and hand-back meet the refusal. It restarts once the
			// command is back (a start refused a command it needs exits 2).
			sigterm := rng.IntN(3) == 0
			if sigterm {
				time.Sleep(hold / 3)
				f.note += ", sigterm while refused: " + c.stopDaemon(i, false)
				f.stopped = true
			}
			time.Sleep(hold)
			if !sigterm {
				f.note += fmt.Sprintf(" (%.0f errors counted)", c.errorsOf()-errs)
			}
			c.redis.acl("+" + cmd)
			if sigterm {
				c.restartDaemon(i)
			}
		case "redis-failover":
			var w lossWindow
			w, f.note = c.redis.failover(hold / 2)
			c.losses = append(c.losses, w)
			f.note += fmt.Sprintf(", writes acked %s..%s may be lost", c.rel(w.since), c.rel(w.until))
		case "pg-cut":
			c.pgPx.Down()
			time.Sleep(hold)
			c.pgPx.Up()
		case "read-only":
			c.readOnly(true)
			time.Sleep(hold + time.Second)
			c.readOnly(false)
		case "row-locks":
			f.note = c.lockRows(rng.IntN(5)+1, cStmtTimeout+hold)
		case "stall":
			n := 1 + rng.IntN(3)
			for range n {
				c.pgPx.Stall(cStmtTimeout + hold/2)
				time.Sleep(cStmtTimeout + hold/2 + 200*time.Millisecond)
			}
			f.note = fmt.Sprintf("%d stalls", n)
		}
		f.end = time.Now()
		c.faults = append(c.faults, f)
	}
	// Every replica is up (restarts wait for readiness) and every fault healed.
}

var allFaults = []string{"sigkill", "sigterm", "sigstop", "redis-cut", "pg-cut", "read-only", "row-locks", "stall", "redis-refuse", "redis-failover"}

// campaignFaults is the nemesis's repertoire: ORDERDELAY_CAMPAIGN_FAULTS
// (comma-separated; "none" for a run without faults), else every fault.
func campaignFaults(t *testing.T) []string {
	v := os.Getenv("ORDERDELAY_CAMPAIGN_FAULTS")
	if v == "" {
		return allFaults
	}
	if v == "none" {
		return nil
	}
	var out []string
	for _, f := range strings.Split(v, ",") {
		if !slices.Contains(allFaults, strings.TrimSpace(f)) {
			t.Fatalf("ORDERDELAY_CAMPAIGN_FAULTS: unknown fault %q; known: %v", f, allFaults)
		}
		out = append(out, strings.TrimSpace(f))
	}
	return out
}

// readOnly makes this test's own database read-only for new sessions (or
// writable again) and ends the daemons' sessions on it, as a failover to a
// standby would.
func (c *campaign) readOnly(on bool) {
	stmt := fmt.Sprintf("ALTER DATABASE %s SET default_transaction_read_only = on", c.dbName)
	if !on {
		stmt = fmt.Sprintf("ALTER DATABASE %s RESET default_transaction_read_only", c.dbName)
	}
	if _, err := c.db.Exec(stmt); err != nil {
		c.t.Fatalf("read-only fault: %v", err)
	}
	if _, err := c.db.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name NOT LIKE 'campaign%'`, c.dbName); err != nil {
		c.t.Fatalf("read-only fault: terminate: %v", err)
	}
	flag := `DELETE FROM campaign_read_only`
	if on {
		flag = `INSERT INTO campaign_read_only VALUES (true)`
	}
	if _, err := c.db.Exec(flag); err != nil {
		c.t.Fatalf("read-only fault: %v", err)
	}
}

// lockRows holds row locks on up to n pending orders due about now, for
// hold (longer than the daemon's statement timeout).
func (c *campaign) lockRows(n int, hold time.Duration) string {
	tx, err := c.db.Begin()
	if err != nil {
		return err.Error()
	}
	defer tx.Rollback() //nolint:errcheck
	rows, err := tx.Query(`SELECT serial_no FROM orders
		WHERE status = 'pending' AND expires_at < now() + interval '1 second'
		ORDER BY random() LIMIT $1 FOR UPDATE SKIP LOCKED`, n)
	if err != nil {
		return err.Error()
	}
	var got []string
	for rows.Next() {
		var s string
		rows.Scan(&s) //nolint:errcheck
		got = append(got, s)
	}
	rows.Close()
	time.Sleep(hold)
	return fmt.Sprintf("%s held on %s", hold.Round(time.Millisecond), strings.Join(got, ","))
}

type auditRow struct {
	Serial   string    `db:"serial_no"`
	StmtAt   time.Time `db:"stmt_at"`
	ClockAt  time.Time `db:"clock_at"`
	CommitAt time.Time `db:"commit_at"`
	App      string    `db:"app"`
}

type violation struct {
	kind, serial, msg string
}

// bounds returns, for a close that began at b, the earliest deadline it may
// honour: the latest deadline a producer had acknowledged before b, or any
// deadline written after that one whose write had begun by b and was not
// certainly refused (in flight at b, or of unknown outcome).
func bounds(ops []cop, b time.Time) (lower time.Time, ok bool) {
	last := -1
	for i, o := range ops {
		if o.writesDeadline() && o.outcome == acked && o.end.Before(b) {
			last = i
		}
	}
	if last >= 0 {
		lower, ok = ops[last].deadline, true
	}
	for i := last + 1; i < len(ops); i++ {
		o := ops[i]
		if o.writesDeadline() && o.outcome != notApplied && o.start.Before(b) {
			if !ok || o.deadline.Before(lower) {
				lower, ok = o.deadline, true
			}
		}
	}
	return lower, ok
}

// pendingUnpaid is the number of orders still pending that the daemons
// must close (every one but the poisonous).
func (c *campaign) pendingUnpaid() int {
	var n int
	if err := c.db.Get(&n, "SELECT count(*) FROM orders WHERE status = 'pending' AND serial_no NOT LIKE 'poison-%'"); err != nil {
		c.t.Fatal(err)
	}
	return n
}

// final is the latest deadline the order may hold once everything is
// quiet: the last acknowledged write's, or any later write of unknown
// outcome, and the row's.
func final(ops []cop, row time.Time) time.Time {
	last := -1
	for i, o := range ops {
		if o.writesDeadline() && o.outcome == acked {
			last = i
		}
	}
	f := row
	for i, o := range ops {
		if o.writesDeadline() && o.outcome != notApplied && i >= last && o.deadline.After(f) {
			f = o.deadline
		}
	}
	return f
}

func (c *campaign) check(faultsEnd time.Time) {
	t := c.t
	byID := map[string]*corder{}
	for _, o := range c.orders {
		byID[o.serial] = o
	}
	type row struct {
		Serial  string       `db:"serial_no"`
		Status  string       `db:"status"`
		Expires time.Time    `db:"expires_at"`
		PaidAt  sql.NullTime `db:"paid_at"`
	}
	loadRows := func() map[string]row {
		var rows []row
		if err := c.db.Select(&rows, "SELECT serial_no, status, expires_at, paid_at FROM orders"); err != nil {
			t.Fatal(err)
		}
		m := map[string]row{}
		for _, r := range rows {
			m[r.Serial] = r
		}
		return m
	}
	// The history as the daemons may be held to it: a reschedule a Redis
	// failover may have lost counts as one of unknown outcome.
	type held struct {
		ops  []cop
		lost bool
	}
	heldOps := map[string]held{}
	mayBeLostOrders := 0
	for _, o := range c.orders {
		ops, lost := durableOps(o.ops, c.losses)
		heldOps[o.serial] = held{ops, lost}
		if lost {
			mayBeLostOrders++
		}
	}
	// Wait until every unpaid order must have been closed.
	quiet := faultsEnd
	for _, r := range loadRows() {
		if o := byID[r.Serial]; o != nil {
			h := heldOps[o.serial]
			if f := finalDeadline(h.ops, r.Expires, h.lost); f.After(quiet) {
				quiet = f
			}
		}
	}
	// Once every unpaid order is closed nothing the checks read can change
	// (an order closed, paid or poisonous is never closed again; what is
	// left in Redis is waited for below), so the wait ends there; mustBy
	// is when an unpaid order still pending is a violation.
	mustBy := quiet.Add(cSettle)
	for time.Now().Before(mustBy) && c.pendingUnpaid() > 0 {
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("checked at %s: every unpaid order was to be closed by %s (latest final deadline %s + %s)",
		c.rel(time.Now()), c.rel(mustBy), c.rel(quiet), cSettle)

	rows := loadRows()
	var audits []auditRow
	if err := c.db.Select(&audits, "SELECT serial_no, stmt_at, clock_at, COALESCE(commit_at, clock_at) AS commit_at, app FROM close_audit ORDER BY id"); err != nil {
		t.Fatal(err)
	}
	auditsOf := map[string][]auditRow{}
	for _, a := range audits {
		auditsOf[a.Serial] = append(auditsOf[a.Serial], a)
	}
	ctx := context.Background()
	k := c.w.keys
	where := func(serial string) string {
		var at []string
		for name, key := range map[string]string{"queue": k.Queue, "inflight": k.Inflight, "dead": k.Dead} {
			if _, err := c.w.rdb.ZScore(ctx, key, serial).Result(); err == nil {
				at = append(at, name)
			}
		}
		if rec, err := c.w.rdb.HGet(ctx, k.Lease, serial).Result(); err == nil {
			at = append(at, "lease "+c.leaseDetail(rec)) // a batch lease's member has no entry of its own
		}
		if len(at) == 0 {
			return "in no queue key: the reconciler's to close"
		}
		sort.Strings(at)
		return "in " + strings.Join(at, ", ")
	}
	var vs []violation
	add := func(kind, serial, format string, args ...any) {
		vs = append(vs, violation{kind, serial, fmt.Sprintf(format, args...)})
	}
	checked := 0
	excused := 0               // closes early against a reschedule a failover may have lost
	lostTo := map[string]int{} // early closes by the write whose deadline they broke
	for _, o := range c.orders {
		r, exists := rows[o.serial]
		as := auditsOf[o.serial]
		h := heldOps[o.serial]
		// 3: a close counted twice.
		if len(as) > 1 {
			add("3 closed twice", o.serial, "%d close audit rows", len(as))
		}
		// 1: no close before the latest acknowledged deadline.
		for _, a := range as {
			checked++
			lower, ok := bounds(h.ops, a.StmtAt)
			if h.lost {
				if strict, sok := bounds(o.ops, a.StmtAt); sok && a.CommitAt.Before(strict) && !(ok && a.CommitAt.Before(lower)) {
					excused++ // early only against a write the failover lost
				}
			}
			if ok && a.CommitAt.Before(lower) {
				by := "?"
				for _, op := range h.ops {
					if op.writesDeadline() && op.start.Before(a.StmtAt) && op.deadline.Equal(lower) {
						by = op.kind + " via " + op.path
					}
				}
				lostTo[by]++
				add("1 closed early", o.serial, "close by %s began %s, committed %s, %s before the deadline %s set by %s",
					a.App, c.rel(a.StmtAt), c.rel(a.CommitAt), lower.Sub(a.CommitAt).Round(time.Millisecond), c.rel(lower), by)
			}
		}
		// 2: a paid order closed.
		for _, op := range o.ops {
			if op.took && (len(as) > 0 || r.Status == "closed") {
				add("2 paid order closed", o.serial, "%s took effect at %s..%s, status %s", op.kind, c.rel(op.start), c.rel(op.end), r.Status)
			}
		}
		// 4: an unpaid order not closed in time.
		if exists && !o.poison && r.Status != "paid" {
			f := finalDeadline(h.ops, r.Expires, h.lost)
			by := f
			if faultsEnd.After(by) {
				by = faultsEnd
			}
			by = by.Add(cSettle)
			switch {
			case r.Status == "pending":
				add("4 never closed", o.serial, "still pending %s after its final deadline %s (faults stopped %s), %s",
					time.Since(f).Round(time.Millisecond), c.rel(f), c.rel(faultsEnd), where(o.serial))
			case len(as) > 0 && as[0].CommitAt.After(by):
				add("4 closed late", o.serial, "closed %s, due by %s (final deadline %s)", c.rel(as[0].CommitAt), c.rel(by), c.rel(f))
			}
		}
	}

	// 6: nothing left in the queue for a settled order, once quiet. (Read
	// first: until they are gone such entries may still be dead-lettered,
	// which 5 must see.)
	leftovers := func() map[string]string {
		out := map[string]string{}
		q, _ := c.w.rdb.ZRange(ctx, k.Queue, 0, -1).Result()
		in, _ := c.w.rdb.ZRange(ctx, k.Inflight, 0, -1).Result()
		ls, _ := c.w.rdb.HKeys(ctx, k.Lease).Result()
		cur := loadRows()
		for name, members := range map[string][]string{"queue": q, "inflight": in, "lease": ls} {
			for _, s := range members {
				if r, ok := cur[s]; ok && r.Status != "pending" {
					out[s] += " " + name
				}
			}
		}
		return out
	}
	// Leftovers get as long as they had before the wait above could end
	// early: until 30 s past mustBy.
	end := mustBy
	if time.Now().After(end) {
		end = time.Now()
	}
	left := leftovers()
	for end = end.Add(30 * time.Second); len(left) > 0 && time.Now().Before(end); left = leftovers() {
		time.Sleep(500 * time.Millisecond)
	}
	// 5: dead letters only for poisonous orders.
	dead, err := c.w.rdb.HGetAll(ctx, k.DeadInfo).Result()
	if err != nil {
		t.Fatal(err)
	}
	deadSet, _ := c.w.rdb.ZRange(ctx, k.Dead, 0, -1).Result()
	for _, s := range deadSet {
		if _, ok := dead[s]; !ok {
			dead[s] = "(no deadinfo)"
		}
	}
	for s, info := range dead {
		if o := byID[s]; o != nil && len(o.ops) > 0 && o.ops[0].outcome != acked {
			continue // its row may never have been committed: not_found is right
		}
		if !strings.HasPrefix(s, "poison-") {
			add("5 dead letter", s, "dead-lettered: %s", info)
		}
	}
	for s, where := range left {
		add("6 entry left behind", s, "settled (%s) but still in%s", rows[s].Status, where)
	}
	// 3 (counters): no close counted twice by the daemons' metrics.
	exact := true // no replica went away, so the counters saw every close
	for _, f := range c.faults {
		exact = exact && !f.stopped
	}
	c.mu.Lock()
	counted, audited, complete, still := closeCounts(c.counted, func() (float64, bool) {
		sum, all := 0.0, true
		for _, d := range c.daemons {
			n, ok := c.scrape(d)
			sum += n
			all = all && ok
		}
		return sum, all
	}, func() int {
		var n int
		if err := c.db.Get(&n, "SELECT count(*) FROM close_audit"); err != nil {
			t.Fatal(err)
		}
		return n
	})
	c.mu.Unlock()
	exact = exact && complete && still
	switch {
	case counted > float64(audited):
		add("3 closed twice", "(metrics)", "the replicas counted %.0f closes, the audit holds %d (counters of killed replicas scraped before the kill)",
			counted, audited)
	case exact && counted != float64(audited):
		add("3 close miscounted", "(metrics)", "the replicas counted %.0f closes (orders_closed_total + orders_reconciled_total), the audit holds %d, and no replica went away",
			counted, audited)
	}

	// Summary.
	ops := map[string]int{}
	for _, o := range c.orders {
		for _, op := range o.ops {
			key := op.kind
			if op.path != "" {
				key += " via " + op.path
			}
			ops[key]++
		}
	}
	faults := map[string]int{}
	for _, f := range c.faults {
		faults[f.kind]++
	}
	status := map[string]int{}
	for _, r := range rows {
		status[r.Status]++
	}
	var b strings.Builder
	fmt.Fprintf(&b, "campaign seed %d: %d orders %v, %d closes checked, %d dead letters\n", c.seed, len(c.orders), status, checked, len(dead))
	fmt.Fprintf(&b, "operations:%s\nfaults:%s\n", sortedCounts(ops), sortedCounts(faults))
	for _, f := range c.faults {
		fmt.Fprintf(&b, "  fault %s %s..%s %s\n", f.kind, c.rel(f.start), c.rel(f.end), f.note)
	}
	if len(c.losses) > 0 {
		fmt.Fprintf(&b, "orders with a reschedule a Redis failover may have lost: %d; closes before such a reschedule's deadline (allowed): %d\n", mayBeLostOrders, excused)
	}
	if len(lostTo) > 0 {
		fmt.Fprintf(&b, "early closes by the write they broke:%s\n", sortedCounts(lostTo))
	}
	byKind := map[string][]violation{}
	for _, v := range vs {
		byKind[v.kind] = append(byKind[v.kind], v)
	}
	kinds := make([]string, 0, len(byKind))
	for kd := range byKind {
		kinds = append(kinds, kd)
	}
	sort.Strings(kinds)
	for _, kd := range kinds {
		list := byKind[kd]
		fmt.Fprintf(&b, "VIOLATION %s: %d order(s)\n", kd, len(list))
		for i, v := range list {
			if i == 5 {
				fmt.Fprintf(&b, "  ... and %d more\n", len(list)-5)
				break
			}
			fmt.Fprintf(&b, " %s: %s\n", v.serial, v.msg)
			if o := byID[v.serial]; o != nil {
				for _, op := range heldOps[o.serial].ops {
					fmt.Fprintln(&b, c.line(op))
				}
				for _, a := range auditsOf[v.serial] {
					fmt.Fprintf(&b, "  close by %s: began %s, committed %s\n", a.App, c.rel(a.StmtAt), c.rel(a.CommitAt))
				}
				if r, ok := rows[v.serial]; ok {
					fmt.Fprintf(&b, "  final row: %s, expires %s\n", r.Status, c.rel(r.Expires))
				}
				for _, f := range c.faults {
					if !f.end.Before(o.ops[0].start.Add(-time.Second)) && f.start.Before(o.ops[len(o.ops)-1].end.Add(10*time.Second)) {
						fmt.Fprintf(&b, "  fault %s %s..%s %s\n", f.kind, c.rel(f.start), c.rel(f.end), f.note)
					}
				}
			}
		}
	}
	t.Log(b.String())
	if len(vs) > 0 {
		t.Errorf("%d violation(s) of %d kind(s) %v; replay with ORDERDELAY_CAMPAIGN_SEED=%d", len(vs), len(kinds), kinds, c.seed)
	}
}

// closeCounts reads the replicas' close counters (scrape: the live
// replicas' orders_closed_total + orders_reconciled_total, and whether
// every one answered; killed: what replicas that went away had counted)
// and the audit's count of committed closes, for check 3.
//
// A close is in the audit from its commit, and in a counter only after
// it: so the audit is read after the counters, and every close a counter
// holds is in it. (The audit the other checks read earlier lacks closes
// that committed since — orders still pending then, reported as never
// closed, closed while the checker waited for leftovers — which counters
// scraped later hold: compared with that read, the counters were ahead of
// the audit by closes nobody counted twice.) Equality needs a moment when
// nothing closed: the audit is read before the counters too, and the
// reads are repeated, a few times, until both audit reads agree (quiet).
func closeCounts(killed float64, scrape func() (float64, bool), audit func() int) (counted float64, audited int, complete, quiet bool) {
	for range 5 {
		before := audit()
		live, all := scrape()
		counted, audited, complete = killed+live, audit(), all
		if audited == before {
			return counted, audited, complete, true
		}
	}
	return counted, audited, complete, false
}

func sortedCounts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%d", k, m[k])
	}
	return b.String()
}

// TestCampaignCloseCountsReadTheAuditAfterTheCounters pins check 3's
// reading of the counters: a close that commits (and is counted) while
// the checker reads is in the audit as well as in the counters, never
// taken for a close counted twice; a close counted twice still is.
func TestCampaignCloseCountsReadTheAuditAfterTheCounters(t *testing.T) {
	type world struct{ audit, counter int }
	cases := []struct {
		name string
		// late closes land (commit, then are counted) at the given scrape
		// calls (1-based): between the audit's reads.
		lateAt     map[int]int
		twice      int // closes counted twice
		wantExcess bool
	}{
		{name: "quiet"},
		{name: "a close lands just before the scrape", lateAt: map[int]int{1: 3}},
		{name: "closes land at every scrape", lateAt: map[int]int{1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1, 8: 1, 9: 1, 10: 1}},
		{name: "a close counted twice", twice: 1, wantExcess: true},
		{name: "a close counted twice and one landing", lateAt: map[int]int{1: 1}, twice: 1, wantExcess: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w := world{audit: 100, counter: 100 + tc.twice}
			scrapes := 0
			counted, audited, complete, quiet := closeCounts(7, func() (float64, bool) {
				scrapes++
				w.audit += tc.lateAt[scrapes]   // committed...
				w.counter += tc.lateAt[scrapes] // ...and counted before this scrape read it
				return float64(w.counter - 7), true
			}, func() int { return w.audit })
			if !complete {
				t.Fatal("every replica answered, yet the count is not complete")
			}
			if excess := counted > float64(audited); excess != tc.wantExcess {
				t.Fatalf("counted %v, audited %d: excess %v, want %v", counted, audited, excess, tc.wantExcess)
			}
			if !tc.wantExcess && quiet && counted != float64(audited) {
				t.Fatalf("counted %v, audited %d at a quiet moment, want equal", counted, audited)
			}
			if len(tc.lateAt) == 0 && !quiet {
				t.Fatal("nothing closed while the checker read, yet it found no quiet moment")
			}
		})
	}
}

// TestCampaignCheckerBounds pins the checker's reading of the contract, so
// a campaign failure is the daemon's and not the checker's.
func TestCampaignCheckerBounds(t *testing.T) {
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return base.Add(time.Duration(s * float64(time.Second))) }
	w := func(kind string, start, end, deadline float64, outcome int) cop {
		return cop{kind: kind, start: at(start), end: at(end), deadline: at(deadline), outcome: outcome}
	}
	ops := []cop{
		w("create", 0, 0.1, 5, acked),
		w("reschedule", 1, 1.1, 3, unknown),     // superseded by the next acked write
		w("reschedule", 2, 2.1, 8, acked),       // acked at 2.1
		w("reschedule", 3, 3.5, 10, notApplied), // certainly refused
		{kind: "pay", start: at(3.6), end: at(3.7)},
		w("reschedule", 4, 4.5, 6, acked), // earlier, in flight 4..4.5
		w("reschedule", 5, 5.1, 12, unknown),
	}
	cases := []struct {
		began float64
		want  float64
		ok    bool
	}{
		{-1, 0, false},  // before anything was written
		{0.05, 5, true}, // the create is in flight: its deadline may hold
		{0.5, 5, true},  // after the create's ack
		{1.05, 3, true}, // an earlier deadline in flight
		{1.5, 3, true},  // unknown outcome: it may have taken effect
		{2.05, 3, true}, // the later write is in flight, the unknown one may hold
		{2.5, 8, true},  // acked later deadline supersedes
		{3.2, 8, true},  // a refused write changes nothing
		{4.2, 6, true},  // an earlier deadline in flight may already hold
		{4.8, 6, true},  // acked
		{5.5, 6, true},  // a later write of unknown outcome: the earlier acked one may still hold
	}
	for _, c := range cases {
		got, ok := bounds(ops, at(c.began))
		if ok != c.ok || (ok && !got.Equal(at(c.want))) {
			t.Errorf("close began at %v: bound %v (%v), want %v (%v)", c.began, got.Sub(base).Seconds(), ok, c.want, c.ok)
		}
	}
	// The final deadline: the last acked write's, a later unknown one's, or the row's.
	if got := final(ops, at(6)); !got.Equal(at(12)) {
		t.Errorf("final %v, want 12 (an unknown write after the last ack may hold)", got.Sub(base).Seconds())
	}
	if got := final(ops[:6], at(6)); !got.Equal(at(6)) {
		t.Errorf("final %v, want 6 (a refused or superseded write never holds)", got.Sub(base).Seconds())
	}
	if got := final(ops[:6], at(9)); !got.Equal(at(9)) {
		t.Errorf("final %v, want the row's 9", got.Sub(base).Seconds())
	}
}

// TestCampaignCheckerFailoverLosses pins how the checker reads a Redis
// failover: a reschedule Redis acknowledged in the window the failover
// lost may be gone (the order may close at the deadline Redis went back
// to), a create's deadline stands by its row, and a write acknowledged
// before the window or after it still binds.
func TestCampaignCheckerFailoverLosses(t *testing.T) {
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return base.Add(time.Duration(s * float64(time.Second))) }
	w := func(kind string, start, end, deadline float64) cop {
		return cop{kind: kind, path: "zadd", start: at(start), end: at(end), deadline: at(deadline), outcome: acked}
	}
	windows := []lossWindow{{since: at(10), until: at(12)}}
	ops := []cop{
		w("create", 9, 10.5, 20),      // acked in the window: its row holds it
		w("reschedule", 11, 11.1, 30), // later, acked in the window: may be lost
	}
	got, lost := durableOps(ops, windows)
	if !lost || got[0].outcome != acked || got[1].outcome != unknown {
		t.Fatalf("durableOps: lost %v, outcomes %d %d; want true, acked, unknown", lost, got[0].outcome, got[1].outcome)
	}
	if ops[1].outcome != acked {
		t.Fatal("durableOps changed its argument")
	}
	if lower, _ := bounds(got, at(15)); !lower.Equal(at(20)) {
		t.Errorf("bound after a lost later reschedule %v, want the create's 20 (Redis went back to it)", lower.Sub(base).Seconds())
	}
	if lower, _ := bounds(ops, at(15)); !lower.Equal(at(30)) {
		t.Errorf("bound without the failover %v, want 30", lower.Sub(base).Seconds())
	}
	// An earlier deadline lost: Redis went back to the later one, which
	// then bounds when the order must close.
	earlier := []cop{w("create", 0, 0.1, 20), w("reschedule", 11, 11.1, 13)}
	got, lost = durableOps(earlier, windows)
	if f := finalDeadline(got, at(13), lost); !f.Equal(at(20)) {
		t.Errorf("final after a lost earlier reschedule %v, want 20", f.Sub(base).Seconds())
	}
	// Outside every window nothing changes.
	for _, op := range []cop{w("reschedule", 8, 9.9, 30), w("reschedule", 12.1, 12.2, 30)} {
		if _, lost := durableOps([]cop{op}, windows); lost {
			t.Errorf("a reschedule acked at %v..%v taken for lost by the window 10..12", op.start.Sub(base).Seconds(), op.end.Sub(base).Seconds())
		}
	}
}
