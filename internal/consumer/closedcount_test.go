package consumer

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/maintain"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// orderdelay_orders_closed_total (+ orders_reconciled_total) counts each
// order a replica's committed transaction closed, once: summed over the
// replicas it equals the closes PostgreSQL recorded. These tests hold the
// counters against an audit trigger (one row per committed close, written
// in the closing transaction, as the e2e fault campaign's close_audit).

// closeAudit records every committed close of an order, in its transaction.
func (e *env) closeAudit() {
	e.T.Helper()
	_, err := e.DB.Exec(`CREATE TABLE close_audit (serial_no text NOT NULL, app text NOT NULL);
CREATE FUNCTION close_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO close_audit VALUES (NEW.serial_no, current_setting('application_name'));
    RETURN NULL;
END $$;
CREATE TRIGGER close_audit AFTER UPDATE OF status ON orders FOR EACH ROW
    WHEN (NEW.status = 'closed' AND OLD.status IS DISTINCT FROM 'closed')
    EXECUTE FUNCTION close_audit();`)
	if err != nil {
		e.T.Fatal(err)
	}
}

func (e *env) audited() int {
	e.T.Helper()
	var n int
	if err := e.DB.Get(&n, "SELECT count(*) FROM close_audit"); err != nil {
		e.T.Fatal(err)
	}
	return n
}

// auditedOf is how many closes of serials close_audit recorded.
func (e *env) auditedOf(serials []string) int {
	e.T.Helper()
	var n int
	if err := e.DB.Get(&n, "SELECT count(*) FROM close_audit WHERE serial_no = ANY($1)", pq.Array(serials)); err != nil {
		e.T.Fatal(err)
	}
	return n
}

// soakFor is how long the soak's faults last: ORDERDELAY_SOAK (a duration), else 6 s.
func soakFor() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("ORDERDELAY_SOAK")); err == nil && d > 0 {
		return d
	}
	return 6 * time.Second
}

// counted is what a replica's metrics say it closed.
func counted(m *metrics.Metrics) float64 {
	return testutil.ToFloat64(m.Closed) + testutil.ToFloat64(m.Reconciled)
}

