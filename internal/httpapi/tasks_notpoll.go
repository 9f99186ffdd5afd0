package httpapi

import (
	"net/http"

	"github.com/orderdelay/orderdelay/internal/tasks"
)

// refuseNotPolled answers a poll or an ack of a queue whose action is not
// poll: the request is well-formed, the queue's configuration conflicts
// with it, so both answer 409 with the same error.
func refuseNotPolled(w http.ResponseWriter, q *tasks.Runtime) {
	writeProblem(w, http.StatusConflict, ProblemNotPolled, "queue "+q.Config.Name+" is served by its "+q.Config.Action.Type+
		" action, not polled: only poll queues are polled and take acks", map[string]any{"queue": q.Config.Name})
}
