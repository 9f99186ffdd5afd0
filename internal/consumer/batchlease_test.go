package consumer

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Tests of the batch lease (issue 13): one expiry entry per claim, the
// members' records written once, and the interleavings it creates — a
// producer moving one member of a batch, a batch finished in parts, an
// expired batch re-claimed while its old holder fences, and per-member
// leases left by older daemons at an upgrade.

// assertNoLeaseKeys fails if any lease key of the queue still holds
// something: every batch goes with its last member.
func (e *env) assertNoLeaseKeys(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	for _, k := range []string{e.Keys.Inflight, e.Keys.Deadlines, e.Keys.Lease, e.Keys.Leases, e.Keys.LeaseBatch} {
		if n, err := e.RDB.Exists(ctx, k).Result(); err != nil || n != 0 {
			t.Errorf("%s left behind (%v)", k, err)
		}
	}
}

// A claim writes one lease entry for the batch and one record per member,
// no per-member sorted-set entries; GET, the gauges and a finish see it.
func TestBatchLeaseIsOneEntryPerClaim(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Minute)
	serials := []string{"bl-1", "bl-2", "bl-3", "bl-4"}
	e.Enqueue(serials, past)
	c := e.consumer(Config{})
	res := claimN(t, c, 4)
	if n := e.card(e.Keys.Inflight) + e.card(e.Keys.Deadlines); n != 0 {
		t.Errorf("%d per-member entries written by a batch claim, want 0", n)
	}
	if n := e.card(e.Keys.Leases); n != 1 {
		t.Errorf("%d batch lease entries, want 1", n)
	}
	st, err := queue.ReadStats(ctx, e.RDB, e.Keys)
	if err != nil {
		t.Fatal(err)
	}
	if st.Held != 4 || st.Depth != 4 || st.Overdue != 4 || st.OldestDue < time.Minute-time.Second {
		t.Errorf("stats %+v, want 4 held, deep and overdue, oldest a minute", st)
	}
	got, err := e.cl.Get(ctx, "bl-2")
	if err != nil || got.State != client.StateLeased || got.Deadline.UnixMilli() != queue.DeadlineMillis(past) ||
		got.Until.Before(e.RedisNow()) {
		t.Fatalf("GET of a batch member: %+v (%v), want leased at its deadline until the lease's end", got, err)
	}
	c.finish(res.items)
	e.assertNoLeaseKeys(t)
}

// A producer reschedules one member of a batch through the client and
// cancels another (paid): the rest closes, neither of those two does, the
// rescheduled one waits at the producer's deadline, and the batch goes
// with its last member.
func TestBatchLeaseProducerMovesOneMember(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("bl-move", 4, past)
	e.Enqueue(serials, past)
	c := e.consumer(Config{})
	res := claimN(t, c, 4)
	later := e.RedisNow().Add(time.Hour)
	if r, _, err := e.cl.Enqueue(ctx, serials[1], later, client.Reschedule); err != nil || r != client.Moved {
		t.Fatalf("reschedule: %v, %v", r, err)
	}
	if err := e.cl.Cancel(ctx, serials[2]); err != nil {
		t.Fatal(err)
	}
	if h := e.held(); h != 2 {
		t.Errorf("%d held after a reschedule and a cancel of two of four, want 2", h)
	}
	c.process(ctx, res.items)
	for i, want := range []string{"closed", "pending", "pending", "closed"} {
		if st := e.Status(serials[i]); st != want {
			t.Errorf("%s: %s, want %s", serials[i], st, want)
		}
	}
	got, err := e.cl.Get(ctx, serials[1])
	if err != nil || got.State != client.StateQueued || got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
		t.Fatalf("rescheduled member %+v (%v), want queued at the producer's deadline", got, err)
	}
	if _, err := e.cl.Get(ctx, serials[2]); err != client.ErrNotFound {
		t.Errorf("cancelled member: %v, want not found", err)
	}
	e.assertNoLeaseKeys(t)
}

