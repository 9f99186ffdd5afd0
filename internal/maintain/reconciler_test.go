package maintain

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

func TestReconcilerYieldsToAnotherReplicaHoldingTheLock(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	e.Orders("lost", 3, time.Now().Add(-time.Hour))
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys}, e.RDB, e.Store, e.m, zaptest.NewLogger(t))
	tx, err := e.DB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.Exec("SELECT pg_advisory_xact_lock($1)", r.lock); err != nil {
		t.Fatal(err)
	}
	if n, err := r.RunOnce(ctx); err != nil || n != 0 {
		t.Fatalf("closed %d (%v) while another replica held the lock, want 0", n, err)
	}
}

func TestReconcilerWaitsWhileClosingIsPaused(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	lost := e.Orders("lost", 3, time.Now().Add(-time.Hour))
	if err := e.RDB.Set(ctx, e.Keys.Paused, "1|PSP outage", 0).Err(); err != nil {
		t.Fatal(err)
	}
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys}, e.RDB, e.Store, e.m, zaptest.NewLogger(t))
	if n, err := r.RunOnce(ctx); err != nil || n != 0 {
		t.Fatalf("closed %d (%v) while paused, want 0", n, err)
	}
	e.RDB.Del(ctx, e.Keys.Paused)
	if n, err := r.RunOnce(ctx); err != nil || n != len(lost) {
		t.Fatalf("closed %d (%v) after resume, want %d", n, err, len(lost))
	}
}

// Issue 11 item 4: more than a page of older overdue orders still
// legitimately queued must not hide a lost order behind them: pages follow
// each other by keyset within a pass.
func TestReconcilerPagesPastOrdersStillQueued(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	older := time.Now().Add(-2 * time.Hour)
	queued := e.Orders("queued", 12, older) // same deadline: ties need the serial to page
	e.Enqueue(queued, older)
	lost := e.Orders("lost", 1, time.Now().Add(-time.Hour))
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 5},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 || e.Status(lost[0]) != "closed" {
		t.Fatalf("one pass closed %d, lost order is %s; want it closed behind %d queued orders (page size 5)", n, e.Status(lost[0]), len(queued))
	}
	for _, s := range queued {
		if st := e.Status(s); st != "pending" {
			t.Fatalf("%s is %s, but it is still queued", s, st)
		}
	}
}

// An error about the database, not the data (here a read-only error raised
// in the middle of the close, as after a failover), ends the pass: nothing is bisected,
// skipped or reported as a bad order, and the next pass tries again.
func TestReconcilerStopsThePassOnATransientError(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	lost := e.Orders("lost", 20, time.Now().Add(-10*time.Minute))
	e.FailClose(lost[5], "25006")
	core, logs := observer.New(zap.WarnLevel)
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 8}, e.RDB, e.Store, e.m, zap.New(core))
	n, err := r.RunOnce(ctx)
	if err == nil || !orders.Transient(err) {
		t.Fatalf("pass = %d, %v; want a transient error", n, err)
	}
	if n != 0 {
		t.Errorf("closed %d before the failing page, want 0 (it is the first page)", n)
	}
	if k := e.CloseFailures(); k != 1 {
		t.Errorf("the failing close ran %d times, want 1 (no bisection on a transient error)", k)
	}
	if l := logs.FilterField(zap.String("serial", lost[5])).Len(); l != 0 {
		t.Errorf("the order was reported as failing %d times, want 0: %v", l, logs.All())
	}
	if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageReconcile)); v != 0 {
		t.Errorf(`errors_total{stage="reconcile"} = %v inside RunOnce, want 0 (Run counts the failed pass)`, v)
	}
	for _, s := range lost {
		if st := e.Status(s); st != "pending" {
			t.Errorf("%s is %s after a pass that failed, want pending", s, st)
		}
	}
}

