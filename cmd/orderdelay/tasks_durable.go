package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// taskTarget is the queue `orderdelay task` works on: through the public
// client, or, for a durable queue, through its durable tier (PostgreSQL
// first, then Redis), exactly as the HTTP API does.
type taskTarget struct {
	cl      *client.Client
	durable *tasks.Durable // nil unless the queue is durable
}

func (t taskTarget) put(ctx context.Context, id string, payload json.RawMessage, due time.Time, mode client.Mode) (client.Result, time.Time, error) {
	if t.durable != nil {
		return t.durable.Put(ctx, id, payload, due, mode)
	}
	return t.cl.PutTask(ctx, id, payload, due, mode)
}

// get returns what to print: a durable queue's row, or the Redis task.
func (t taskTarget) get(ctx context.Context, id string) (any, error) {
	if t.durable != nil {
		return t.durable.Get(ctx, id)
	}
	return t.cl.GetTask(ctx, id)
}

// delete removes the tasks (cancels them on a durable queue) and returns
// how many there were to remove.
func (t taskTarget) delete(ctx context.Context, ids []string) (int, error) {
	if t.durable == nil {
		return t.cl.DeleteTasks(ctx, ids...)
	}
	n := 0
	for _, id := range ids {
		switch err := t.durable.Cancel(ctx, id); {
		case err == nil:
			n++
		case !errors.Is(err, tasks.ErrNotScheduled):
			return n, err
		}
	}
	return n, nil
}

// durableTier opens the durable tier of q: the database from the
// configuration (ORDERDELAY_DATABASE_URL), two connections at most. Its
// warnings (Redis could not follow; the loader catches up) go to stderr.
func durableTier(cfg config.Config, q tasks.Queue, rdb redis.UniversalClient, stderr io.Writer) (*tasks.Durable, func(), error) {
	db, err := openDB(cfg, orders.PoolOptions{MaxConns: 2})
	if err != nil {
		return nil, nil, err
	}
	d, err := tasks.NewDurable(db, q, rdb, newLogger(cfg, stderr))
	if err != nil {
		db.Close()
		return nil, nil, usageError{err}
	}
	return d, func() { db.Close() }, nil
}