// A batch settled in parts: two members finish, one backs off (a
// per-member backoff from then on), the last is handed back; the batch
// counts what it still holds and goes with the last.
func TestBatchLeasePartialFinish(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	e.Enqueue([]string{"bp-1", "bp-2", "bp-3", "bp-4"}, past)
	c := e.consumer(Config{})
	res := claimN(t, c, 4)
	c.finish(res.items[:2])
	if h := e.held(); h != 2 {
		t.Fatalf("%d held after finishing two of four, want 2", h)
	}
	c.retry(res.items[2:3], time.Hour, true, "boom")
	if h := e.held(); h != 2 {
		t.Fatalf("%d held after a retry, want 2 (one leased, one backing off)", h)
	}
	if n := e.card(e.Keys.Inflight) + e.card(e.Keys.Deadlines); n != 2 {
		t.Errorf("%d per-member entries for one backoff, want 2", n)
	}
	got, err := e.cl.Get(ctx, "bp-3")
	if err != nil || got.State != client.StateBackoff || got.Attempts != 1 || got.LastError != "boom" {
		t.Fatalf("retried member %+v (%v), want backoff after 1 attempt", got, err)
	}
	// A second finish of settled members changes nothing.
	c.finish(res.items[:3])
	if h := e.held(); h != 2 {
		t.Fatalf("%d held after a repeated finish, want 2", h)
	}
	c.handBack(res.items[3:])
	if n := e.card(e.Keys.Leases); n != 0 {
		t.Errorf("%d batch entries after its last member went, want 0", n)
	}
	if n, _ := e.RDB.HLen(ctx, e.Keys.LeaseBatch).Result(); n != 0 {
		t.Errorf("%d batch fields after its last member went, want 0", n)
	}
	if s, err := e.RDB.ZScore(ctx, e.Keys.Queue, "bp-4").Result(); err != nil || int64(s) != queue.DeadlineMillis(past) {
		t.Errorf("handed-back member at %v (%v), want its deadline", s, err)
	}
}

// Replica A's batch lease expires; B re-claims it in two claims smaller
// than the batch while A still works: A's fence drops every member (its
// token is gone), nothing is claimed twice, B closes each order once.
func TestExpiredBatchLeaseReclaimedWhileOldHolderFences(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("bl-expire", 3, past)
	e.Enqueue(serials, past)
	a := e.consumer(Config{Owner: "A"})
	resA, err := a.claimBatch(ctx)
	if err != nil || len(resA.items) != 3 {
		t.Fatalf("A claim: %v, %d items", err, len(resA.items))
	}
	e.expire(serials[0])
	b := e.consumer(Config{Owner: "B", BatchSize: 2})
	var got []item
	for range 3 {
		res, err := b.claimBatch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, res.items...)
		if len(res.items) > 2 {
			t.Fatalf("B claimed %d, above its batch size 2", len(res.items))
		}
	}
	var names []string
	for _, it := range got {
		names = append(names, it.serial)
	}
	slices.Sort(names)
	if !slices.Equal(names, serials) {
		t.Fatalf("B re-claimed %v, want each of %v once", names, serials)
	}
	if v := testutil.ToFloat64(e.m.Reclaimed); v != 3 {
		t.Errorf("reclaimed_total %v, want 3", v)
	}
	a.process(ctx, resA.items)
	for _, s := range serials {
		if st := e.Status(s); st != "pending" {
			t.Fatalf("A closed %s after its lease expired and B re-claimed it", s)
		}
	}
	b.process(ctx, got)
	for _, s := range serials {
		if st := e.Status(s); st != "closed" {
			t.Errorf("%s: %s, want closed", s, st)
		}
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 3 {
		t.Errorf("closed_total %v, want 3", v)
	}
	e.assertNoLeaseKeys(t)
}

