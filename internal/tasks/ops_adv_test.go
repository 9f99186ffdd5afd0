package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"

	"github.com/prometheus/client_golang/prometheus"
)

// The executor settles a task's last failed attempt (row FAILED) inside
// the action, before the consumer dead-letters it in Redis: in between the
// task is still leased there. A requeue in that window answered "a live
// task has this id; it and the dead letter are left alone" but had already
// moved the row back to SCHEDULED (new version, attempts 0, logged as
// requeued by an operator), so the loader ran the task again once it was
// dead-lettered, against what the operator was told. A requeue that
// reports an id skipped as live must leave its row as it was.
func TestDurableRequeueOfALeasedTaskLeavesTheRow(t *testing.T) {
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
	if _, _, err := d.Put(ctx, "D-1", json.RawMessage(`{"n":1}`), time.Now().Add(-time.Second), client.Create); err != nil {
		t.Fatal(err)
	}
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	failLeased := func() {
		t.Helper()
		leased, _, err := PollStore(ctx, r.Store, queue.PollArgs{Limit: 10, Lease: time.Minute, MaxAttempts: 5}, m, zap.NewNop())
		if err != nil || len(leased) != 1 {
			t.Fatalf("lease: %v %+v", err, leased)
		}
		// The last attempt fails: the executor settles FAILED; Redis still
		// holds the lease (the consumer has not dead-lettered it yet).
		d.Executor(func(_ context.Context, ts []consumer.Task) []error {
			return []error{errors.New("boom")}
		}, 1)(ctx, leased)
	}
	// First round: requeued in the window, then dead-lettered by the
	// consumer; the loader brings the SCHEDULED row back beside the dead
	// letter.
	failLeased()
	if res, err := r.Requeue(ctx, []string{"D-1"}); err != nil || res.Requeued != 1 {
		t.Fatalf("first requeue: %+v %v", res, err)
	}
	rdb.HDel(ctx, keys.Lease, "D-1")
	rdb.ZRem(ctx, keys.Inflight, "D-1")
	rdb.ZAdd(ctx, keys.Dead, redisZ("D-1", float64(time.Now().UnixMilli())))
	rdb.HSet(ctx, keys.DeadInfo, "D-1", "failed|1|0|boom")
	if n, err := d.Load(ctx); err != nil || n != 1 {
		t.Fatalf("load: %d %v, want the requeued row back in Redis", n, err)
	}
	// Second round: it fails again, and is requeued in the same window.
	failLeased()
	var before Row
	if err := db.Get(&before, `SELECT id, due_at, payload, state, attempts, version FROM orderdelay_tasks WHERE queue = 'dq' AND id = 'D-1'`); err != nil || before.State != StateFailed {
		t.Fatalf("row before: %+v %v, want FAILED", before, err)
	}

	res, err := r.Requeue(ctx, []string{"D-1"})
	if err != nil {
		t.Fatal(err)
	}
	var after Row
	if err := db.Get(&after, `SELECT id, due_at, payload, state, attempts, version FROM orderdelay_tasks WHERE queue = 'dq' AND id = 'D-1'`); err != nil {
		t.Fatal(err)
	}
	t.Logf("requeue %+v; row %s v%d -> %s v%d", res, before.State, before.Version, after.State, after.Version)
	if len(res.Skipped) == 1 && res.Skipped[0].Why == WhyLive {
		if after.State != before.State || after.Version != before.Version {
			t.Errorf("requeue answered %q but moved the row from %s v%d to %s v%d",
				WhyLive, before.State, before.Version, after.State, after.Version)
		}
	} else if res.Requeued != 1 || after.State != StateScheduled {
		t.Errorf("requeue %+v, row %s: want either skipped as live with the row untouched, or requeued", res, after.State)
	}
}