// Issue 11 item 3: one order whose close always fails (the oldest overdue
// row, so in every first page) must not stop the reconciler: it is isolated,
// skipped and reported, and every other lost order is closed.
func TestReconcilerIsolatesAnOrderWhoseCloseFails(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	poison := e.Orders("poison", 1, time.Now().Add(-time.Hour))[0]
	lost := e.Orders("lost", 20, time.Now().Add(-10*time.Minute))
	e.PoisonOrder(poison)
	core, logs := observer.New(zap.WarnLevel)
	// Pages of 8: the poison is in the first of three pages.
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 8}, e.RDB, e.Store, e.m, zap.New(core))
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatalf("first pass: %v (one order's close failing must not fail the pass)", err)
	}
	if n != len(lost) {
		t.Errorf("first pass closed %d orders, want %d", n, len(lost))
	}
	for _, s := range lost {
		if st := e.Status(s); st != "closed" {
			t.Errorf("%s is %s after a pass, want closed", s, st)
		}
	}
	if st := e.Status(poison); st != "pending" {
		t.Errorf("the poisoned order is %s, want pending", st)
	}
	reported := func() int {
		k := 0
		for _, l := range logs.FilterField(zap.String("serial", poison)).All() {
			if l.Level == zap.WarnLevel && strings.Contains(fmt.Sprint(l.ContextMap()["error"]), "cannot be closed") {
				k++
			}
		}
		return k
	}
	if k := reported(); k != 1 {
		t.Errorf("the poisoned order was reported %d times in the first pass, want 1 Warn with its serial and error; logs: %v", k, logs.All())
	}
	if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageReconcile)); v != 1 {
		t.Errorf(`errors_total{stage="reconcile"} = %v after the first pass, want 1`, v)
	}
	// A later lost order is still reached by a later pass; the poison is
	// reported again and stops nothing.
	later := e.Orders("later", 3, time.Now().Add(-6*time.Minute))
	if n, err := r.RunOnce(ctx); err != nil || n != len(later) {
		t.Fatalf("second pass closed %d (%v), want %d", n, err, len(later))
	}
	if k := reported(); k != 2 {
		t.Errorf("the poisoned order was reported %d times after two passes, want 2", k)
	}
	if st := e.Status(poison); st != "pending" {
		t.Errorf("the poisoned order is %s, want pending", st)
	}
}

// A producer that re-adds a serial after the reconciler's "missing" check
// but before its commit keeps its order: the check is repeated after the
// close statement ran (rows locked) and what came back — to the queue key,
// a shard's queue key or a lease hash — is not closed; the rest is.
func TestReconcilerFencesSerialsReaddedBeforeCommit(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	all := e.ShardKeys(3)
	longAgo := time.Now().Add(-time.Hour)
	lost := e.Orders("lost", 10, longAgo)
	readded, leased, sharded := lost[3], lost[7], lost[8]
	back := []string{readded, leased, sharded}
	// A poisoned order in the same page is isolated once, not again when the
	// page is closed a second time.
	poison := lost[0]
	e.PoisonOrder(poison)
	r := NewReconciler(ReconcilerConfig{Keys: all[0], Shards: all[1:], Grace: 5 * time.Minute},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	hooked := 0
	r.afterClose = func(closed []string) {
		hooked++
		if hooked > 1 {
			return
		}
		// The checkout reschedules one an hour later (raw ZADD), another
		// through a shard key; a replica leases a third.
		later := time.Now().Add(time.Hour)
		e.ZAdd(all[0].Queue, []string{readded}, later)
		e.ZAdd(all[2].Queue, []string{sharded}, later)
		if err := e.RDB.HSet(ctx, all[3].Lease, leased, "1|0|r:1|").Err(); err != nil {
			t.Error(err)
		}
	}
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if hooked != 2 {
		t.Errorf("the close ran %d times, want 2 (once, then again without what came back)", hooked)
	}
	for _, s := range back {
		if st := e.Status(s); st != "pending" {
			t.Errorf("%s is %s: it was back in Redis before the commit, want pending", s, st)
		}
	}
	if st := e.Status(poison); st != "pending" {
		t.Errorf("the poisoned order is %s, want pending", st)
	}
	if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageReconcile)); v != 1 {
		t.Errorf(`errors_total{stage="reconcile"} = %v, want 1 (isolated once, then left out)`, v)
	}
	want := len(lost) - len(back) - 1
	if n != want {
		t.Errorf("closed %d, want %d (all but the ones back in Redis and the poison)", n, want)
	}
	for _, s := range lost {
		if s != poison && !slices.Contains(back, s) && e.Status(s) != "closed" {
			t.Errorf("%s is %s, want closed", s, e.Status(s))
		}
	}
	if v := testutil.ToFloat64(e.m.Reconciled); v != float64(want) {
		t.Errorf("orders_reconciled_total %v, want %d", v, want)
	}
}

