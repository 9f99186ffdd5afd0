package e2e

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

func TestCloseEventsThroughTheOutbox(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	ctx := context.Background()
	// A close committed before a crash, whose event was never published.
	if _, err := w.db.Exec("INSERT INTO orderdelay_close_outbox (serial_no, reason) VALUES ('crashed-before-xadd', 'timeout')"); err != nil {
		t.Fatal(err)
	}
	past := time.Now().Add(-time.Second)
	serials := w.createOrders("ev", 300, past)
	w.zadd(serials, float64(queue.DeadlineMillis(past)))
	lost := w.createOrders("lost", 5, time.Now().Add(-time.Hour)) // the reconciler closes these
	d := w.start("ORDERDELAY_CLOSE_EVENTS=true", "ORDERDELAY_RECONCILE_INTERVAL=200ms",
		"ORDERDELAY_RECONCILE_GRACE=2m", "ORDERDELAY_LEASE=30s", "ORDERDELAY_STATEMENT_TIMEOUT=5s", "ORDERDELAY_DRAIN_TIMEOUT=5s")
	waitFor(t, "every close published", 30*time.Second, func() bool {
		n, _ := w.rdb.XLen(ctx, w.keys.Events).Result()
		return n == 306
	})
	// The relay deletes what it published in the transaction that locked
	// it, committed just after the XADD.
	waitFor(t, "the outbox emptied", 30*time.Second, func() bool {
		return w.count("SELECT count(*) FROM orderdelay_close_outbox") == 0
	})
	msgs, err := w.rdb.XRange(ctx, w.keys.Events, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	reasons := map[string]string{}
	for _, m := range msgs {
		reasons[m.Values["serial"].(string)] = m.Values["reason"].(string)
		if _, err := time.Parse(time.RFC3339Nano, m.Values["closed_at"].(string)); err != nil {
			t.Errorf("closed_at %v: %v", m.Values["closed_at"], err)
		}
	}
	if len(reasons) != 306 || reasons[serials[0]] != "timeout" || reasons[lost[0]] != "reconciled" || reasons["crashed-before-xadd"] != "timeout" {
		t.Errorf("events: %d distinct serials; %s=%q %s=%q", len(reasons), serials[0], reasons[serials[0]], lost[0], reasons[lost[0]])
	}
	if n := w.count("SELECT count(*) FROM orderdelay_close_outbox"); n != 0 {
		t.Errorf("%d events left in the outbox", n)
	}
	if v := d.metrics()["orderdelay_close_events_relayed_total"]; v != 306 {
		t.Errorf("close_events_relayed_total %v, want 306", v)
	}
	d.stop()
}

func TestRemindersFireBeforeTheDeadline(t *testing.T) {
	t.Parallel()
	tw := newTaskWorld(t, "queues:\n  - name: remind\n    key: PREFIX:remind\n    action: {type: stream}\n")
	d := tw.start("ORDERDELAY_REMINDER_QUEUE=remind", "ORDERDELAY_REMINDER_BEFORE=1s")
	ctx := context.Background()
	serials := tw.createOrders("rem", 2, time.Now().Add(2500*time.Millisecond))
	if code := d.call(http.MethodPut, "/v1/timeouts/"+serials[0], "", `{"after":"2500ms"}`, nil); code != http.StatusCreated {
		t.Fatalf("PUT: %d", code)
	}
	if code := d.call(http.MethodPut, "/v1/timeouts/"+serials[1], "", `{"after":"1h"}`, nil); code != http.StatusCreated {
		t.Fatalf("PUT: %d", code)
	}
	if code := d.call(http.MethodDelete, "/v1/timeouts/"+serials[1], "", "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE: %d", code)
	}
	stream := tw.keys("remind").Stream
	var msg redis.XMessage
	waitFor(t, "reminder published", 20*time.Second, func() bool {
		msgs, _ := tw.rdb.XRange(ctx, stream, "-", "+").Result()
		if len(msgs) > 0 {
			msg = msgs[0]
		}
		return len(msgs) > 0
	})
	remindedAt := time.Now()
	if !strings.Contains(msg.Values["payload"].(string), serials[0]) {
		t.Errorf("reminder payload %v", msg.Values)
	}
	waitFor(t, "order closed", 20*time.Second, func() bool { return tw.status(serials[0]) == "closed" })
	var closedAt time.Time
	if err := tw.db.Get(&closedAt, "SELECT closed_at FROM orders WHERE serial_no = $1", serials[0]); err != nil {
		t.Fatal(err)
	}
	if !remindedAt.Before(closedAt) {
		t.Errorf("reminded at %s, after the close at %s", remindedAt, closedAt)
	}
	if n, _ := tw.rdb.ZCard(ctx, tw.keys("remind").Queue).Result(); n != 0 {
		t.Errorf("%d reminders left: the cancelled order's reminder was not removed", n)
	}
	d.stop()
}

// The CLI's enqueue and cancel go through the same producer as the API:
// with a reminder queue configured they create and remove the reminder.
func TestCLIEnqueueAndCancelKeepTheReminder(t *testing.T) {
	t.Parallel()
	tw := newTaskWorld(t, "queues:\n  - name: remind\n    key: PREFIX:remind\n    action: {type: stream}\n")
	ctx := context.Background()
	flags := []string{"--queue-key", tw.world.keys.Queue, "--queues-file", tw.file,
		"--reminder-queue", "remind", "--reminder-before", "10m"}
	tw.cli(append([]string{"enqueue", "CLI-1", "--after", "1h"}, flags...)...)
	deadline, err := tw.rdb.ZScore(ctx, tw.world.keys.Queue, "CLI-1").Result()
	if err != nil {
		t.Fatalf("order entry: %v", err)
	}
	remind := tw.keys("remind")
	due, err := tw.rdb.ZScore(ctx, remind.Queue, "CLI-1").Result()
	if err != nil {
		t.Fatalf("no reminder after `orderdelay enqueue`: %v", err)
	}
	if want := deadline - float64((10 * time.Minute).Milliseconds()); due != want {
		t.Errorf("reminder due %v, want %v (10m before the deadline %v)", due, want, deadline)
	}
	tw.cli(append([]string{"cancel", "CLI-1"}, flags...)...)
	if n, _ := tw.rdb.ZCard(ctx, remind.Queue).Result(); n != 0 {
		t.Errorf("%d reminders left after `orderdelay cancel`", n)
	}
	if ok, _ := tw.rdb.HExists(ctx, remind.Payload, "CLI-1").Result(); ok {
		t.Errorf("the reminder's payload survived `orderdelay cancel`")
	}
}
