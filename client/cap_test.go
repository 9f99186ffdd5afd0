package client_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// A put of a new task on a queue that holds its max_pending pending tasks
// (the daemon writes the cap into the queue's meta hash) is refused with a
// *QueueFullError naming the queue and the cap, and writes nothing; an
// idempotent re-put or a reschedule of a task that exists is never refused.
func TestPutTaskRefusesANewTaskBeyondMaxPending(t *testing.T) {
	c, rdb, k := newClient(t)
	ctx := ctxT(t)
	due := time.Now().Add(time.Hour)
	// No meta (an older daemon): no cap.
	for _, id := range []string{"a", "b", "c"} {
		if _, _, err := c.PutTask(ctx, id, nil, due, client.Create); err != nil {
			t.Fatalf("PutTask %s without meta: %v", id, err)
		}
	}
	if err := rdb.HSet(ctx, k.Meta, queue.MetaDurable, "0", queue.MetaMaxPending, "3").Err(); err != nil {
		t.Fatal(err)
	}
	_, _, err := c.PutTask(ctx, "d", nil, due, client.Create)
	var full *client.QueueFullError
	if !errors.As(err, &full) || !errors.Is(err, client.ErrQueueFull) || full.MaxPending != 3 || full.Queue != k.Queue {
		t.Fatalf("fourth task with max_pending 3: %v; want a QueueFullError for %s, 3", err, k.Queue)
	}
	if !strings.Contains(err.Error(), k.Queue) || !strings.Contains(err.Error(), "3") {
		t.Errorf("error %q does not name the queue and the cap", err)
	}
	if _, err := rdb.ZScore(ctx, k.Queue, "d").Result(); err == nil {
		t.Errorf("the refused task is in the queue")
	}
	if ok, _ := rdb.HExists(ctx, k.Payload, "d").Result(); ok {
		t.Errorf("the refused task's payload was written")
	}
	if res, _, err := c.PutTask(ctx, "a", nil, due.Add(time.Minute), client.Create); err != nil || res != client.Unchanged {
		t.Errorf("idempotent re-put of a at the cap: %v, %v; want unchanged, no error", res, err)
	}
	if res, _, err := c.PutTask(ctx, "b", nil, due.Add(time.Minute), client.Reschedule); err != nil || res != client.Moved {
		t.Errorf("reschedule of b at the cap: %v, %v; want moved, no error", res, err)
	}
	if res, _, err := c.PutTask(ctx, "c", nil, due.Add(time.Hour), client.OnlyLater); err != nil || res != client.Moved {
		t.Errorf("only-later of c at the cap: %v, %v; want moved, no error", res, err)
	}
	// Room again once one leaves.
	if _, err := c.DeleteTasks(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if res, _, err := c.PutTask(ctx, "d", nil, due, client.Create); err != nil || res != client.Created {
		t.Errorf("put after one left: %v, %v; want created", res, err)
	}
}

// A batch that straddles the cap: items go in order, each on its own; the
// new items that still find room are created, the new items after the
// queue is full are refused (Result Unchanged, nothing written, their
// indexes in QueueFullError.Refused), and items that exist are written
// whatever the count.
func TestPutTasksStraddlingMaxPending(t *testing.T) {
	c, rdb, k := newClient(t)
	ctx := ctxT(t)
	due := time.Now().Add(time.Hour)
	if err := rdb.HSet(ctx, k.Meta, queue.MetaMaxPending, "5").Err(); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b", "c"} {
		if _, _, err := c.PutTask(ctx, id, nil, due, client.Create); err != nil {
			t.Fatal(err)
		}
	}
	later := due.Add(time.Minute)
	items := []client.TaskItem{
		{ID: "x", Deadline: due},   // new: 4th
		{ID: "a", Deadline: later}, // exists: moved
		{ID: "y", Deadline: due},   // new: 5th
		{ID: "z", Deadline: due},   // new: refused
		{ID: "b", Deadline: later}, // exists: moved, though the queue is full
		{ID: "w", Deadline: due},   // new: refused
	}
	res, err := c.PutTasks(ctx, items, client.Reschedule)
	var full *client.QueueFullError
	if !errors.As(err, &full) || full.MaxPending != 5 {
		t.Fatalf("PutTasks straddling the cap: %v; want a QueueFullError with max_pending 5", err)
	}
	if want := []int{3, 5}; !reflect.DeepEqual(full.Refused, want) {
		t.Errorf("refused items %v, want %v", full.Refused, want)
	}
	want := []client.Result{client.Created, client.Moved, client.Created, client.Unchanged, client.Moved, client.Unchanged}
	if !reflect.DeepEqual(res, want) {
		t.Errorf("results %v, want %v", res, want)
	}
	got, err := rdb.ZRangeWithScores(ctx, k.Queue, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	members := map[string]float64{}
	for _, z := range got {
		members[z.Member.(string)] = z.Score
	}
	if len(members) != 5 || members["z"] != 0 || members["w"] != 0 {
		t.Errorf("queue holds %v; want a, b, c, x, y", members)
	}
	if members["a"] != float64(queue.DeadlineMillis(later)) || members["b"] != float64(queue.DeadlineMillis(later)) {
		t.Errorf("existing items not moved at the cap: %v", members)
	}
	// The whole batch retried (Create): written items are unchanged, the
	// refused ones refused again; nothing is duplicated or lost.
	res, err = c.PutTasks(ctx, items, client.Create)
	if !errors.As(err, &full) || !reflect.DeepEqual(full.Refused, []int{3, 5}) {
		t.Errorf("retried batch: %v; want items 3 and 5 refused again", err)
	}
	for i, r := range res {
		if r != client.Unchanged {
			t.Errorf("retried item %d: %v, want unchanged", i, r)
		}
	}
}
