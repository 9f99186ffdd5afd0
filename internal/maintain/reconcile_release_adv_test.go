package maintain

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Adversarial tests of the page's release of its rows (67c6c48): the page
// reads its overdue orders under SAVEPOINT orderdelay_reconcile_overdue
// and, once Redis has named the lost ones, rolls back to it unless it will
// close every row it read. Each test acts at the one moment the page has
// read its rows and asked Redis, before it lets go of them: a hook on the
// reconciler's own Redis client that runs once the queue check ("missing")
// of the page's serials has returned.

// afterMissing runs f once, after the first queue-check script that names
// serial has returned.
type afterMissing struct {
	serial string
	once   sync.Once
	f      func()
}

func (h *afterMissing) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *afterMissing) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		switch cmd.Name() {
		case "evalsha", "eval", "evalsha_ro", "eval_ro":
			if slices.ContainsFunc(cmd.Args(), h.names) {
				h.once.Do(h.f)
			}
		}
		return err
	}
}

// names reports whether a command's argument is h.serial (the queue's
// scripts take serials as *string).
func (h *afterMissing) names(a any) bool {
	switch v := a.(type) {
	case string:
		return v == h.serial
	case *string:
		return *v == h.serial
	}
	return false
}

func (h *afterMissing) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// hookedReconciler is a reconciler on a Redis client of its own that runs
// f once the page's queue check naming serial has returned.
func (e *env) hookedReconciler(t *testing.T, cfg ReconcilerConfig, serial string, f func()) *Reconciler {
	t.Helper()
	rdb := redis.NewClient(e.RDB.Options())
	t.Cleanup(func() { rdb.Close() })
	rdb.AddHook(&afterMissing{serial: serial, f: f})
	cfg.Keys = e.Keys
	return NewReconciler(cfg, rdb, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
}

// waitingForALock waits until one statement of this database that
// contains marker waits for a lock.
func (e *env) waitingForALock(t *testing.T, marker string) {
	t.Helper()
	testenv.WaitFor(t, "a statement waiting for a row lock", 30*time.Second, func() bool {
		var n int
		err := e.DB.Get(&n, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'`, marker)
		return err == nil && n > 0
	})
}

// Invariant (a), never close early: a lost order's producer moves its
// deadline an hour ahead in the orders table (a shop's reschedule commits
// its row, then writes Redis — or dies in between, like the checkout the
// reconciler exists for). The reschedule's UPDATE starts while the page
// holds the row (read, Redis asked). Before 67c6c48 it waited for the page
// and found the order closed (the close came first: 0 rows moved). Once
// the page lets go of its rows, the reschedule commits first; the close
// must then not close the order against the deadline the page read.
//
// With a custom overdue statement (here the reference one, written
// differently) the page cannot check a deadline again: it keeps the rows
// of its read, and the reschedule waits for it.
func TestAdvReconcilerNeverClosesAnOrderRescheduledInTheTableDuringItsPage(t *testing.T) {
	custom := orderStatements()
	custom.Overdue = " " + orders.DefaultOverdueSQL
	for name, stmts := range map[string]orders.Statements{"reference": orderStatements(), "custom overdue": custom} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, stmts)
			ctx := context.Background()
			overdue := time.Now().Add(-time.Hour)
			queued := e.Orders("queued", 1, overdue) // so the page does not close every row it read
			e.Enqueue(queued, overdue)
			s := e.Orders("moved", 1, overdue.Add(time.Minute))[0]
			moved := make(chan int64, 1)
			r := e.hookedReconciler(t, ReconcilerConfig{Grace: 5 * time.Minute, PageSize: 10}, s, func() {
				go func() {
					res, err := e.DB.Exec(`UPDATE orders SET expires_at = now() + interval '1 hour' /* reschedule */
						WHERE serial_no = $1 AND status = 'pending'`, s)
					if err != nil {
						t.Error(err)
						moved <- -1
						return
					}
					n, _ := res.RowsAffected()
					moved <- n
				}()
				e.waitingForALock(t, "reschedule")
			})
			n, err := r.RunOnce(ctx)
			if err != nil {
				t.Fatal(err)
			}
			m := <-moved
			if st := e.Status(s); m == 1 && st != "pending" {
				t.Fatalf("the reschedule moved the deadline an hour ahead and committed, then the reconciler (closed %d) "+
					"left %s %s: closed against the deadline it read before the reschedule", n, s, st)
			}
			t.Logf("rows the reschedule moved: %d; %s is %s", m, s, e.Status(s))
		})
	}
}

