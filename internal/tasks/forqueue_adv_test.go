package tasks

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A durable queue's tasks are rows in PostgreSQL; the Go client writes
// Redis only, and the executor drops a task without a SCHEDULED row unrun.
// client.ForQueue found a durable queue at its default key all the same
// (the daemon marked it), so a task put through it answered created and
// never ran. ForQueue must refuse a durable queue, as it refuses one with
// a key of its own, and the daemon must take back a mark an earlier
// configuration (the queue not yet durable) left.
func TestForQueueRefusesADurableQueue(t *testing.T) {
	t.Parallel()
	rdb, keys := testenv.Redis(t)
	ctx := context.Background()
	suffix := strings.TrimPrefix(strings.TrimSuffix(keys.Queue, ":order"), "test:")
	name := "durable-" + suffix
	testenv.CheckNoKeysLeft(t, rdb, "*"+client.TaskQueueKey(name)+"*")
	t.Cleanup(func() { testenv.DeleteQueue(rdb, queue.NewKeys(client.TaskQueueKey(name))) })
	// An earlier configuration served it, not durable, at its default key.
	if err := rdb.HSet(ctx, queue.NewKeys(client.TaskQueueKey(name)).Meta, queue.MetaName, name, queue.MetaDurable, "0").Err(); err != nil {
		t.Fatal(err)
	}
	f, err := Parse([]byte(fmt.Sprintf(`queues:
  - {name: %s, durable: true, window: 5m, action: {type: sql, statement: "SELECT unnest($1::text[])"}}
`, name)))
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteMeta(ctx, rdb, f); err != nil {
		t.Fatal(err)
	}
	_, err = client.ForQueue(ctx, rdb, name)
	if !errors.Is(err, client.ErrUnknownQueue) || !errors.Is(err, client.ErrDurableQueue) {
		t.Errorf("ForQueue of a durable queue: %v, want ErrUnknownQueue and ErrDurableQueue (its tasks written to Redis alone are dropped unrun)", err)
	}

}
