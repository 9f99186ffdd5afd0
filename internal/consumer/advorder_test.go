package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// A contended row sends its batch down the order-by-order path (oneByOne,
// new with the task-queue work). Every order of that walk is still closed
// under its own fence: one a raw producer rescheduled an hour ahead during
// the lease, one the client rescheduled, and one paid meanwhile all stay
// open, with the producers' entries queued at their deadlines; the others
// close; the contended row backs off with no attempt spent.
func TestOrderByOrderWalkKeepsEveryFence(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("walk", 10, past)
	e.Enqueue(serials, past)
	bad, raw, api, paid := serials[0], serials[3], serials[5], serials[8]
	e.FailClose(bad, "40001")
	c := e.consumer(Config{BatchSize: 10, Lease: 30 * time.Second})
	c.stopping = make(chan struct{})
	res := claimN(t, c, 10)
	later := e.RedisNow().Add(time.Hour)
	e.Enqueue([]string{raw}, later)
	if _, _, err := e.cl.Enqueue(ctx, api, later, client.Reschedule); err != nil {
		t.Fatal(err)
	}
	if _, err := e.DB.Exec("UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1", paid); err != nil {
		t.Fatal(err)
	}
	c.process(ctx, res.items)
	for _, s := range serials {
		want := "closed"
		switch s {
		case bad, raw, api:
			want = "pending"
		case paid:
			want = "paid"
		}
		if got := e.Status(s); got != want {
			t.Errorf("%s: %s, want %s", s, got, want)
		}
	}
	for _, s := range []string{raw, api} {
		got, err := e.cl.Get(ctx, s)
		if err != nil || got.State != client.StateQueued || got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
			t.Errorf("%s: entry %+v (%v), want queued at the producer's deadline", s, got, err)
		}
	}
	got, err := e.cl.Get(ctx, bad)
	if err != nil || got.State != client.StateBackoff || got.Attempts != 0 {
		t.Errorf("the contended order: %+v (%v), want backoff with 0 attempts", got, err)
	}
}