// A custom overdue statement without FOR UPDATE (it locks nothing) still
// works: the page closes the lost orders and leaves the queued one.
func TestAdvReconcilerCustomOverdueWithoutForUpdate(t *testing.T) {
	stmts := orderStatements()
	stmts.Overdue = strings.TrimSuffix(orders.DefaultOverdueSQL, "FOR UPDATE SKIP LOCKED")
	e := newEnv(t, stmts)
	ctx := context.Background()
	overdue := time.Now().Add(-time.Hour)
	queued := e.Orders("queued", 2, overdue)
	e.Enqueue(queued, overdue)
	lost := e.Orders("lost", 3, overdue.Add(time.Minute))
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 10}, e.RDB, e.Store, e.m, zap.NewNop())
	if n, err := r.RunOnce(ctx); err != nil || n != len(lost) {
		t.Fatalf("pass = %d, %v; want the %d lost orders closed", n, err, len(lost))
	}
	for _, s := range queued {
		if st := e.Status(s); st != "pending" {
			t.Errorf("queued %s is %s, want pending", s, st)
		}
	}
}

// A payment that starts while the page holds a lost order's row may get it
// once the page lets go, and holds it, uncommitted, until the page's close
// has run: the page does not close it (it passes the row by when it locks
// the lost rows again; at 67c6c48 the close waited for it the lock
// timeout: the page's SET LOCAL lock_timeout survives the rollback to the
// savepoint, or this test hangs); the payment commits; the other lost
// orders are closed; the advisory lock still holds while the close runs.
func TestAdvReconcilerPaymentTakingALostRowAfterTheReadIsNeitherClosedNorWaitedForLong(t *testing.T) {
	e := newEnv(t, orderStatements())
	e.Store.SetTimeouts(5*time.Second, 200*time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	overdue := time.Now().Add(-time.Hour)
	queued := e.Orders("queued", 1, overdue)
	e.Enqueue(queued, overdue)
	lost := e.Orders("lost", 3, overdue.Add(time.Minute))
	paying := lost[1]
	release := make(chan struct{})
	paid := make(chan int64, 1)
	r := e.hookedReconciler(t, ReconcilerConfig{Grace: 5 * time.Minute, PageSize: 10}, paying, func() {
		go func() {
			paid <- e.pay(t, paying, release)
		}()
		e.waitingForALock(t, "payment")
	})
	var advisoryFree bool
	r.afterClose = func([]string) {
		var got bool
		if err := e.DB.Get(&got, `SELECT pg_try_advisory_lock($1)`, r.lock); err != nil {
			t.Error(err)
		}
		if got {
			advisoryFree = true
			e.DB.Exec(`SELECT pg_advisory_unlock($1)`, r.lock) //nolint:errcheck // the test fails anyway
		}
		select {
		case <-release:
		default:
			close(release)
		}
	}
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatalf("pass: %v", err)
	}
	p := <-paid
	if advisoryFree {
		t.Error("another session took the reconciler's advisory lock while the page's close ran")
	}
	want := map[string]string{lost[0]: "closed", lost[2]: "closed", queued[0]: "pending", paying: "paid"}
	if p == 0 {
		want[paying] = "closed" // the page locked it first: closed, the payment found it closed
	}
	for s, w := range want {
		if st := e.Status(s); st != w {
			t.Errorf("%s is %s, want %s (payment updated %d rows, pass closed %d)", s, st, w, p, n)
		}
	}
}

// pay marks serial paid in a transaction that holds the row until release
// is closed, and returns how many rows it updated.
func (e *env) pay(t *testing.T, serial string, release <-chan struct{}) int64 {
	tx, err := e.DB.Beginx()
	if err != nil {
		t.Error(err)
		return -1
	}
	defer tx.Rollback() //nolint:errcheck // committed below
	res, err := tx.Exec(`UPDATE orders SET status = 'paid', paid_at = now() /* payment */
		WHERE serial_no = $1 AND status = 'pending'`, serial)
	if err != nil {
		t.Error(err)
		return -1
	}
	<-release
	if err := tx.Commit(); err != nil {
		t.Error(err)
		return -1
	}
	n, _ := res.RowsAffected()
	return n
}

