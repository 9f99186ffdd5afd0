package consumer

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

func TestClaimIsAtomicAcrossReplicas(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	now := e.RedisNow()
	serials := make([]string, 5000)
	for i := range serials {
		serials[i] = "atomic-" + strings.Repeat("x", i%7) + string(rune('a'+i%26)) + "-" + itoa(i)
	}
	e.Enqueue(serials, now.Add(-time.Second))

	const replicas = 4
	seen := make([][]string, replicas)
	var wg sync.WaitGroup
	for r := range replicas {
		c := e.consumer(Config{BatchSize: 97, Owner: "replica" + itoa(r)})
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				res, err := c.claimBatch(context.Background())
				if err != nil {
					t.Error(err)
					return
				}
				if len(res.items) == 0 {
					return
				}
				for _, it := range res.items {
					seen[r] = append(seen[r], it.serial)
				}
			}
		}()
	}
	wg.Wait()
	owner := map[string]int{}
	for r, ss := range seen {
		for _, s := range ss {
			if prev, dup := owner[s]; dup {
				t.Fatalf("%s claimed by replica %d and replica %d", s, prev, r)
			}
			owner[s] = r
		}
	}
	if len(owner) != len(serials) {
		t.Fatalf("claimed %d distinct serials, want %d", len(owner), len(serials))
	}
	if n := e.card(e.Keys.Queue); n != 0 {
		t.Fatalf("queue holds %d entries after claiming all, want 0", n)
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

func orderStatements() orders.Statements { return orders.DefaultStatements() }

func TestClaimTakesNothingBeforeItsDeadline(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	now := e.RedisNow()
	e.Enqueue([]string{"future-1"}, now.Add(2*time.Second))
	e.Enqueue([]string{"due-1"}, now.Add(-time.Millisecond))
	c := e.consumer(Config{})
	res, err := c.claimBatch(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(res.items) != 1 || res.items[0].serial != "due-1" {
		t.Fatalf("claimed %+v, want only due-1", res.items)
	}
	want := queue.DeadlineMillis(now.Add(2 * time.Second))
	if res.nextQueue != want {
		t.Fatalf("next deadline %d, want %d (the future entry)", res.nextQueue, want)
	}
	if res.items[0].deadline > res.now {
		t.Fatalf("claimed an entry due at %d when Redis's clock said %d", res.items[0].deadline, res.now)
	}
}

func TestClaimDeadLettersMalformedEntries(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	now := e.RedisNow()
	dueMs := float64(queue.DeadlineMillis(now.Add(-time.Second)))
	entries := []struct {
		member string
		score  float64
		reason string // "" means claimed
	}{
		{"good-1", dueMs, ""},
		{"", dueMs, queue.ReasonMalformed},
		{strings.Repeat("a", 129), dueMs, queue.ReasonMalformed},
		{"bad\xffutf8", dueMs, queue.ReasonMalformed},
		{"ctl\x01char", dueMs, queue.ReasonMalformed},
		{"c1\u0085char", dueMs, queue.ReasonMalformed},
		{"fraction", dueMs + 0.5, queue.ReasonMalformed},
		{"seconds-not-ms", float64(now.Unix()), queue.ReasonScoreOutOfRange},
		{"micros-not-ms", float64(now.UnixMicro()), queue.ReasonScoreOutOfRange},
		{"'; DROP TABLE orders; --", dueMs, ""},
		{"日本語-注文", dueMs, ""},
	}
	for _, en := range entries {
		if err := e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: en.score, Member: en.member}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	c := e.consumer(Config{})
	res, err := c.claimBatch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	claimed := map[string]bool{}
	for _, it := range res.items {
		claimed[it.serial] = true
	}
	for _, en := range entries {
		info, err := e.RDB.HGet(ctx, e.Keys.DeadInfo, en.member).Result()
		if en.reason == "" {
			if !claimed[en.member] || !errors.Is(err, redis.Nil) {
				t.Errorf("%q: claimed=%v dead=%q, want claimed and not dead", en.member, claimed[en.member], info)
			}
			continue
		}
		if claimed[en.member] {
			t.Errorf("%q was claimed, want dead-lettered as %s", en.member, en.reason)
		}
		if !strings.HasPrefix(info, en.reason+"|") {
			t.Errorf("%q dead-letter record %q, want reason %s", en.member, info, en.reason)
		}
	}
	if got := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(queue.ReasonMalformed)); got != 6 {
		t.Errorf("dead_lettered_total{malformed} = %v, want 6", got)
	}
	if got := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(queue.ReasonScoreOutOfRange)); got != 2 {
		t.Errorf("dead_lettered_total{score_out_of_range} = %v, want 2", got)
	}
	if n := e.card(e.Keys.Queue); n != 0 {
		t.Errorf("queue still holds %d entries", n)
	}
}

