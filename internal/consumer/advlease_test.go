package consumer

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/maintain"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Adversarial interleavings of the batch lease (issue 13 item 4) that the
// batch lease's own tests do not try: a poison member isolated out of a
// batch, a partly finished batch re-claimed in parts while its holder still
// works, a retried member re-claimed into a new batch before its old batch
// expires, a member moved by a producer or daemon that knows no batches
// (an upgrade's), and the reconciler's view of batch-leased orders.

// One member of a batch is refused by the shop's trigger (an error about
// its data): the batch is split until it is alone, it is dead-lettered, the
// rest closes, and the batch lease goes with its members.
func TestAdvLeasePoisonMemberLeavesTheBatchAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("alp", 6, past)
	e.Enqueue(serials, past)
	e.PoisonOrder(serials[2])
	c := e.consumer(Config{})
	res := claimN(t, c, 6)
	c.process(ctx, res.items)
	for i, s := range serials {
		want := "closed"
		if i == 2 {
			want = "pending"
		}
		if st := e.Status(s); st != want {
			t.Errorf("%s: %s, want %s", s, st, want)
		}
	}
	if got, err := e.cl.Get(ctx, serials[2]); err != nil || got.State != client.StateDead {
		t.Errorf("poison member %+v (%v), want dead-lettered", got, err)
	}
	if h := e.held(); h != 0 {
		t.Errorf("%d held after the batch ended, want 0", h)
	}
	e.assertNoLeaseKeys(t)
}

