package main

import (
	"context"

	"github.com/orderdelay/orderdelay/internal/preflight"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// checkRedisUser is the Redis user's start-up check (see
// preflight.Permissions) on the keys of the order queue, its shards and
// the task queues that the configuration has it use — and of a task queue the queues file gives a key of
// its own, the meta hash and name mark at its name's default key, which
// the meta keeper reads and clears: it waits until Redis answers, and a
// command the daemon needs that is refused ends the start (exit 2) before
// anything has written to Redis.
func (d *daemon) checkRedisUser(ctx context.Context) error {
	qs := preflight.Queues{Orders: d.keys, CloseEvents: d.cfg.CloseEvents}
	if d.tasks != nil {
		for _, q := range taskQueueKeys(d.tasks) {
			qs.Tasks = append(qs.Tasks, q.Keys)
			if def := queue.NewKeys(queue.TaskQueueKey(q.Name)); def.Queue != q.Keys.Queue {
				qs.Defaults = append(qs.Defaults, def)
			}
		}
	}
	return preflight.WatchPermissions(ctx, d.rdb, qs, d.m, d.log)
}
