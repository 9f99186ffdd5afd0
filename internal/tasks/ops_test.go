package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A requeue on a durable queue puts the FAILED row back to SCHEDULED (due
// now, no attempts, a new version, logged) as well as the Redis entry:
// otherwise the executor, which runs only SCHEDULED rows, would drop the
// requeued task without running it. A row that is not FAILED is refused.
func TestDurableRequeueResetsTheRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, keys := testenv.Redis(t)
	db, _ := testenv.Postgres(t)
	cl, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	d := &Durable{DB: db, Queue: "dq", Window: time.Hour, Client: cl, Log: zaptest.NewLogger(t)}
	r := &Runtime{Config: Queue{Name: "dq", Key: keys.Queue, Durable: true}, Keys: keys, Client: cl, Redis: rdb, Store: queue.NewStore(rdb, keys), Durable: d}
	due := time.Now().Add(-time.Second)
	for _, id := range []string{"D-1", "D-exec"} {
		if _, _, err := d.Put(ctx, id, json.RawMessage(`{"id":"`+id+`"}`), due, client.Create); err != nil {
			t.Fatal(err)
		}
	}
	// D-1 fails its last attempt, D-exec succeeds.
	exec := d.Executor(func(_ context.Context, ts []consumer.Task) []error {
		errs := make([]error, len(ts))
		for i, tk := range ts {
			if tk.ID == "D-1" {
				errs[i] = errors.New("boom")
			}
		}
		return errs
	}, 1)
	exec(ctx, []consumer.Task{{ID: "D-1"}, {ID: "D-exec"}})
	// Redis dead-letters both as the consumer would (D-exec: a stale dead
	// letter of a task that ran after all).
	for _, id := range []string{"D-1", "D-exec"} {
		rdb.ZRem(ctx, keys.Queue, id)
		rdb.ZAdd(ctx, keys.Dead, redisZ(id, float64(time.Now().UnixMilli())))
		rdb.HSet(ctx, keys.DeadInfo, id, "failed|1|0|boom")
	}
	var before Row
	if err := db.Get(&before, `SELECT id, due_at, payload, state, attempts, version FROM orderdelay_tasks WHERE queue = 'dq' AND id = 'D-1'`); err != nil || before.State != StateFailed {
		t.Fatalf("D-1 before: %+v %v, want FAILED", before, err)
	}

	res, err := r.Requeue(ctx, []string{"D-1", "D-exec"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Requeued != 1 || len(res.Skipped) != 1 || res.Skipped[0].ID != "D-exec" || res.Skipped[0].Why != WhyNotFailed {
		t.Errorf("requeue: %+v, want D-1 requeued and D-exec refused (%q)", res, WhyNotFailed)
	}
	var after Row
	if err := db.Get(&after, `SELECT id, due_at, payload, state, attempts, version FROM orderdelay_tasks WHERE queue = 'dq' AND id = 'D-1'`); err != nil {
		t.Fatal(err)
	}
	if after.State != StateScheduled || after.Attempts != 0 || after.Version <= before.Version || after.Due.After(time.Now().Add(time.Second)) {
		t.Errorf("D-1 row after requeue: %+v, want SCHEDULED, 0 attempts, version > %d, due now", after, before.Version)
	}
	var logged int
	if err := db.Get(&logged, `SELECT count(*) FROM orderdelay_task_log WHERE queue = 'dq' AND task_id = 'D-1' AND detail = 'requeued by an operator'`); err != nil || logged != 1 {
		t.Errorf("%d log rows for the requeue (%v), want 1", logged, err)
	}
	if _, err := rdb.ZScore(ctx, keys.Queue, "D-1").Result(); err != nil {
		t.Errorf("D-1 is not queued in Redis: %v", err)
	}
	if _, err := rdb.ZScore(ctx, keys.Queue, "D-exec").Result(); err == nil {
		t.Error("the executed task was queued again")
	}
	var state string
	if err := db.Get(&state, `SELECT state FROM orderdelay_tasks WHERE queue = 'dq' AND id = 'D-exec'`); err != nil || state != StateExecuted {
		t.Errorf("D-exec row %q (%v), want EXECUTED untouched", state, err)
	}
	// The executor now runs it.
	ran := false
	d.Executor(func(_ context.Context, ts []consumer.Task) []error {
		ran = len(ts) == 1
		return make([]error, len(ts))
	}, 1)(ctx, []consumer.Task{{ID: "D-1"}})
	if !ran {
		t.Error("the executor dropped the requeued task")
	}
}

func TestListRefusesBadStateAndCursor(t *testing.T) {
	t.Parallel()
	rdb, keys := testenv.Redis(t)
	r := &Runtime{Config: Queue{Name: "q", Key: keys.Queue}, Keys: keys, Redis: rdb, Store: queue.NewStore(rdb, keys)}
	if _, err := r.List(context.Background(), "done", "", 10, false); !errors.Is(err, ErrBadState) {
		t.Errorf("state done: %v, want ErrBadState", err)
	}
	if _, err := r.List(context.Background(), ListDead, "%%%", 10, false); !errors.Is(err, queue.ErrBadCursor) {
		t.Errorf("bad cursor: %v, want ErrBadCursor", err)
	}
}

func redisZ(m string, s float64) redis.Z { return redis.Z{Member: m, Score: s} }

// Inflight tasks show their true due time, attempts, last error and when
// their lease or backoff ends; a backoff (token "-") is "backoff".
func TestListInflightShowsLeasesAndBackoffs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, keys := testenv.Redis(t)
	r := &Runtime{Config: Queue{Name: "q", Key: keys.Queue}, Keys: keys, Redis: rdb, Store: queue.NewStore(rdb, keys)}
	due := time.UnixMilli(1_800_000_000_000).UTC()
	rdb.ZAdd(ctx, keys.Inflight, redisZ("b", 1_800_000_060_000), redisZ("l", 1_800_000_030_000))
	rdb.HSet(ctx, keys.Lease, "b", "1800000000000|2|-|webhook https://x.example: status 503", "l", "1800000000000|0|poll.X")
	page, err := r.List(ctx, ListInflight, "", 10, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Tasks) != 2 || page.Next != "" {
		t.Fatalf("inflight page %+v, want l then b, no next", page)
	}
	l, b := page.Tasks[0], page.Tasks[1]
	if l.ID != "l" || l.State != "leased" || !l.Due.Equal(due) || l.Attempts != 0 || l.LastError != "" ||
		l.Until == nil || l.Until.UnixMilli() != 1_800_000_030_000 {
		t.Errorf("leased %+v", l)
	}
	if b.ID != "b" || b.State != "backoff" || !b.Due.Equal(due) || b.Attempts != 2 || b.LastError != "webhook https://x.example: status 503" ||
		b.Until == nil || b.Until.UnixMilli() != 1_800_000_060_000 {
		t.Errorf("backoff %+v", b)
	}
}
