package client_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// snapshot returns every key of the queue with a dump of its value, so a
// test can show that a refused call changed nothing at all.
func snapshot(t *testing.T, rdb *redis.Client, k queue.Keys) map[string]string {
	t.Helper()
	ctx := ctxT(t)
	out := map[string]string{}
	for _, key := range []string{k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Dead, k.DeadInfo, k.Payload, k.Meta,
		k.Ready, k.Processing, k.Unacked, k.Taken, k.Deliveries} {
		v, err := rdb.Dump(ctx, key).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		out[key] = v
	}
	return out
}

// A durable queue's tasks live in PostgreSQL, which the client cannot
// reach: PutTask, PutTasks and DeleteTasks refuse it with ErrDurableQueue,
// naming the queue and the way that works, and change nothing in Redis.
// Before, PutTask said "created" for a task that had no row and so never
// ran, and DeleteTasks removed an entry the loader then put back.
func TestClientRefusesADurableQueue(t *testing.T) {
	c, rdb, k := newClient(t)
	ctx := ctxT(t)
	due := time.Now().Add(time.Hour)
	// A task put while the queue was not durable (meta absent: an older
	// daemon, or none started yet) goes in as before.
	if res, _, err := c.PutTask(ctx, "old", json.RawMessage(`{"n":1}`), due, client.Create); err != nil || res != client.Created {
		t.Fatalf("PutTask without meta: %v, %v; want created", res, err)
	}
	if err := rdb.HSet(ctx, k.Meta, queue.MetaDurable, "1").Err(); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, rdb, k)
	check := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, client.ErrDurableQueue) {
			t.Errorf("%s on a durable queue: %v; want ErrDurableQueue", what, err)
			return
		}
		if !strings.Contains(err.Error(), k.Queue) || !strings.Contains(err.Error(), "HTTP API") {
			t.Errorf("%s: %q does not name the queue and the HTTP API", what, err)
		}
	}
	_, _, err := c.PutTask(ctx, "new", nil, due, client.Create)
	check("PutTask (new)", err)
	_, _, err = c.PutTask(ctx, "old", nil, due.Add(time.Minute), client.Reschedule)
	check("PutTask (reschedule)", err)
	_, err = c.PutTasks(ctx, []client.TaskItem{{ID: "b1", Deadline: due}, {ID: "old", Deadline: due}}, client.Create)
	check("PutTasks", err)
	_, err = c.DeleteTasks(ctx, "old", "new")
	check("DeleteTasks", err)
	after := snapshot(t, rdb, k)
	if len(after) != len(before) {
		t.Errorf("keys before %v, after %v", len(before), len(after))
	}
	for key, v := range before {
		if after[key] != v {
			t.Errorf("%s changed although every call was refused", key)
		}
	}
	// Reading is harmless: GetTask still shows the Redis tier.
	if _, err := c.GetTask(ctx, "old"); err != nil {
		t.Errorf("GetTask on a durable queue: %v", err)
	}
	// A queue switched back to not durable (the daemon rewrites its meta
	// at start) takes writes again.
	if err := rdb.HSet(ctx, k.Meta, queue.MetaDurable, "0").Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := c.DeleteTasks(ctx, "old"); err != nil || n != 1 {
		t.Errorf("DeleteTasks once no longer durable: %d, %v", n, err)
	}
}
