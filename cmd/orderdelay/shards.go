package main

import (
	"context"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Sharded order queue (ORDERDELAY_QUEUE_SHARDS > 1, docs/scaling.md): the
// daemon serves the queue key and every shard key (consumer.Group), and
// everything that writes or reads the order queue — the API, the CLI, the
// admin tools, the gauges and the reconciler — covers all of them. With
// one shard (the default) each of these is exactly the unsharded code path.

// shardOpts are the client options of the configured order queue.
func shardOpts(cfg config.Config) []client.Option {
	if cfg.QueueShards <= 1 {
		return nil
	}
	return []client.Option{client.WithShards(cfg.QueueShards)}
}

// queueKeys returns the keys of every sorted set of the order queue: the
// queue key, then shards 0 to ORDERDELAY_QUEUE_SHARDS-1.
func queueKeys(cfg config.Config) []queue.Keys {
	return append([]queue.Keys{queue.NewKeys(cfg.QueueKey)}, queue.ShardKeys(cfg.QueueKey, cfg.QueueShards)...)
}

// shardJSON is one key of a sharded queue in `inspect --json`.
type shardJSON struct {
	Shard                int     `json:"shard"` // -1: the queue key itself
	Key                  string  `json:"key"`
	Slot                 uint16  `json:"slot"` // Redis Cluster hash slot (CLUSTER KEYSLOT)
	Depth                int64   `json:"depth"`
	Overdue              int64   `json:"overdue"`
	OldestOverdueSeconds float64 `json:"oldest_overdue_seconds"`
	DeadLetters          int64   `json:"dead_letters"`
}

// readQueueStats reads the order queue's gauges summed over its keys and,
// when it is sharded, each key's own.
func readQueueStats(ctx context.Context, rdb redis.UniversalClient, cfg config.Config) (queue.Stats, []shardJSON, error) {
	keys := queueKeys(cfg)
	if len(keys) == 1 {
		s, err := queue.ReadStats(ctx, rdb, keys[0])
		return s, nil, err
	}
	sum, each, err := consumer.ReadStatsAll(ctx, rdb, keys)
	if err != nil {
		return sum, nil, err
	}
	out := make([]shardJSON, len(keys))
	for i, k := range keys {
		out[i] = shardJSON{Shard: i - 1, Key: k.Queue, Slot: queue.HashSlot(k.Queue), Depth: each[i].Depth,
			Overdue: each[i].Overdue, OldestOverdueSeconds: each[i].OldestDue.Seconds(), DeadLetters: each[i].DeadLetters}
	}
	return sum, out, nil
}
