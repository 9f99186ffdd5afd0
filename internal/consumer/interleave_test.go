package consumer

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Regression tests for the interleavings of issue 11: a producer writing the
// queue key while the daemon holds (or backs off) the same serial, and a
// checkout that enqueues before its own commit.

// expire moves serial's lease or backoff expiry into the past instead of
// waiting for it: its own entry's, or its batch lease's (and so every
// member's of that batch) when it has no entry of its own.
func (e *env) expire(serial string) {
	e.T.Helper()
	ctx := context.Background()
	key, member := e.Keys.Inflight, serial
	if _, err := e.RDB.ZScore(ctx, e.Keys.Inflight, serial).Result(); errors.Is(err, redis.Nil) {
		rec, _ := e.RDB.HGet(ctx, e.Keys.Lease, serial).Result()
		if f := strings.SplitN(rec, "|", 4); len(f) >= 3 && e.RDB.HExists(ctx, e.Keys.LeaseBatch, "#"+f[2]).Val() {
			key, member = e.Keys.Leases, f[2]
		}
	}
	if err := e.RDB.ZAdd(ctx, key, redis.Z{Score: 1, Member: member}).Err(); err != nil {
		e.T.Fatal(err)
	}
}

// Item 1: the order has no row yet, so it backs off; the checkout commits
// and reschedules it an hour later with a raw ZADD. When the backoff ends,
// the queue key's deadline must decide: the order is not closed early.
func TestRawRescheduleDuringBackoffWins(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	s := "resched-backoff-00000"
	e.Enqueue([]string{s}, e.RedisNow().Add(-time.Second))
	c := e.consumer(Config{})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v, %d items", err, len(res.items))
	}
	c.process(ctx, res.items) // no row: backs off
	if got, _ := e.cl.Get(ctx, s); got.State != client.StateBackoff {
		t.Fatalf("after a missing row: %s, want backoff", got.State)
	}
	later := e.RedisNow().Add(time.Hour)
	e.Orders("resched-backoff", 1, later)
	e.Enqueue([]string{s}, later)
	e.expire(s)
	res, err = c.claimBatch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.items) != 0 {
		t.Fatalf("claimed %v after the producer moved the deadline an hour ahead", res.items)
	}
	c.process(ctx, res.items)
	if st := e.Status(s); st != "pending" {
		t.Fatalf("status %s: closed an hour before the deadline the producer wrote", st)
	}
	got, err := e.cl.Get(ctx, s)
	if err != nil || got.State != client.StateQueued || got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
		t.Fatalf("entry %+v (%v), want queued at the producer's deadline", got, err)
	}
	if n := e.held(); n != 0 {
		t.Fatalf("%d companion entries left beside the producer's", n)
	}
}

// Item 1, during a lease: a raw ZADD an hour ahead while a replica holds
// the serial; the close must not commit, and the producer's entry stays.
func TestRawRescheduleDuringLeaseIsNotClosed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	now := e.RedisNow()
	serials := e.Orders("resched-lease", 2, now.Add(-time.Second))
	e.Enqueue(serials, now.Add(-time.Second))
	c := e.consumer(Config{})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 2 {
		t.Fatalf("claim: %v, %d items", err, len(res.items))
	}
	later := now.Add(time.Hour)
	e.Enqueue(serials[:1], later) // raw producer
	if _, _, err := e.cl.Enqueue(ctx, serials[1], later, client.Reschedule); err != nil {
		t.Fatal(err)
	}
	c.process(ctx, res.items)
	for _, s := range serials {
		if st := e.Status(s); st != "pending" {
			t.Errorf("%s: %s, want pending (rescheduled an hour ahead before the close began)", s, st)
		}
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.State != client.StateQueued || got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
			t.Errorf("%s: entry %+v (%v), want queued at the producer's deadline", s, got, err)
		}
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 0 {
		t.Errorf("closed_total %v, want 0", v)
	}
}

// Item 2: the checkout enqueued before its commit; the close ran before
// the commit, the lookup after it. A pending row is never "settled": the
// entry is retried soon, without spending an attempt, and then closed.
func TestPendingRowAfterCloseIsRetriedNotSettled(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	s := "late-commit-00000"
	e.Enqueue([]string{s}, e.RedisNow().Add(-time.Second))
	// The close sees no row; the row commits before the lookup runs.
	store := &commitBetween{Store: e.Store, before: func() { e.Orders("late-commit", 1, time.Now().Add(-time.Second)) }}
	c := e.consumer(Config{})
	c.store = store
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v", err)
	}
	c.process(ctx, res.items)
	got, err := e.cl.Get(ctx, s)
	if err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
		t.Fatalf("after a pending lookup: %+v (%v), want backoff with 0 attempts", got, err)
	}
	if v := testutil.ToFloat64(e.m.Skipped.WithLabelValues(metrics.SkipSettled)); v != 0 {
		t.Errorf("skipped{settled} %v: a pending row was counted as settled", v)
	}
	e.expire(s)
	res, err = c.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("re-claim: %v, %d items", err, len(res.items))
	}
	c.process(ctx, res.items)
	if st := e.Status(s); st != "closed" {
		t.Fatalf("status %s after the retry, want closed", st)
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 1 {
		t.Errorf("closed_total %v, want 1", v)
	}
}