// A raw ZADD re-adds a member of an expired batch: the queue key's
// deadline decides; the stale lease is dropped and not re-claimed.
func TestExpiredBatchMemberRewrittenByRawProducer(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	e.Enqueue([]string{"bx-1", "bx-2"}, past)
	c := e.consumer(Config{})
	if res, err := c.claimBatch(ctx); err != nil || len(res.items) != 2 {
		t.Fatalf("claim: %v", err)
	}
	later := e.RedisNow().Add(time.Hour)
	e.Enqueue([]string{"bx-2"}, later)
	e.expire("bx-1")
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 1 || res.items[0].serial != "bx-1" {
		t.Fatalf("re-claim: %v, %+v, want bx-1 alone", err, res.items)
	}
	if ok, _ := e.RDB.HExists(ctx, e.Keys.Lease, "bx-2").Result(); ok {
		t.Error("the stale lease of the rewritten member is still there")
	}
	c.finish(res.items)
	e.assertNoLeaseKeys(t)
	if s, err := e.RDB.ZScore(ctx, e.Keys.Queue, "bx-2").Result(); err != nil || int64(s) != queue.DeadlineMillis(later) {
		t.Errorf("bx-2 at %v (%v), want the producer's deadline", s, err)
	}
}

// An upgrade: leases written per member by an older daemon are still in
// Redis. An expired one is re-claimed into a batch (its per-member entries
// go); an unexpired one stays its holder's, who finishes it with the same
// compare-and-set; the gauges count both layouts.
func TestPerMemberLeasesOfAnOlderDaemon(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	now := e.RedisNow()
	d := queue.DeadlineMillis(now.Add(-time.Minute))
	old := func(s, tok string, expiry int64) {
		t.Helper()
		_, err := e.RDB.TxPipelined(ctx, func(p redis.Pipeliner) error {
			p.HSet(ctx, e.Keys.Lease, s, strconv.FormatInt(d, 10)+"|2|"+tok+"|")
			p.ZAdd(ctx, e.Keys.Inflight, redis.Z{Score: float64(expiry), Member: s})
			p.ZAdd(ctx, e.Keys.Deadlines, redis.Z{Score: float64(d), Member: s})
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	old("up-expired", "old:1.1", 1)
	old("up-held", "old:1.2", queue.DeadlineMillis(now.Add(time.Hour)))
	if h := e.held(); h != 2 {
		t.Fatalf("%d held before the claim, want 2", h)
	}
	c := e.consumer(Config{})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 1 || res.items[0].serial != "up-expired" {
		t.Fatalf("claim: %v, %+v, want up-expired alone", err, res.items)
	}
	if it := res.items[0]; it.deadline != d || it.attempts != 2 {
		t.Errorf("re-claimed %+v, want its deadline %d and 2 attempts", it, d)
	}
	for _, k := range []string{e.Keys.Inflight, e.Keys.Deadlines} {
		if _, err := e.RDB.ZScore(ctx, k, "up-expired").Result(); err != redis.Nil {
			t.Errorf("up-expired still in %s after its re-claim into a batch", k)
		}
	}
	st, err := queue.ReadStats(ctx, e.RDB, e.Keys)
	if err != nil || st.Held != 2 || st.Depth != 2 || st.Overdue != 2 {
		t.Fatalf("stats %+v (%v), want 2 held, deep and overdue", st, err)
	}
	// The older daemon's holder finishes its own lease.
	oldHolder := e.consumer(Config{})
	oldHolder.finish([]item{{token: "old:1.2", serial: "up-held"}})
	c.finish(res.items)
	e.assertNoLeaseKeys(t)
}

// The claim reads the queue's head first and skips the due-entries query
// when nothing is due: a head at -1 or -inf (a raw producer's junk) is
// still due, and dead-lettered, not taken for an empty queue.
func TestClaimHeadCheckKeepsNegativeScoresDue(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	if err := e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: -1, Member: "neg-one"}).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.consumer(Config{})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 0 || res.dead["score_out_of_range"] != 1 {
		t.Fatalf("claim: %v, %+v, want neg-one dead-lettered", err, res)
	}
	if n := e.card(e.Keys.Dead); n != 1 {
		t.Errorf("%d dead letters, want 1", n)
	}
}
