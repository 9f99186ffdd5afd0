package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// A producer's reschedule at each point of a close transaction
// (orders.Store.closeOnce: BEGIN, the statement, fence, COMMIT),
// run inline by a hook: the producer's write is acknowledged before the
// close goes on, with no sleep deciding the order.

// hookedStore runs at(point) at each point of every close: "statement"
// before the close statement (BEGIN not yet sent), "fence" after the
// statement locked and updated the rows, before the fence asks Redis,
// and "commit" after the fence said yes, before COMMIT.
type hookedStore struct {
	*orders.Store
	at func(point string)
}

func (h hookedStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	h.at("statement")
	return h.Store.Settle(ctx, serials, func(ctx context.Context, closed []string) ([]string, error) {
		h.at("fence")
		drop, err := fence(ctx, closed)
		if err == nil && len(drop) == 0 {
			h.at("commit")
		}
		return drop, err
	})
}

// reschedulers are the two ways a producer moves a deadline: a raw ZADD,
// and the API's or the Go client's reschedule (the enqueue script, which
// drops the lease record).
func (e *env) reschedulers() map[string]func(serial string, at time.Time) {
	return map[string]func(string, time.Time){
		"raw ZADD": func(s string, at time.Time) { e.Enqueue([]string{s}, at) },
		"client": func(s string, at time.Time) {
			e.T.Helper()
			if _, _, err := e.cl.Enqueue(context.Background(), s, at, client.Reschedule); err != nil {
				e.T.Fatal(err)
			}
		},
	}
}

// claimWhenDue claims until the entry of serial comes back (it is not due
// before then: the claim script compares on Redis's clock) and returns the
// claim, checking it was taken at or after want, its deadline.
func (e *env) claimWhenDue(t *testing.T, c *Consumer, serial string, want time.Time) claimResult {
	t.Helper()
	var res claimResult
	eventually(t, "the rescheduled entry comes due", 30*time.Second, func() bool {
		var err error
		res, err = c.claimBatch(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return len(res.items) > 0
	})
	if len(res.items) != 1 || res.items[0].serial != serial {
		t.Fatalf("claimed %+v, want only %s", res.items, serial)
	}
	if d := res.items[0].deadline; d != queue.DeadlineMillis(want) || res.now < d {
		t.Fatalf("claimed at %d with deadline %d, want deadline %d and not before it", res.now, d, queue.DeadlineMillis(want))
	}
	return res
}

func (e *env) closedAt(serial string) time.Time {
	e.T.Helper()
	var at time.Time
	if err := e.DB.Get(&at, "SELECT closed_at FROM orders WHERE serial_no = $1", serial); err != nil {
		e.T.Fatal(err)
	}
	return at
}

// (a) A reschedule acknowledged before the close statement began, or
// while the statement ran and before the fence asked: honoured. The close
// rolls back, the order stays pending, nothing is counted, and the order
// closes at the new deadline, not before.
func TestRescheduleBeforeTheFenceIsHonoured(t *testing.T) {
	t.Parallel()
	for _, point := range []string{"statement", "fence"} {
		for name := range (&env{}).reschedulers() {
			t.Run(point+"/"+name, func(t *testing.T) {
				t.Parallel()
				e := newEnv(t, orderStatements())
				ctx := context.Background()
				past := e.RedisNow().Add(-time.Second)
				s := e.Orders("honoured", 1, past)[0]
				e.Enqueue([]string{s}, past)
				later := e.RedisNow().Add(700 * time.Millisecond)
				fired := false
				c := e.consumer(Config{})
				c.store = hookedStore{Store: e.Store, at: func(p string) {
					if p == point && !fired {
						fired = true
						e.reschedulers()[name](s, later)
					}
				}}
				res := claimN(t, c, 1)
				c.process(ctx, res.items)
				if !fired {
					t.Fatalf("the close never reached %q", point)
				}
				if st := e.Status(s); st != "pending" {
					t.Fatalf("status %s: closed although the reschedule was acknowledged before the fence", st)
				}
				if v := testutil.ToFloat64(e.m.Closed); v != 0 {
					t.Errorf("closed_total %v, want 0", v)
				}
				got, err := e.cl.Get(ctx, s)
				if err != nil || got.State != client.StateQueued || got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
					t.Fatalf("entry %+v (%v), want queued at the new deadline", got, err)
				}
				if n := e.held(); n != 0 {
					t.Errorf("%d entries still leased or backing off", n)
				}
				res = e.claimWhenDue(t, c, s, later)
				c.process(ctx, res.items)
				if st := e.Status(s); st != "closed" {
					t.Fatalf("status %s at the new deadline, want closed", st)
				}
				if at := e.closedAt(s); at.Before(later) {
					t.Errorf("closed at %v, before the new deadline %v", at, later)
				}
				if v := testutil.ToFloat64(e.m.Closed); v != 1 {
					t.Errorf("closed_total %v, want 1", v)
				}
				e.assertNoEntries(t, s)
			})
		}
	}
}