// Item 8: an expired backoff plus a raw ZADD NX re-add of the same serial
// must not put the serial twice into one batch.
func TestBatchNeverHoldsASerialTwice(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	s := "twice-00000"
	past := e.RedisNow().Add(-time.Second)
	e.Enqueue([]string{s}, past)
	c := e.consumer(Config{})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v", err)
	}
	c.process(ctx, res.items) // no row yet: backs off
	e.Orders("twice", 1, past)
	if err := e.RDB.ZAddNX(ctx, e.Keys.Queue, redis.Z{Score: float64(queue.DeadlineMillis(past)), Member: s}).Err(); err != nil {
		t.Fatal(err)
	}
	e.expire(s)
	res, err = c.claimBatch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.items) != 1 {
		t.Fatalf("batch %v holds %d entries for one serial, want 1", res.items, len(res.items))
	}
	c.process(ctx, res.items)
	if v := testutil.ToFloat64(e.m.Closed); v != 1 {
		t.Errorf("closed_total %v, want 1", v)
	}
	if v := testutil.ToFloat64(e.m.Claimed); v != 2 {
		t.Errorf("claimed_total %v, want 2 (one per claim)", v)
	}
}

// commitBetween is a Store whose producer commits between the close and the
// lookup (once).
type commitBetween struct {
	*orders.Store
	before func()
}

func (s *commitBetween) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	out, err := s.Store.Settle(ctx, serials, fence)
	if s.before != nil {
		s.before()
		s.before = nil
	}
	return out, err
}

// Item 6: one row locked longer than lock_timeout must not hold its batch:
// the others close at once, the locked one is retried alone (no attempt
// spent: a lock is not the order's fault), and is closed once the lock is
// gone.
func TestLockedRowIsIsolatedFromItsBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	e.Store.SetTimeouts(5*time.Second, 50*time.Millisecond)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("locked", 20, past)
	e.Enqueue(serials, past)
	held := serials[7]
	tx, err := e.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.Exec(`SELECT 1 FROM orders WHERE serial_no = $1 FOR UPDATE`, held); err != nil {
		t.Fatal(err)
	}
	c := e.consumer(Config{BatchSize: 20})
	c.stopping = make(chan struct{})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 20 {
		t.Fatalf("claim: %v, %d items", err, len(res.items))
	}
	c.process(ctx, res.items)
	if got := e.StatusCounts(); got["closed"] != 19 || got["pending"] != 1 {
		t.Fatalf("statuses %v, want the 19 unlocked orders closed", got)
	}
	got, err := e.cl.Get(ctx, held)
	if err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
		t.Fatalf("locked order: %+v (%v), want backoff with 0 attempts", got, err)
	}
	if v := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); v != 1 {
		t.Errorf("dependency_up{postgres} = %v: one locked row is not the database being down", v)
	}
	tx.Rollback()
	e.expire(held)
	if res, err = c.claimBatch(ctx); err != nil || len(res.items) != 1 {
		t.Fatalf("re-claim: %v, %d items", err, len(res.items))
	}
	c.process(ctx, res.items)
	if st := e.Status(held); st != "closed" {
		t.Fatalf("after the lock went: %s, want closed", st)
	}
}

// Item 8, the gauges: a serial leased and re-added by a raw producer an hour
// ahead is one entry, not overdue (the producer's deadline counts).
func TestStatsCountASerialInBothKeysOnce(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	now := e.RedisNow()
	e.Enqueue([]string{"both-1"}, now.Add(-time.Minute))
	c := e.consumer(Config{})
	if res, err := c.claimBatch(ctx); err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v", err)
	}
	e.Enqueue([]string{"both-1"}, now.Add(time.Hour))
	st, err := queue.ReadStats(ctx, e.RDB, e.Keys)
	if err != nil {
		t.Fatal(err)
	}
	if st.Depth != 1 || st.Overdue != 0 {
		t.Fatalf("stats %+v, want depth 1 and overdue 0", st)
	}
}

// ORDERDELAY_BACKOFF_MAX caps the wait after a failed database or Redis call
// too, so an order is retried within it once an outage ends (it was a fixed
// 10 s, which the campaign's settle bound missed on a busy machine).
func TestDependencyBackoffRespectsBackoffMax(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	c := e.consumer(Config{BackoffMax: time.Second})
	var most time.Duration
	for range 50 {
		most = max(most, c.pgBackoff())
	}
	// backoff's jitter spreads each wait by ±50% around the cap.
	if most > 1500*time.Millisecond {
		t.Fatalf("longest wait after a failed call %s, want at most 1.5 s with BackoffMax 1s", most)
	}
}
