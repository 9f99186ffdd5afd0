package client

import (
	"context"
	"fmt"

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
	serials := make([]string, len(items))
	for i, it := range items {
		serials[i] = it.Serial
	}
	cur, found, err := c.st.Deadlines(ctx, serials)
	if err != nil {
		return fmt.Errorf("look in %s: %w", c.keys.Queue, err)
	}
	for i, it := range items {
		if !found[i] {
			continue // nothing to adopt (or a damaged record: the daemon dead-letters it)
		}
		k := c.keysFor(it.Serial)
		if _, err := queue.NewStore(c.rdb, k).Enqueue(ctx, queue.ModeAdopt, []queue.EnqueueItem{{Serial: it.Serial, Deadline: cur[i]}}); err != nil {
			return fmt.Errorf("move %q to %s: %w", it.Serial, k.Queue, err)
		}
		if _, err := c.cancel(ctx, c.keys, it.Serial); err != nil {
			return fmt.Errorf("move %q to %s: %w", it.Serial, k.Queue, err)
		}
	}
	return nil
}