// (b) A reschedule that lands after the fence said yes and before COMMIT
// loses: the order closes (the contract allows it: the close was in
// flight). Afterwards nothing is inconsistent: the lease keys are empty,
// the producer's new entry waits in the queue key and, when it comes due,
// is dropped as settled — not closed again, not dead-lettered — and the
// metrics and the log say so.
func TestRescheduleBetweenFenceAndCommitIsSettledAfterwards(t *testing.T) {
	t.Parallel()
	for name := range (&env{}).reschedulers() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, orderStatements())
			ctx := context.Background()
			past := e.RedisNow().Add(-time.Second)
			serials := e.Orders("window", 3, past)
			e.Enqueue(serials, past)
			s := serials[1]
			later := e.RedisNow().Add(700 * time.Millisecond)
			fired := false
			core, logs := observer.New(zap.InfoLevel)
			c := e.consumer(Config{})
			c.log = zap.New(core)
			c.store = hookedStore{Store: e.Store, at: func(p string) {
				if p == "commit" && !fired {
					fired = true
					e.reschedulers()[name](s, later)
				}
			}}
			res := claimN(t, c, 3)
			c.process(ctx, res.items)
			if !fired {
				t.Fatal("the close never reached its commit")
			}
			for _, o := range serials {
				if st := e.Status(o); st != "closed" {
					t.Fatalf("%s is %s: the fence had said yes, the close commits", o, st)
				}
			}
			closedAt := e.closedAt(s)
			if v := testutil.ToFloat64(e.m.Closed); v != 3 {
				t.Errorf("closed_total %v, want 3", v)
			}
			if n := e.held(); n != 0 {
				t.Errorf("%d entries still leased or backing off after the batch", n)
			}
			for _, k := range []string{e.Keys.Leases, e.Keys.Inflight, e.Keys.Deadlines} {
				if n := e.card(k); n != 0 {
					t.Errorf("%s holds %d entries after the batch", k, n)
				}
			}
			if n, _ := e.RDB.HLen(ctx, e.Keys.Lease).Result(); n != 0 {
				t.Errorf("%d lease records left after the batch", n)
			}
			if n, _ := e.RDB.HLen(ctx, e.Keys.LeaseBatch).Result(); n != 0 {
				t.Errorf("%d batch-lease fields left after the batch", n)
			}
			got, err := e.cl.Get(ctx, s)
			if err != nil || got.State != client.StateQueued || got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
				t.Fatalf("the producer's entry: %+v (%v), want queued at its new deadline", got, err)
			}
			if logs.FilterMessageSnippet("no longer this claim's").FilterField(zap.Int("orders", 1)).Len() == 0 && name == "client" {
				t.Errorf("nothing logged about the entry a producer rewrote during the close; logs: %v", logs.All())
			}
			res = e.claimWhenDue(t, c, s, later)
			c.process(ctx, res.items)
			if v := testutil.ToFloat64(e.m.Closed); v != 3 {
				t.Errorf("closed_total %v after the new entry came due, want 3 (closed once)", v)
			}
			if v := testutil.ToFloat64(e.m.Skipped.WithLabelValues(metrics.SkipSettled)); v != 1 {
				t.Errorf("skipped_total{settled} %v, want 1: the new entry is settled", v)
			}
			for _, r := range []string{queue.ReasonNotFound, queue.ReasonCloseFailed} {
				if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(r)); v != 0 {
					t.Errorf("dead_lettered_total{%s} %v, want 0", r, v)
				}
			}
			if at := e.closedAt(s); !at.Equal(closedAt) {
				t.Errorf("closed_at moved from %v to %v: closed twice", closedAt, at)
			}
			for _, o := range serials {
				e.assertNoEntries(t, o)
			}
			if n := e.held(); n != 0 {
				t.Errorf("%d entries still held at the end", n)
			}
		})
	}
}

