package main

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// taskStore is where `orderdelay task put|get|delete` write and read: the
// queue's Redis keys, or for a durable queue its PostgreSQL tier first, as
// the HTTP API does. Writing only Redis for a durable queue would lose the
// task: its executor drops a task without a SCHEDULED row unrun, and the
// loader brings back a row whose Redis entry was deleted.
type taskStore interface {
	PutTask(ctx context.Context, id string, payload json.RawMessage, deadline time.Time, mode client.Mode) (client.Result, time.Time, error)
	Get(ctx context.Context, id string) (any, error)
	DeleteTasks(ctx context.Context, ids ...string) (int, error)
}

type redisTasks struct{ *client.Client }

func (r redisTasks) Get(ctx context.Context, id string) (any, error) { return r.GetTask(ctx, id) }

type durableTasks struct{ d *tasks.Durable }

func (d durableTasks) PutTask(ctx context.Context, id string, payload json.RawMessage, deadline time.Time, mode client.Mode) (client.Result, time.Time, error) {
	return d.d.Put(ctx, id, payload, deadline, mode)
}

// Get returns the task's row (its state there, attempts and payload).
func (d durableTasks) Get(ctx context.Context, id string) (any, error) { return d.d.Get(ctx, id) }

// DeleteTasks cancels the scheduled tasks ids in both tiers and returns
// how many were scheduled.
func (d durableTasks) DeleteTasks(ctx context.Context, ids ...string) (int, error) {
	for _, id := range ids {
		if err := queue.ValidateSerial(id); err != nil {
			return 0, err
		}
	}
	n := 0
	for _, id := range ids {
		switch err := d.d.Cancel(ctx, id); {
		case errors.Is(err, tasks.ErrNotScheduled):
		case err != nil:
			return n, err
		default:
			n++
		}
	}
	return n, nil
}

// taskTarget returns the store of the named queue of the queues file.
func taskTarget(cfg config.Config, name string) (taskStore, func(), error) {
	f, err := loadQueues(cfg)
	if err != nil {
		return nil, nil, err
	}
	for _, q := range f.Queues {
		if q.Name == name && q.Durable {
			mgr, closeFn, err := taskManager(cfg)
			if err != nil {
				return nil, nil, err
			}
			r, _ := mgr.Queue(name)
			return durableTasks{r.Durable}, closeFn, nil
		}
	}
	cl, closeFn, err := taskClient(cfg, name)
	if err != nil {
		return nil, nil, err
	}
	return redisTasks{cl}, closeFn, nil
}
