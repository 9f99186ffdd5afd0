package httpapi_test

import (
	"net/http"
	"strings"
	"testing"
)

// Polling and acking a queue whose action is not poll are the same
// mistake: a well-formed request the queue's configuration conflicts
// with. Both answer 409 with the same error, naming the action.
func TestPollAndAckOfANonPollQueueConflict(t *testing.T) {
	e := newPollAPI(t)
	p := e.poll(t, "confirm", 10)
	a := e.ack(t, "confirm", "poll."+strings.Repeat("A", 26), "c-1")
	if p.code != http.StatusConflict || a.code != http.StatusConflict {
		t.Errorf("poll %d %s, ack %d %s; want 409 for both", p.code, p.raw, a.code, a.raw)
	}
	want := "queue confirm is served by its sql action, not polled: only poll queues are polled and take acks"
	if p.Detail != want || a.Detail != want {
		t.Errorf("poll error %q, ack error %q; want both %q", p.Detail, a.Detail, want)
	}
}
