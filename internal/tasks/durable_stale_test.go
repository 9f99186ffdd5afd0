package tasks

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
)

// A loader that read a row just before a reschedule moved it out of the
// window can add the task to Redis with its old due time after the
// reschedule removed it from there. When that stale entry comes due, the
// executor must not run the task early: the row says it is due later. It
// is dropped from Redis; the loader adds it again when its window opens.
func TestDurableExecutorSkipsAStaleEarlierEntry(t *testing.T) {
	t.Parallel()
	d, _ := newTestDurable(t)
	ctx := context.Background()
	old := time.Now().Add(time.Second)
	if _, _, err := d.Put(ctx, "t-1", nil, old, client.Create); err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Hour)
	if _, _, err := d.Put(ctx, "t-1", nil, later, client.Reschedule); err != nil {
		t.Fatal(err)
	}
	// The stale loader's write, after the reschedule's delete.
	if _, err := d.Client.PutTasks(ctx, []client.TaskItem{{ID: "t-1", Deadline: old}}, client.Create); err != nil {
		t.Fatal(err)
	}
	ran := 0
	exec := d.Executor(func(ctx context.Context, ts []consumer.Task) []error { ran += len(ts); return make([]error, len(ts)) }, 3)
	errs := exec(ctx, []consumer.Task{{ID: "t-1", Deadline: redisDeadline(old)}})
	if ran != 0 {
		t.Errorf("a task rescheduled an hour later ran at its old due time")
	}
	if errs[0] != nil {
		t.Errorf("stale entry: %v; want it dropped (nil)", errs[0])
	}
	row, err := d.Get(ctx, "t-1")
	if err != nil || row.State != StateScheduled || row.Version != 2 {
		t.Errorf("row %+v, %v; want SCHEDULED at version 2, untouched", row, err)
	}
}

// A task in Redis without a row (written past the durable tier: a raw
// ZADD, an older client) is not run, and the daemon's log says why.
func TestDurableExecutorReportsATaskWithoutARow(t *testing.T) {
	t.Parallel()
	d, logs := newTestDurable(t)
	ran := 0
	exec := d.Executor(func(ctx context.Context, ts []consumer.Task) []error { ran += len(ts); return make([]error, len(ts)) }, 3)
	errs := exec(context.Background(), []consumer.Task{{ID: "ghost", Deadline: time.Now()}})
	if ran != 0 || errs[0] != nil {
		t.Errorf("a task without a row: ran %d times, error %v; want not run, dropped", ran, errs[0])
	}
	if n := logs.FilterMessageSnippet("has no row").FilterField(zap.String("id", "ghost")).Len(); n != 1 {
		t.Errorf("%d warnings about the task without a row, want 1", n)
	}
}
