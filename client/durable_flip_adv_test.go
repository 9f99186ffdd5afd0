package client_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// flipAfterFirst runs a pipeline's first command, then marks the queue
// durable (as a daemon of a new file does during a rolling update), then
// the rest: the batch meets the change part way.
type flipAfterFirst struct {
	rdb  *redis.Client
	meta string
	done bool
}

func (h *flipAfterFirst) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *flipAfterFirst) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return next
}
func (h *flipAfterFirst) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.done || len(cmds) < 2 || cmds[0].Name() != "evalsha" { // not the batch (e.g. the connection's setup)
			return next(ctx, cmds)
		}
		h.done = true
		if err := next(ctx, cmds[:1]); err != nil {
			return err
		}
		if err := h.rdb.HSet(ctx, h.meta, queue.MetaDurable, "1").Err(); err != nil {
			return err
		}
		return next(ctx, cmds[1:])
	}
}

// A batch that meets the queue turning durable part way has written the
// items before the change (to Redis only: the executor drops them, as
// they have no row). The error must say so, naming them, rather than
// read as "nothing was written" (what a durable refusal means).
func TestPutTasksNamesItemsWrittenBeforeTheQueueTurnedDurable(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	ctx := context.Background()
	other := redis.NewClient(rdb.Options())
	defer other.Close()
	other.AddHook(&flipAfterFirst{rdb: rdb, meta: keys.Meta})
	c, err := client.New(other, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	due := time.Now().Add(time.Minute)
	items := []client.TaskItem{
		{ID: "f-0", Payload: json.RawMessage(`{}`), Deadline: due},
		{ID: "f-1", Payload: json.RawMessage(`{}`), Deadline: due},
	}
	res, err := c.PutTasks(ctx, items, client.Create)
	if !errors.Is(err, client.ErrDurableQueue) {
		t.Fatalf("PutTasks: %v, want ErrDurableQueue", err)
	}
	if n, _ := rdb.ZCard(ctx, keys.Queue).Result(); n != 1 || res[0] != client.Created {
		t.Fatalf("the flip did not land between the items: %d queued, results %v", n, res)
	}
	if !strings.Contains(err.Error(), "[0]") {
		t.Fatalf("the error does not name item 0, written before the queue turned durable: %v", err)
	}
}
