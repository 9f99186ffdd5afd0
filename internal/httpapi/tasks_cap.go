package httpapi

import (
	"errors"
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
	writeJSON(w, http.StatusInsufficientStorage, map[string]any{
		"error":       "queue " + q.Config.Name + " is full: it holds its max_pending of pending tasks; retry once it drains",
		"queue":       q.Config.Name,
		"max_pending": full.MaxPending,
	})
	return true
}