func TestReconcilerLooksInEveryShard(t *testing.T) {
	e := newEnv(t, orderStatements())
	all := e.ShardKeys(4)
	longAgo := time.Now().Add(-time.Hour)
	lost := e.Orders("lost", 30, longAgo)
	inShard := e.Orders("shard", 4, longAgo)
	inBase := e.Orders("base", 2, longAgo)
	for i, s := range inShard {
		e.ZAdd(all[1+i].Queue, []string{s}, longAgo)
	}
	e.ZAdd(all[0].Queue, inBase, longAgo)
	// One shard entry is leased: it lives in its lease hash only.
	if err := e.RDB.ZRem(context.Background(), all[4].Queue, inShard[3]).Err(); err != nil {
		t.Fatal(err)
	}
	if err := e.RDB.HSet(context.Background(), all[4].Lease, inShard[3], "1|0|r:1|").Err(); err != nil {
		t.Fatal(err)
	}
	r := NewReconciler(ReconcilerConfig{Keys: all[0], Shards: all[1:], Grace: 5 * time.Minute},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	n, err := r.RunOnce(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if n != len(lost) {
		t.Errorf("reconciled %d, want the %d in no key", n, len(lost))
	}
	for _, s := range append(inShard, inBase...) {
		if st := e.Status(s); st != "pending" {
			t.Errorf("%s is %s; it is in the queue and must be left to the fast path", s, st)
		}
	}
}

// The reconciler's COMMIT that lands while its answer is lost and
// PostgreSQL then stays away: its orders are counted in doubt, not
// reconciled, and the pass fails as after an outage.
func TestReconcilerCommitWithoutAnswerIsCountedInDoubt(t *testing.T) {
	e := newRedisEnv(t)
	db, viaProxy, _, px := testenv.PostgresViaProxy(t)
	e.DB = db
	e.Store = orders.NewStore(viaProxy, orders.Statements{})
	lost := e.Orders("lost", 4, time.Now().Add(-time.Hour))
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: time.Minute, PageSize: 10}, e.RDB, e.Store, e.m, zap.NewNop())
	landed := make(chan struct{})
	r.afterClose = func(closed []string) {
		if len(closed) == 0 {
			return
		}
		px.Stall(time.Minute)
		go func() {
			defer close(landed)
			defer px.Down()
			for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
				var n int
				if db.Get(&n, "SELECT count(*) FROM orders WHERE serial_no = ANY($1) AND status = 'closed'", pq.Array(lost)) == nil && n == len(lost) {
					return
				}
			}
		}()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n, err := r.RunOnce(ctx)
	<-landed
	for _, s := range lost {
		if st := e.Status(s); st != "closed" {
			t.Fatalf("%s is %s: the commit did not land, the test proved nothing", s, st)
		}
	}
	if err == nil || n != 0 {
		t.Fatalf("RunOnce = %d, %v; want an error: the commit got no answer", n, err)
	}
	if v := testutil.ToFloat64(e.m.Reconciled); v != 0 {
		t.Errorf("reconciled_total %v, want 0", v)
	}
	if v := testutil.ToFloat64(e.m.InDoubt); v != float64(len(lost)) {
		t.Errorf("in_doubt_total %v, want %d", v, len(lost))
	}
}

// Adversarial: the reconciler's page against a producer's write between its
// check and its close.

// afterZMScore runs f once, right after the first script call (or ZMSCORE
// pipeline) the client sends has been answered: for the reconciler that is
// its "is the serial still in Redis?" check, so f lands between that check
// and the close. (Connection set-up pipelines go through the hook too.)
type afterZMScore struct {
	once sync.Once
	f    func()
}

func (h *afterZMScore) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *afterZMScore) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, c redis.Cmder) error {
		err := next(ctx, c)
		if n := c.Name(); n == "evalsha" || n == "eval" {
			h.once.Do(h.f)
		}
		return err
	}
}
func (h *afterZMScore) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, c := range cmds {
			if c.Name() == "zmscore" {
				h.once.Do(h.f)
			}
		}
		return err
	}
}

// Invariant (a), reconciler: an order Redis lost is past its deadline and
// grace. The checkout extends it with a raw ZADD an hour ahead; Redis
// acknowledges the ZADD after the reconciler's queue check but before its
// close statement begins. The reconciler has no fence: it closes the order
// an hour before the deadline the producer wrote.
//
// Fix: fence the reconciler's close like the fast path's: after CloseOn and
// before COMMIT (the rows are locked), check again, atomically (one script
// or MULTI per key set: the pipeline of ZMSCORE + HMGET is not atomic, so an
// API reschedule of a leased entry moving it lease -> queue between the two
// reads makes it look missing too), that each closed serial is still
// nowhere in Redis; roll back and redo without those that reappeared.
func TestAdversaryReconcilerClosesARescheduleAckedBeforeItsClose(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	s := e.Orders("rec-resched", 1, time.Now().Add(-time.Hour))[0]
	later := e.RedisNow().Add(time.Hour)

	rdb := redis.NewClient(e.RDB.Options())
	t.Cleanup(func() { rdb.Close() })
	rdb.AddHook(&afterZMScore{f: func() {
		// The producer's write, acknowledged before the close statement.
		e.Enqueue([]string{s}, later)
	}})
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: time.Minute, PageSize: 10},
		rdb, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sc, err := e.RDB.ZScore(ctx, e.Keys.Queue, s).Result(); err != nil || int64(sc) != queue.DeadlineMillis(later) {
		t.Fatalf("the producer's write did not happen (%v, %v): the hook never fired", sc, err)
	}
	if st := e.Status(s); st != "pending" {
		t.Fatalf("reconciler closed %d; %s is %s: closed an hour before the deadline a producer "+
			"wrote (ZADD acknowledged before the close statement began)", n, s, st)
	}
}
