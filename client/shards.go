package client

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// WithShards spreads order timeouts over n shard keys, as a daemon with
// ORDERDELAY_QUEUE_SHARDS=n serves them: each serial goes to shard
// CRC-32(serial) mod n (see docs/scaling.md, "Sharded queues"). 1, the
// default, writes the queue key only; New refuses n outside 1..1024.
//
// A sharded client also finds entries in the queue key itself, where they
// are from before the switch to shards or from producers that ignore
// sharding: Get looks there when the shard has none, Cancel removes from
// both, and a Reschedule or OnlyLater write first moves such an entry into
// its shard (with its deadline), so the new deadline is the one that
// counts. A Create does not look there (it would cost every enqueue a round
// trip): an order created in the queue key before the switch and created
// again in its shard afterwards has two entries, closes at the first
// deadline, and its second entry is removed as settled.
//
// Task methods (PutTask and the rest) always use the queue key: task queues
// are not sharded.
func WithShards(n int) Option { return func(c *Client) { c.shards = n } }

// Shards is the number of shards the client writes to (1: not sharded).
func (c *Client) Shards() int { return c.shards }

// AllKeys returns the keys of every sorted set of the logical queue: the
// queue key first, then shards 0 to Shards()-1.
func (c *Client) AllKeys() []Keys {
	return append([]Keys{c.keys}, c.shard...)
}

// keysFor returns the keys of the queue serial is written to.
func (c *Client) keysFor(serial string) queue.Keys {
	if c.shards <= 1 {
		return c.keys
	}
	return c.shard[queue.ShardOf(serial, c.shards)]
}

// adopt moves the entries items have in the queue key (queued, leased or
// backing off) into their shards with their current deadlines: first the
// shard gets it (if it has no entry of its own), then the queue key's
// entry and lease record are removed. In between both hold it, which is
// harmless (the close statement decides); the reverse order could lose it.
//
// The move publishes no wake-up: it is the first half of a reschedule, and
// waking the shard's scanner for the deadline being replaced, before the
// new one has landed, sends it after a deadline that no longer holds. The
// reschedule's own write publishes the new deadline when it is earlier than
// the shard's head; if that write fails, the entry keeps its old deadline
// in the shard and the head check finds it as it would in the queue key.
func (c *Client) adopt(ctx context.Context, items []Item) error {
	base := c.keys
	scores := make([]*redis.FloatCmd, len(items))
	leases := make([]*redis.StringCmd, len(items))
	_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, it := range items {
			scores[i] = p.ZScore(ctx, base.Queue, it.Serial)
			leases[i] = p.HGet(ctx, base.Lease, it.Serial)
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("look in %s: %w", base.Queue, err)
	}
	for i, it := range items {
		var cur int64
		switch score, err := scores[i].Result(); {
		case err == nil:
			cur = int64(score)
		case !errors.Is(err, redis.Nil):
			return fmt.Errorf("look in %s: %w", base.Queue, err)
		default:
			rec, err := leases[i].Result()
			if errors.Is(err, redis.Nil) {
				continue // nothing to adopt
			}
			if err != nil {
				return fmt.Errorf("look in %s: %w", base.Queue, err)
			}
			d, _, _ := strings.Cut(rec, "|")
			if cur, err = strconv.ParseInt(d, 10, 64); err != nil {
				continue // a damaged record: the daemon dead-letters it
			}
		}
		k := c.keysFor(it.Serial)
		if err := enqueueScript.Run(ctx, c.rdb, []string{k.Queue, k.Lease, k.Inflight, k.Deadlines, k.Wake, k.Leases, k.LeaseBatch},
			"adopt", it.Serial, cur).Err(); err != nil {
			return fmt.Errorf("move %q to %s: %w", it.Serial, k.Queue, err)
		}
		if _, err := c.cancel(ctx, base, it.Serial); err != nil {
			return fmt.Errorf("move %q to %s: %w", it.Serial, k.Queue, err)
		}
	}
	return nil
}