// A soak of two replicas (fast path and reconciler each) closing a steady
// checkout's orders through a PostgreSQL and a Redis proxy while a seeded
// nemesis cuts either, stalls PostgreSQL's answers past the statement
// timeout (COMMITs that land while the client has given up), loses
// answers and cuts their connections (a COMMIT whose answer never comes:
// the txid_status path), and holds row locks past the statement timeout
// (the batch closed order by order). Checkouts pay, reschedule, and
// create poisonous orders (a data error: the batch split in halves). Once
// every unpaid order is closed and the replicas have stopped, their
// counters must sum to the audit: no close counted twice, none that did
// not commit.
func TestClosedCountEqualsTheAuditUnderFaults(t *testing.T) {
	t.Parallel()
	seed := rand.Uint64() % 1_000_000
	if v, err := strconv.ParseUint(os.Getenv("ORDERDELAY_SOAK_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d (replay: ORDERDELAY_SOAK_SEED=%d; longer: ORDERDELAY_SOAK=30s)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	// On odd seeds the store asks what became of a COMMIT without an
	// answer for 150 ms only, so a fault outlasts the question and closes
	// are in doubt: the counters' bounds are tested, not their equality.
	var statusWait time.Duration
	if seed%2 == 1 {
		statusWait = 150 * time.Millisecond
	}
	t.Logf("status wait %v", statusWait)

	e := newRedisEnv(t)
	db, dsn := testenv.Postgres(t)
	e.DB = db
	e.closeAudit()
	e.CloseTrigger("poison_prefix", "NEW.serial_no LIKE 'poison-%'", "RAISE EXCEPTION 'poisonous'")

	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	ro := e.RDB.Options()

	const (
		stmt  = 400 * time.Millisecond
		lease = 1500 * time.Millisecond
	)
	// A replica reaches PostgreSQL and Redis through proxies of its own,
	// so a fault can hit one replica or both; a restart keeps them (and
	// what the replica it replaces had counted).
	type replica struct {
		name          string
		pgPx, redisPx *testenv.Proxy
		m             *metrics.Metrics
		before        float64 // counted by the replicas this one replaced
		inDoubt       float64 // orders_in_doubt_total, the same way
		stop          func()
	}
	start := func(r *replica) {
		pu := *u
		pu.Host = r.pgPx.Addr()
		q := pu.Query()
		q.Set("application_name", r.name)
		pu.RawQuery = q.Encode()
		pool, err := orders.Open(pu.String(), orders.PoolOptions{MaxConns: 3, StatementTimeout: stmt})
		if err != nil {
			t.Fatal(err)
		}
		o := *ro
		o.Addr = r.redisPx.Addr()
		o.MaxRetries = -1
		rdb := redis.NewClient(&o)
		r.m = metrics.New(prometheus.NewRegistry(), "test", "test")
		store := orders.NewStore(pool, orders.Statements{})
		store.SetCommitStatusWait(statusWait)
		log := zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel))
		c, err := New(Config{Keys: e.Keys, Owner: r.name, Workers: 2, BatchSize: 20, Lease: lease,
			StatementTimeout: stmt, DrainTimeout: 300 * time.Millisecond, BackoffMax: 400 * time.Millisecond,
			ScanInterval: 200 * time.Millisecond, HeadCheck: 20 * time.Millisecond, MaxAttempts: 1000},
			rdb, store, r.m, log)
		if err != nil {
			t.Fatal(err)
		}
		rec := maintain.NewReconciler(maintain.ReconcilerConfig{Keys: e.Keys, Interval: 300 * time.Millisecond, Grace: 2 * lease, PageSize: 50},
			rdb, store, r.m, log)
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); c.Run(ctx) }()   //nolint:errcheck // ends with ctx
		go func() { defer wg.Done(); rec.Run(ctx) }() //nolint:errcheck // ends with ctx
		var once sync.Once
		r.stop = func() {
			once.Do(func() {
				cancel()
				wg.Wait()
				rdb.Close()
				pool.Close()
			})
		}
		t.Cleanup(r.stop)
	}
	var reps []*replica
	for _, name := range []string{"A", "B"} {
		r := &replica{name: name, pgPx: testenv.NewProxy(t, u.Host), redisPx: testenv.NewProxy(t, ro.Addr)}
		start(r)
		reps = append(reps, r)
	}

	// The checkout: orders due within half a second, a third paid around
	// their deadline, some rescheduled later, one in fifty poisonous, one
	// in thirty never enqueued (the reconciler closes those).
	ctx := context.Background()
	workload, stopWorkload := context.WithCancel(ctx)
	var checkout sync.WaitGroup
	created := 0
	var mu sync.Mutex
	for k := range 3 {
		crng := rand.New(rand.NewPCG(seed, uint64(100+k)))
		checkout.Add(1)
		go func() {
			defer checkout.Done()
			for i := 0; workload.Err() == nil; i++ {
				time.Sleep(time.Duration(2+crng.IntN(10)) * time.Millisecond)
				serial := fmt.Sprintf("soak-%d-%05d", k, i)
				if crng.IntN(50) == 0 {
					serial = fmt.Sprintf("poison-%d-%05d", k, i)
				}
				due := time.Now().Add(time.Duration(crng.IntN(500)) * time.Millisecond)
				if _, err := db.Exec("INSERT INTO orders (serial_no, expires_at) VALUES ($1, $2)", serial, due); err != nil {
					t.Error(err)
					return
				}
				if crng.IntN(30) > 0 { // else the checkout died before its ZADD: the reconciler's
					e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(due.UnixMilli()), Member: serial}) //nolint:errcheck // the reconciler closes it
				}
				mu.Lock()
				created++
				mu.Unlock()
				life, wait := crng.IntN(6), time.Duration(crng.IntN(800))*time.Millisecond
				checkout.Add(1)
				go func() {
					defer checkout.Done()
					time.Sleep(wait)
					switch life {
					case 0, 1:
						db.Exec("UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1 AND status = 'pending'", serial) //nolint:errcheck
					case 2:
						later := time.Now().Add(wait)
						if res, err := db.Exec("UPDATE orders SET expires_at = $2 WHERE serial_no = $1 AND status = 'pending'", serial, later); err == nil {
							if n, _ := res.RowsAffected(); n == 1 {
								e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(later.UnixMilli()), Member: serial}) //nolint:errcheck
							}
						}
					}
				}()
			}
		}()
	}

	faults := map[string]int{}
	for end := time.Now().Add(soakFor()); time.Now().Before(end); {
		time.Sleep(time.Duration(100+rng.IntN(300)) * time.Millisecond)
		hold := time.Duration(200+rng.IntN(800)) * time.Millisecond
		hit := reps
		if rng.IntN(2) == 0 {
			hit = reps[rng.IntN(2):][:1]
		}
		kind := [...]string{"pg-cut", "pg-stall", "pg-lose-answers", "pg-terminate", "redis-cut", "redis-stall", "row-locks", "restart"}[rng.IntN(8)]
		faults[kind]++
		switch kind {
		case "pg-cut", "redis-cut":
			for _, r := range hit {
				map[bool]*testenv.Proxy{true: r.pgPx, false: r.redisPx}[kind == "pg-cut"].Down()
			}
			time.Sleep(hold)
			for _, r := range hit {
				r.pgPx.Up()
				r.redisPx.Up()
			}
		case "pg-stall", "redis-stall":
			// Longer than a lease, at times: a replica that stopped.
			d := stmt + hold*time.Duration(1+rng.IntN(2))
			for _, r := range hit {
				map[bool]*testenv.Proxy{true: r.pgPx, false: r.redisPx}[kind == "pg-stall"].Stall(d)
			}
			time.Sleep(d)
		case "pg-lose-answers":
			for _, r := range hit {
				r.pgPx.DropReplies(1 + rng.IntN(4))
			}
			time.Sleep(hold)
			for _, r := range hit {
				r.pgPx.DropReplies(0)
			}
		case "pg-terminate":
			for _, r := range hit {
				db.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
					WHERE datname = current_database() AND application_name = $1`, r.name) //nolint:errcheck
			}
		case "row-locks":
			tx, err := db.Begin()
			if err != nil {
				t.Fatal(err)
			}
			tx.Exec(`SELECT 1 FROM orders WHERE status = 'pending' AND expires_at < now() + interval '300 milliseconds'
				ORDER BY random() LIMIT $1 FOR UPDATE SKIP LOCKED`, 1+rng.IntN(4)) //nolint:errcheck
			time.Sleep(stmt + hold)
			tx.Rollback() //nolint:errcheck
		case "restart":
			// Shutdown with a short drain: what is in flight is cut and
			// handed back; a new replica of the same name takes over.
			for _, r := range hit {
				r.stop()
				r.before += counted(r.m)
				r.inDoubt += testutil.ToFloat64(r.m.InDoubt)
				start(r)
			}
		}
	}
	stopWorkload()
	checkout.Wait()
	t.Logf("%d orders, faults %v", created, faults)

	// Every unpaid order closes: the fast path, or the reconciler.
	eventually(t, "every unpaid order closed", 90*time.Second, func() bool {
		var n int
		err := db.Get(&n, "SELECT count(*) FROM orders WHERE status = 'pending' AND serial_no NOT LIKE 'poison-%'")
		return err == nil && n == 0
	})
	for _, r := range reps {
		r.stop()
	}
	sum := 0.0
	for _, r := range reps {
		r.before += counted(r.m)
		r.inDoubt += testutil.ToFloat64(r.m.InDoubt)
		sum += r.before
	}
	var byApp []struct {
		App string `db:"app"`
		N   int    `db:"n"`
	}
	if err := db.Select(&byApp, "SELECT app, count(*) AS n FROM close_audit GROUP BY app ORDER BY app"); err != nil {
		t.Fatal(err)
	}
	t.Logf("counted: A %v, B %v (reconciled by the last replicas: %v, %v; in doubt: %v, %v); audit by replica %v", reps[0].before, reps[1].before,
		testutil.ToFloat64(reps[0].m.Reconciled), testutil.ToFloat64(reps[1].m.Reconciled), reps[0].inDoubt, reps[1].inDoubt, byApp)
	if n := e.audited(); sum > float64(n) {
		t.Errorf("the replicas counted %v closes, the audit holds %d: closes counted twice or counted without a commit (seed %d)", sum, n, seed)
	}
	for _, r := range reps {
		audit := 0
		for _, a := range byApp {
			if a.App == r.name {
				audit = a.N
			}
		}
		// A COMMIT nobody could confirm is counted in doubt, not closed.
		if r.before > float64(audit) || float64(audit) > r.before+r.inDoubt {
			t.Errorf("replica %s counted %v closes and %v in doubt, its committed closes are %d (seed %d)",
				r.name, r.before, r.inDoubt, audit, seed)
		}
	}
}

// lostCommitAnswer is a Store whose first COMMIT lands on the server while
// its answer is lost: right after the fence, the proxy holds the server's
// answers back, and cuts the connections once the close is visible.
type lostCommitAnswer struct {
	*orders.Store
	px       *testenv.Proxy
	db       *sqlx.DB // direct, to see the close land
	once     sync.Once
	stayDown bool // keep the proxy down once the close landed
}

func (l *lostCommitAnswer) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	return l.Store.Settle(ctx, serials, func(ctx context.Context, closed []string) ([]string, error) {
		drop, err := fence(ctx, closed)
		if err == nil && len(drop) == 0 {
			l.once.Do(func() {
				l.px.Stall(3 * time.Second)
				go func() {
					defer func() {
						// The cut loses the held answer; ending the stall
						// with it lets what follows on a new connection (the
						// store's question, the retry after Up) through at
						// once, not when the 3 s run out.
						l.px.Down()
						l.px.Stall(0)
						if !l.stayDown {
							l.px.Up()
						}
					}()
					for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
						var n int
						if l.db.Get(&n, "SELECT count(*) FROM orders WHERE serial_no = ANY($1) AND status = 'closed'", pq.Array(closed)) == nil && n == len(closed) {
							return
						}
					}
				}()
			})
		}
		return drop, err
	})
}

// A COMMIT whose answer is lost (the connection drops while it is on its
// way) is asked about by transaction id (txid_status) and reported closed:
// counted once, its entries removed. The serials written again and claimed
// later are settled: nothing more is counted.
func TestLostCommitAnswerIsCountedOnce(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	db, viaProxy, _, px := testenv.PostgresViaProxy(t)
	e.DB = db
	e.closeAudit()
	e.Store = orders.NewStore(viaProxy, orders.Statements{})
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("unheard", 3, past)
	e.Enqueue(serials, past)
	c := e.consumer(Config{StatementTimeout: 10 * time.Second, Lease: 60 * time.Second})
	c.store = &lostCommitAnswer{Store: e.Store, px: px, db: db}
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 3 {
		t.Fatalf("claim: %v, %d items", err, len(res.items))
	}
	c.process(ctx, res.items)
	if n := e.audited(); n != 3 {
		t.Fatalf("%d closes committed, want 3: the test proved nothing", n)
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 3 {
		t.Fatalf("closed_total %v after a COMMIT whose answer was lost, want 3", v)
	}
	for _, s := range serials {
		e.assertNoEntries(t, s)
	}
	e.Enqueue(serials, past)
	res, err = c.claimBatch(ctx)
	if err != nil || len(res.items) != 3 {
		t.Fatalf("second claim: %v, %d items", err, len(res.items))
	}
	c.process(ctx, res.items)
	if v := testutil.ToFloat64(e.m.Closed); v != 3 {
		t.Errorf("closed_total %v after the settled orders came back, want still 3", v)
	}
	if v := testutil.ToFloat64(e.m.Skipped.WithLabelValues(metrics.SkipSettled)); v != 3 {
		t.Errorf("skipped{settled} %v, want 3", v)
	}
}

// A COMMIT whose answer is lost while PostgreSQL stays out of reach for
// longer than the store asks about it: nobody can say whether its orders
// closed. They are not counted closed (the retry finds them settled), and
// orderdelay_orders_in_doubt_total says how many may have: with it the
// counters bound the audit from both sides.
func TestUnconfirmedCommitIsCountedInDoubt(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	db, viaProxy, _, px := testenv.PostgresViaProxy(t)
	e.DB = db
	e.closeAudit()
	e.Store = orders.NewStore(viaProxy, orders.Statements{})
	e.Store.SetCommitStatusWait(300 * time.Millisecond)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("unheard", 3, past)
	e.Enqueue(serials, past)
	c := e.consumer(Config{StatementTimeout: 10 * time.Second, Lease: 60 * time.Second, BackoffMax: 50 * time.Millisecond})
	c.store = &lostCommitAnswer{Store: e.Store, px: px, db: db, stayDown: true}
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 3 {
		t.Fatalf("claim: %v, %d items", err, len(res.items))
	}
	c.process(ctx, res.items)
	if n := e.audited(); n != 3 {
		t.Fatalf("%d closes committed, want 3: the test proved nothing", n)
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 0 {
		t.Errorf("closed_total %v after a COMMIT nobody could confirm, want 0", v)
	}
	if v := testutil.ToFloat64(e.m.InDoubt); v != 3 {
		t.Errorf("in_doubt_total %v, want 3", v)
	}
	px.Up()
	eventually(t, "the retried orders settled", 20*time.Second, func() bool {
		res, err := c.claimBatch(ctx)
		if err == nil && len(res.items) > 0 {
			c.process(ctx, res.items)
		}
		return testutil.ToFloat64(e.m.Skipped.WithLabelValues(metrics.SkipSettled)) == 3
	})
	if v := testutil.ToFloat64(e.m.Closed); v != 0 {
		t.Errorf("closed_total %v after the orders came back settled, want still 0", v)
	}
	for _, s := range serials {
		e.assertNoEntries(t, s)
	}
}
