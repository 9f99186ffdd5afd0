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
const TaskKeyPrefix = queue.TaskKeyPrefix

// TaskQueueKey is the default key of the task queue named name.
func TaskQueueKey(name string) string { return queue.TaskQueueKey(name) }

// ErrUnknownQueue: no daemon serves a task queue of that name at its
// default key.
var ErrUnknownQueue = errors.New("unknown task queue")

// ForQueue returns a client of the task queue named name (as in the
// queues file and the HTTP API), at its default key TaskQueueKey(name).
//
// It writes nowhere a daemon does not serve: a daemon running the queues
// file writes each queue's name into the queue's meta hash (field "name"
// of "{<key>}:meta", with "durable" and "max_pending"; at start and every
// 15-30 s), and removes the name from the meta hash at the default key of
// a queue declared with a key of its own. ForQueue reads the meta hash at
// "{delaytask:<name>}:meta" and returns ErrUnknownQueue unless it holds
// this name: the queue is not in the file, is declared with another key
// (use New with that key), or no daemon with it has started yet. A
// durable queue (its tasks are rows in PostgreSQL, which this client does
// not write: use the HTTP API or the CLI) returns an error that is both
// ErrUnknownQueue and ErrDurableQueue. A queue later removed from the
// file keeps its name until someone deletes its meta hash.
func ForQueue(ctx context.Context, rdb redis.UniversalClient, name string, opts ...Option) (*Client, error) {
	if !queue.ValidQueueName(name) {
		return nil, fmt.Errorf("%w: name %q: want 1-64 of a-z, 0-9, _ and -", ErrUnknownQueue, name)
	}
	key := TaskQueueKey(name)
	c, err := New(rdb, key, opts...)
	if err != nil {
		return nil, err
	}
	got, durable, err := c.st.MetaNameDurable(ctx)
	if err != nil {
		return nil, fmt.Errorf("queue %q: %w", name, err)
	}
	if got != name {
		return nil, fmt.Errorf("%w: %q: no daemon serves it at %s (not in the queues file, declared with a key of its own "+
			"— then use client.New with that key — or no daemon with it has started)", ErrUnknownQueue, name, key)
	}
	switch durable {
	case "0":
	case "1":
		return nil, fmt.Errorf("%w: %q: %w: its tasks are rows in PostgreSQL, which this client does not write; "+
			"produce through the HTTP API or the CLI", ErrUnknownQueue, name, ErrDurableQueue)
	default:
		return nil, fmt.Errorf("%w: %q: %s holds durable %q, want 0 or 1", ErrUnknownQueue, name, c.keys.Meta, durable)
	}
	return c, nil
}
