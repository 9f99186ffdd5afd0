package main

import (
	"context"

	"github.com/orderdelay/orderdelay/internal/preflight"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// checkRedisUser is the Redis user's start-up check (see
// preflight.Permissions) on every key of the order queue, its shards and
// the task queues — and of a task queue the queues file gives a key of
// its own, the meta hash and name mark at its name's default key, which
// the meta keeper reads and clears: it waits until Redis answers, and a
// command the daemon needs that is refused ends the start (exit 2) before
// anything has written to Redis.
func (d *daemon) checkRedisUser(ctx context.Context) error {
	keys := append([]queue.Keys(nil), d.keys...)
	var defaults []queue.Keys
	if d.tasks != nil {
		for _, q := range taskQueueKeys(d.tasks) {
			keys = append(keys, q.Keys)
			if def := queue.NewKeys(queue.TaskQueueKey(q.Name)); def.Queue != q.Keys.Queue {
				defaults = append(defaults, def)
			}
		}
	}
	return preflight.WatchPermissions(ctx, d.rdb, keys, defaults, d.m, d.log)
}