// lateFenceStore runs each close's fence only once expire has ended the
// batch's time: a fence whose Redis answered after the batch's deadline.
// late makes the fence's call itself run on, as a read go-redis does not
// cut (its answer comes back after the deadline); else the call meets the
// ended context.
type lateFenceStore struct {
	*orders.Store
	expire func()
	late   bool
	ran    bool
}

func (s *lateFenceStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	return s.Store.Settle(ctx, serials, func(ctx context.Context, closed []string) ([]string, error) {
		s.ran = true
		s.expire()
		if s.late {
			return fence(context.WithoutCancel(ctx), closed)
		}
		return fence(ctx, closed)
	})
}

// A whole batch (no row being isolated) whose fence answers after the
// batch's deadline: nothing commits, the orders are retried, and the log
// says the batch's time ran out waiting for the queue's check before the
// commit — not that it ran out isolating a row.
func TestLateFenceIsLoggedAsSuch(t *testing.T) {
	t.Parallel()
	for _, late := range []bool{true, false} {
		name := map[bool]string{true: "answered after the deadline", false: "called after the deadline"}[late]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, orderStatements())
			past := e.RedisNow().Add(-time.Second)
			serials := e.Orders("latefence", 2, past)
			e.Enqueue(serials, past)
			c := e.consumer(Config{BatchSize: 10})
			core, logs := observer.New(zap.InfoLevel)
			c.log = zap.New(core)
			batchCtx, expire := context.WithCancel(context.Background())
			defer expire()
			st := &lateFenceStore{Store: e.Store, expire: expire, late: late}
			c.store = st
			res := claimN(t, c, len(serials))
			_, stmt := c.batchBudget()
			c.closeItems(context.Background(), batchCtx, stmt, res.items) //nolint:errcheck // handled inside
			if !st.ran {
				t.Fatal("the close never reached its fence")
			}
			for _, s := range serials {
				if got := e.Status(s); got != "pending" {
					t.Errorf("%s: %s after a late fence, want pending (nothing commits)", s, got)
				}
			}
			if n := e.held(); n != int64(len(serials)) {
				t.Errorf("%d entries backing off, want %d (retried)", n, len(serials))
			}
			if n := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClose)); n != 1 {
				t.Errorf("errors_total{close} = %v, want 1", n)
			}
			if n := logs.FilterMessageSnippet("isolating").Len(); n != 0 {
				t.Errorf("%d log lines say a row was being isolated; none was", n)
			}
			if n := logs.FilterMessageSnippet("waiting for the queue's check before the commit").Len(); n != 1 {
				t.Errorf("%d lines say the batch's time ran out waiting for the fence, want 1; the log: %v", n, messages(logs))
			}
		})
	}
}

func messages(logs *observer.ObservedLogs) []string {
	var out []string
	for _, l := range logs.All() {
		out = append(out, l.Message)
	}
	return out
}
