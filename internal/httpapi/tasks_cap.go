package httpapi

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// writeQueueFull answers a put refused by the queue's max_pending cap:
// 507 Insufficient Storage, with the queue and the cap. Not 429: nothing
// about the caller's rate is wrong and slowing down does not help; the
// queue has no room until its consumers drain it (or the cap is raised),
// which is what 507 ("unable to store the representation needed to
// complete the request", RFC 4918) says. Nothing was written.
func writeQueueFull(w http.ResponseWriter, err error, q *tasks.Runtime) bool {
	var full *client.QueueFullError
	if !errors.As(err, &full) {
		return false
	}
	writeProblem(w, http.StatusInsufficientStorage, ProblemQueueFull,
		"queue "+q.Config.Name+" is full: it holds its max_pending of pending tasks; retry once it drains",
		map[string]any{"queue": q.Config.Name, "max_pending": full.MaxPending})
	return true
}

// refusedItems returns the indexes of a batch's items that PutTasks refused
// because the queue filled up part way (err is a *client.QueueFullError),
// or nil for any other err.
func refusedItems(err error) map[int]bool {
	var full *client.QueueFullError
	if !errors.As(err, &full) {
		return nil
	}
	m := make(map[int]bool, len(full.Refused))
	for _, i := range full.Refused {
		m[i] = true
	}
	return m
}

// writeBatchFull answers a batch create that found the queue full part
// way: 507, with every task's result in order. Tasks before the queue
// filled up, and tasks that already existed, were written ("created",
// "exists"); new tasks after it filled up were not ("refused"). Retrying
// the whole batch is safe for tasks with ids: the written ones answer
// "exists".
func writeBatchFull(w http.ResponseWriter, err error, q *tasks.Runtime, out []batchItemResult) bool {
	var full *client.QueueFullError
	if !errors.As(err, &full) {
		return false
	}
	results := make([]any, len(out))
	for i, r := range out {
		results[i] = r
		if r.Result == "refused" { // no deadline: nothing was written
			results[i] = map[string]any{"index": r.Index, "id": r.ID, "result": r.Result}
		}
	}
	writeProblem(w, http.StatusInsufficientStorage, ProblemQueueFull,
		fmt.Sprintf("queue %s is full: it holds its max_pending of %d pending tasks; %d of %d tasks refused, the others written",
			q.Config.Name, full.MaxPending, len(full.Refused), len(out)),
		map[string]any{"queue": q.Config.Name, "max_pending": full.MaxPending, "tasks": results})
	return true
}