func TestLeasedEntryKeepsItsTrueDeadlineAndHandBackRestoresIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	deadline := e.RedisNow().Add(-1500 * time.Millisecond)
	e.Enqueue([]string{"lease-1"}, deadline)
	c := e.consumer(Config{Lease: time.Minute})
	res := claimN(t, c, 1)
	got, err := e.cl.Get(ctx, "lease-1")
	if err != nil {
		t.Fatal(err)
	}
	if got.State != client.StateLeased || got.Deadline.UnixMilli() != queue.DeadlineMillis(deadline) {
		t.Fatalf("while leased: state %s deadline %d, want leased %d", got.State, got.Deadline.UnixMilli(), queue.DeadlineMillis(deadline))
	}
	if !strings.HasPrefix(got.Owner, c.cfg.Owner+":") {
		t.Errorf("owner %q, want the replica's token", got.Owner)
	}
	st, err := queue.ReadStats(ctx, e.RDB, e.Keys)
	if err != nil {
		t.Fatal(err)
	}
	if st.Depth != 1 || st.Overdue != 1 || st.OldestDue < time.Second {
		t.Errorf("stats while leased %+v, want depth 1, overdue 1, oldest >= 1s", st)
	}
	c.handBack(res.items)
	score, err := e.RDB.ZScore(ctx, e.Keys.Queue, "lease-1").Result()
	if err != nil {
		t.Fatal(err)
	}
	if int64(score) != queue.DeadlineMillis(deadline) {
		t.Fatalf("handed back with score %d, want the true deadline %d", int64(score), queue.DeadlineMillis(deadline))
	}
	if n := e.held(); n != 0 {
		t.Fatalf("%d entries still in flight after hand-back", n)
	}
}

func TestRescheduledWhileLeasedKeepsTheProducersEntry(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	e.Enqueue([]string{"resched-1", "resched-2"}, e.RedisNow().Add(-time.Second))
	c := e.consumer(Config{})
	res := claimN(t, c, 2)
	later := time.Now().Add(time.Hour)
	if r, _, err := e.cl.Enqueue(ctx, "resched-1", later, client.Reschedule); err != nil || r != client.Moved {
		t.Fatalf("reschedule: %v %v", r, err)
	}
	// A raw producer re-adds the other one.
	e.Enqueue([]string{"resched-2"}, later)
	c.finish(res.items)
	for _, s := range []string{"resched-1", "resched-2"} {
		got, err := e.cl.Get(ctx, s)
		if err != nil {
			t.Fatalf("%s: %v (the producer's entry was removed)", s, err)
		}
		if got.State != client.StateQueued || got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
			t.Errorf("%s: %s at %s, want queued at %s", s, got.State, got.Deadline, later)
		}
	}
}

func TestIdempotentEnqueueDuringLeaseDoesNotDuplicate(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	deadline := e.RedisNow().Add(-time.Second)
	e.Enqueue([]string{"dup-1"}, deadline)
	c := e.consumer(Config{})
	if _, err := c.claimBatch(ctx); err != nil {
		t.Fatal(err)
	}
	r, at, err := e.cl.Enqueue(ctx, "dup-1", time.Now().Add(time.Hour), client.Create)
	if err != nil {
		t.Fatal(err)
	}
	if r != client.Unchanged || at.UnixMilli() != queue.DeadlineMillis(deadline) {
		t.Fatalf("retried create while leased: %s at %s, want unchanged at the true deadline", r, at)
	}
	if n := e.card(e.Keys.Queue); n != 0 {
		t.Fatalf("queue holds %d entries, want 0 (the entry is leased)", n)
	}
}

func TestExpiredLeaseIsReclaimed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	deadline := e.RedisNow().Add(-time.Second)
	e.Enqueue([]string{"dead-replica-1"}, deadline)
	a := e.consumer(Config{Owner: "a"})
	if res, err := a.claimBatch(ctx); err != nil || len(res.items) != 1 {
		t.Fatalf("claim a: %v", err)
	}
	b := e.consumer(Config{Owner: "b"})
	if res, err := b.claimBatch(ctx); err != nil || len(res.items) != 0 {
		t.Fatalf("b claimed %d entries while a's lease holds", len(res.items))
	}
	// Replica a dies; move its lease expiry into the past instead of waiting.
	e.expire("dead-replica-1")
	res, err := b.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim b after expiry: %v, %d items", err, len(res.items))
	}
	if res.items[0].deadline != queue.DeadlineMillis(deadline) {
		t.Errorf("re-claimed with deadline %d, want %d", res.items[0].deadline, queue.DeadlineMillis(deadline))
	}
	if got := testutil.ToFloat64(e.m.Reclaimed); got != 1 {
		t.Errorf("reclaimed_total %v, want 1", got)
	}
	// a's late finish must not remove b's lease.
	a.finish([]item{{token: "a:1", serial: "dead-replica-1"}})
	if ok, _ := e.RDB.HExists(ctx, e.Keys.Lease, "dead-replica-1").Result(); !ok {
		t.Fatal("a stale holder removed an entry re-leased by another replica")
	}
}
