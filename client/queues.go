package client

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// TaskKeyPrefix starts the key of every task queue whose entry in the
// queues file names no key of its own: queue "callrecord" lives at
// "delaytask:callrecord".
const TaskKeyPrefix = "delaytask:"

// TaskQueueKey is the default key of the task queue named name.
func TaskQueueKey(name string) string { return TaskKeyPrefix + name }

// ErrUnknownQueue: no daemon serves a task queue of that name at its
// default key.
var ErrUnknownQueue = errors.New("unknown task queue")

// ForQueue returns a client of the task queue named name (as in the
// queues file and the HTTP API), at its default key TaskQueueKey(name).
//
// It writes nowhere a daemon does not serve: a daemon running the queues
// file marks each queue that uses the default key (the string
// "{delaytask:<name>}:name" holding the name, set at start and every
// minute) and removes that mark for a queue declared with a key of its
// own or durable. Without the mark ForQueue returns ErrUnknownQueue: the
// queue is not in the file, is declared with another key (use New with
// that key), is durable (its tasks are rows in PostgreSQL, which this
// client does not write: use the HTTP API or the CLI), or no daemon with
// it has started yet. A queue later removed from the
// file keeps its mark until someone deletes it.
func ForQueue(ctx context.Context, rdb redis.UniversalClient, name string, opts ...Option) (*Client, error) {
	if !queue.ValidQueueName(name) {
		return nil, fmt.Errorf("%w: name %q: want 1-64 of a-z, 0-9, _ and -", ErrUnknownQueue, name)
	}
	key := TaskQueueKey(name)
	c, err := New(rdb, key, opts...)
	if err != nil {
		return nil, err
	}
	got, err := rdb.Get(ctx, c.keys.Name).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("queue %q: %w", name, err)
	}
	if got != name {
		return nil, fmt.Errorf("%w: %q: no daemon serves it at %s (not in the queues file, declared with a key of its own "+
			"— then use client.New with that key —, durable — then produce through the HTTP API or the CLI — "+
			"or no daemon with it has started)", ErrUnknownQueue, name, key)
	}
	return c, nil
}