// A's batch of five: one member is settled (paid) and finished, one backs
// off. The lease expires; B, whose batch is 2, re-claims the other three
// in two claims while A still works on them. A's fence lets A close only
// the member B has not taken yet; B closes its two; nothing closes twice,
// the backoff stays, and no batch field is left behind.
func TestAdvLeasePartlyFinishedBatchReclaimedInPartsWhileItsHolderWorks(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("alr", 5, past)
	e.Enqueue(serials, past)
	a := e.consumer(Config{Owner: "A"})
	resA, err := a.claimBatch(ctx)
	if err != nil || len(resA.items) != 5 {
		t.Fatalf("A claim: %v, %d items", err, len(resA.items))
	}
	slices.SortFunc(resA.items, func(x, y item) int { return cmpStr(x.serial, y.serial) })
	if _, err := e.DB.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1`, serials[0]); err != nil {
		t.Fatal(err)
	}
	a.finish(resA.items[:1])
	a.retry(resA.items[1:2], time.Hour, true, "boom")
	e.expire(serials[4])
	b := e.consumer(Config{Owner: "B", BatchSize: 2})
	resB, err := b.claimBatch(ctx)
	if err != nil || len(resB.items) != 2 {
		t.Fatalf("B claim: %v, %d items, want 2", err, len(resB.items))
	}
	for _, it := range resB.items {
		if it.serial == serials[0] || it.serial == serials[1] {
			t.Fatalf("B re-claimed %s, which left the batch before it expired", it.serial)
		}
	}
	if h := e.held(); h != 4 {
		t.Errorf("%d held after a partial re-claim, want 4 (1 backoff, 2 B's, 1 still A's)", h)
	}
	a.process(ctx, resA.items[2:])
	b.process(ctx, resB.items)
	for i, s := range serials {
		want := map[int]string{0: "paid", 1: "pending"}[i]
		if want == "" {
			want = "closed"
		}
		if st := e.Status(s); st != want {
			t.Errorf("%s: %s, want %s", s, st, want)
		}
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 3 {
		t.Errorf("closed_total %v, want 3", v)
	}
	res, err := b.claimBatch(ctx)
	if err != nil || len(res.items) != 0 {
		t.Errorf("a later claim took %+v (%v), want nothing", res.items, err)
	}
	if h := e.held(); h != 1 {
		t.Errorf("%d held at the end, want 1 (the backoff)", h)
	}
	if n := e.card(e.Keys.Leases); n != 0 {
		t.Errorf("%d batch lease entries left, want 0", n)
	}
	if n, _ := e.RDB.HLen(ctx, e.Keys.LeaseBatch).Result(); n != 0 {
		t.Errorf("%d batch fields left, want 0", n)
	}
}

func cmpStr(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// A member of batch T backs off, its backoff ends and B claims it into a
// new batch; then T expires with its member list still naming it. C's
// re-claim of T takes only T's other member: the retried one is B's.
func TestAdvLeaseRetriedMemberIsNotReclaimedFromItsOldBatch(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	e.Enqueue([]string{"alt-x", "alt-y"}, past)
	a := e.consumer(Config{Owner: "A"})
	resA, err := a.claimBatch(ctx)
	if err != nil || len(resA.items) != 2 {
		t.Fatalf("A claim: %v, %d items", err, len(resA.items))
	}
	var x, y item
	for _, it := range resA.items {
		if it.serial == "alt-x" {
			x = it
		} else {
			y = it
		}
	}
	a.retry([]item{x}, 0, true, "boom")
	b := e.consumer(Config{Owner: "B"})
	resB, err := b.claimBatch(ctx)
	if err != nil || len(resB.items) != 1 || resB.items[0].serial != "alt-x" || resB.items[0].attempts != 1 {
		t.Fatalf("B claim: %v, %+v, want alt-x after 1 attempt", err, resB.items)
	}
	e.expire(y.serial)
	c := e.consumer(Config{Owner: "C"})
	resC, err := c.claimBatch(ctx)
	if err != nil || len(resC.items) != 1 || resC.items[0].serial != "alt-y" {
		t.Fatalf("C claim: %v, %+v, want alt-y alone", err, resC.items)
	}
	if h := e.held(); h != 2 {
		t.Errorf("%d held, want 2 (one each for B and C)", h)
	}
	a.finish(resA.items)
	if h := e.held(); h != 2 {
		t.Errorf("%d held after A's stale finish, want 2", h)
	}
	b.finish(resB.items)
	c.finish(resC.items)
	e.assertNoLeaseKeys(t)
}

// A member of a batch is moved by something that knows no batch leases —
// a producer on a client from before them (it drops the lease record and
// writes the queue key) or an older daemon taking over its raw re-add
// during a rolling upgrade (a per-member lease). The batch then counts a
// member it no longer holds: it may outlive its last real member, but only
// until its lease expires; it never makes the holder close the member the
// producer moved later (the fence sees the queue key's deadline), nor the
// gauges count it twice, nor does it leak. Neither writer marks the batch
// as changed nor takes the member off its count (both are from before
// batch leases), so its holder trusts the records (queue.Store.FenceBatch):
// the member the older daemon took over is due (it was claimed from the
// queue key), and whichever of the two holders closes it first closes it,
// once (the statement's status test decides for the other).
func TestAdvLeaseBatchCountingAMemberMovedByAnOlderVersion(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("alo", 3, past)
	e.Enqueue(serials, past)
	a := e.consumer(Config{Owner: "A"})
	resA, err := a.claimBatch(ctx)
	if err != nil || len(resA.items) != 3 {
		t.Fatalf("A claim: %v, %d items", err, len(resA.items))
	}
	later := queue.DeadlineMillis(e.RedisNow().Add(time.Hour))
	d := queue.DeadlineMillis(past)
	_, err = e.RDB.TxPipelined(ctx, func(p redis.Pipeliner) error {
		// An older client's reschedule of serials[0].
		p.HDel(ctx, e.Keys.Lease, serials[0])
		p.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(later), Member: serials[0]})
		// An older daemon's per-member lease of serials[1].
		p.HSet(ctx, e.Keys.Lease, serials[1], strconv.FormatInt(d, 10)+"|0|old:1.1|")
		p.ZAdd(ctx, e.Keys.Inflight, redis.Z{Score: float64(later), Member: serials[1]})
		p.ZAdd(ctx, e.Keys.Deadlines, redis.Z{Score: float64(d), Member: serials[1]})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	st, err := queue.ReadStats(ctx, e.RDB, e.Keys)
	if err != nil || st.Depth != 3 || st.Held != 2 || st.Overdue != 2 {
		t.Errorf("stats %+v (%v), want 3 deep, 2 held, 2 overdue", st, err)
	}
	a.process(ctx, resA.items)
	for i, want := range []string{"pending", "closed", "closed"} {
		if s := e.Status(serials[i]); s != want {
			t.Errorf("%s: %s, want %s", serials[i], s, want)
		}
	}
	if h := e.held(); h != 1 {
		t.Errorf("%d held, want 1 (the older daemon's)", h)
	}
	toks, _ := e.RDB.ZRange(ctx, e.Keys.Leases, 0, -1).Result()
	for _, tok := range toks {
		e.RDB.ZAdd(ctx, e.Keys.Leases, redis.Z{Score: 1, Member: tok})
	}
	res, err := e.consumer(Config{Owner: "B"}).claimBatch(ctx)
	if err != nil || len(res.items) != 0 {
		t.Fatalf("claim after the batch expired: %v, %+v, want nothing", err, res.items)
	}
	if n := e.card(e.Keys.Leases); n != 0 {
		t.Errorf("%d batch lease entries left after its lease expired, want 0", n)
	}
	if n, _ := e.RDB.HLen(ctx, e.Keys.LeaseBatch).Result(); n != 0 {
		t.Errorf("%d batch fields left after its lease expired, want 0", n)
	}
	if got, err := e.cl.Get(ctx, serials[0]); err != nil || got.State != client.StateQueued || got.Deadline.UnixMilli() != later {
		t.Errorf("moved member %+v (%v), want queued at the producer's deadline", got, err)
	}
}

// The reconciler leaves orders under a batch lease alone (they are the
// fast path's), and the overdue gauges and GET read their true deadline.
func TestAdvLeaseReconcilerAndGaugesSeeBatchLeasedOrders(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-10 * time.Minute)
	serials := e.Orders("alc", 3, past)
	e.Enqueue(serials, past)
	c := e.consumer(Config{})
	res := claimN(t, c, 3)
	r := maintain.NewReconciler(maintain.ReconcilerConfig{Keys: e.Keys, Grace: time.Minute, PageSize: 10}, e.RDB, e.Store, e.m, zap.NewNop())
	if n, err := r.RunOnce(ctx); err != nil || n != 0 {
		t.Fatalf("reconciler closed %d (%v) batch-leased orders, want 0", n, err)
	}
	st, err := queue.ReadStats(ctx, e.RDB, e.Keys)
	if err != nil || st.Overdue != 3 || st.OldestDue < 10*time.Minute-time.Second || st.OldestDue > 11*time.Minute {
		t.Errorf("stats %+v (%v), want 3 overdue, the oldest 10 minutes", st, err)
	}
	got, err := e.cl.Get(ctx, serials[1])
	if err != nil || got.Deadline.UnixMilli() != queue.DeadlineMillis(past) {
		t.Errorf("GET %+v (%v), want the true deadline", got, err)
	}
	c.process(ctx, res.items)
	if v := testutil.ToFloat64(e.m.Reconciled); v != 0 {
		t.Errorf("reconciled_total %v, want 0", v)
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 3 {
		t.Errorf("closed_total %v, want 3", v)
	}
	e.assertNoLeaseKeys(t)
}

// A replica is killed holding a batch, and its lease expires. The
// reconciler leaves the batch's orders alone (their lease records say they
// are held: the fast path's) — so a daemon that knows no batch leases (a
// downgrade) would close them by neither path; only a batch-aware claim
// takes them back, and closes them.
func TestAdvLeaseExpiredBatchIsClosedByAClaimNotTheReconciler(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-10 * time.Minute)
	serials := e.Orders("ald", 2, past)
	e.Enqueue(serials, past)
	dead := e.consumer(Config{Owner: "killed"})
	if res, err := dead.claimBatch(ctx); err != nil || len(res.items) != 2 {
		t.Fatalf("claim: %v, %d items", err, len(res.items))
	}
	e.expire(serials[0])
	r := maintain.NewReconciler(maintain.ReconcilerConfig{Keys: e.Keys, Grace: time.Minute, PageSize: 10}, e.RDB, e.Store, e.m, zap.NewNop())
	if n, err := r.RunOnce(ctx); err != nil || n != 0 {
		t.Fatalf("reconciler closed %d (%v) orders of an expired batch lease, want 0 (they look held)", n, err)
	}
	b := e.consumer(Config{Owner: "B"})
	res, err := b.claimBatch(ctx)
	if err != nil || len(res.items) != 2 || res.reclaimed != 2 {
		t.Fatalf("re-claim: %v, %+v, want both re-claimed", err, res)
	}
	b.process(ctx, res.items)
	for _, s := range serials {
		if st := e.Status(s); st != "closed" {
			t.Errorf("%s: %s, want closed", s, st)
		}
	}
	e.assertNoLeaseKeys(t)
}