// A page whose every row is lost keeps the locks of its read: a payment
// that starts after the read waits for the page (as before 67c6c48), and
// the page's close never waits for anyone: every lost order is closed in
// one pass, without a lock timeout, the payment finding its order closed.
func TestAdvReconcilerPageOfOnlyLostOrdersKeepsItsLocks(t *testing.T) {
	e := newEnv(t, orderStatements())
	e.Store.SetTimeouts(5*time.Second, 200*time.Millisecond)
	ctx := context.Background()
	lost := e.Orders("lost", 4, time.Now().Add(-time.Hour))
	release := make(chan struct{})
	close(release)
	paid := make(chan int64, 1)
	r := e.hookedReconciler(t, ReconcilerConfig{Grace: 5 * time.Minute, PageSize: 10}, lost[2], func() {
		go func() { paid <- e.pay(t, lost[2], release) }()
		e.waitingForALock(t, "payment")
	})
	n, err := r.RunOnce(ctx)
	if err != nil || n != len(lost) {
		t.Fatalf("pass = %d, %v; want all %d lost orders closed", n, err, len(lost))
	}
	if p := <-paid; p != 0 {
		t.Errorf("the payment updated %d rows; want 0 (it waited for the page, which closed the order)", p)
	}
	if f := testutilErrors(e); f != 0 {
		t.Errorf("%v reconcile errors; want none (the close must not wait for a lock)", f)
	}
}

// The page's rollback to its savepoint fails: the connection to
// PostgreSQL is cut once Redis has named the lost orders. The pass ends
// with a transient error, nothing is committed, and the next pass closes
// the lost orders.
func TestAdvReconcilerPageEndsTransientlyWhenItsRollbackToTheSavepointFails(t *testing.T) {
	e, px := newProxiedEnv(t)
	ctx := context.Background()
	overdue := time.Now().Add(-time.Hour)
	queued := e.Orders("queued", 1, overdue)
	e.Enqueue(queued, overdue)
	lost := e.Orders("lost", 3, overdue.Add(time.Minute))
	r := e.hookedReconciler(t, ReconcilerConfig{Grace: 5 * time.Minute, PageSize: 10}, lost[0], px.Down)
	n, err := r.RunOnce(ctx)
	if err == nil || n != 0 || !orders.Transient(err) {
		t.Fatalf("pass = %d, %v (transient %v); want 0 and a transient error", n, err, orders.Transient(err))
	}
	for _, s := range append(queued, lost...) {
		if st := e.Status(s); st != "pending" {
			t.Errorf("%s is %s after the failed page, want pending", s, st)
		}
	}
	px.Up()
	if n, err := r.RunOnce(ctx); err != nil || n != len(lost) {
		t.Errorf("the next pass = %d, %v; want the %d lost orders closed", n, err, len(lost))
	}
}

// An order in the skip map (its close cost a timeout) is on the page but
// not closed by it: a payment of it while the page runs (its close, the
// fence) must not wait for the page.
func TestAdvReconcilerSkippedOrderIsPaidWhileThePageRuns(t *testing.T) {
	e := newEnv(t, orderStatements())
	e.Store.SetTimeouts(300*time.Millisecond, 100*time.Millisecond)
	ctx := context.Background()
	bad := e.Orders("slow", 1, time.Now().Add(-2*time.Hour))[0]
	lost := e.Orders("lost", 3, time.Now().Add(-time.Hour))
	e.SlowCloseOf(bad)
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 10}, e.RDB, e.Store, e.m, zap.NewNop())
	if n, err := r.RunOnce(ctx); err != nil || n != len(lost) {
		t.Fatalf("first pass = %d, %v; want the %d good orders closed", n, err, len(lost))
	}
	if r.skip[bad] == nil {
		t.Fatal("the slow order is not in the skip map")
	}
	more := e.Orders("more", 2, time.Now().Add(-time.Hour))
	var payErr error
	r.afterClose = func([]string) {
		tx, err := e.DB.Beginx()
		if err != nil {
			payErr = err
			return
		}
		defer tx.Rollback() //nolint:errcheck // committed below
		if _, err := tx.Exec(`SET LOCAL lock_timeout = '100ms'`); err != nil {
			payErr = err
			return
		}
		if _, err := tx.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1 AND status = 'pending'`, bad); err != nil {
			payErr = err
			return
		}
		payErr = tx.Commit()
	}
	if n, err := r.RunOnce(ctx); err != nil || n != len(more) {
		t.Fatalf("second pass = %d, %v; want the %d new orders closed", n, err, len(more))
	}
	if payErr != nil {
		t.Fatalf("the payment of the skipped order while the page ran: %v; want it not to wait for the page", payErr)
	}
	if st := e.Status(bad); st != "paid" {
		t.Errorf("%s is %s, want paid", bad, st)
	}
}

func testutilErrors(e *env) float64 {
	return testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageReconcile))
}
