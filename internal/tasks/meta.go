package tasks

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/durabletier"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// metaRefresh is how often a running daemon rewrites its queues' meta
// hashes, so a Redis that lost them (a restart without persistence, a
// failover to a replica that never had them) has them back within it.
const metaRefresh = 30 * time.Second

// WriteMeta writes the meta hash of every queue of f: what producers'
// scripts obey (queue.MetaDurable, queue.MetaMaxPending). Every field is
// written each time, so a queue switched from durable to not (or given a
// new cap) is seen as such from the daemon's next start. Replicas with
// different files (a rolling update) overwrite each other until the
// update completes.
func WriteMeta(ctx context.Context, rdb redis.UniversalClient, f File) error {
	for _, q := range f.Queues {
		durable := "0"
		if q.Durable {
			durable = "1"
		}
		k := queue.NewKeys(q.Key)
		if err := rdb.HSet(ctx, k.Meta, queue.MetaDurable, durable, queue.MetaMaxPending, strconv.FormatInt(int64(q.MaxPending), 10)).Err(); err != nil {
			return fmt.Errorf("queue %q: write meta: %w", q.Name, err)
		}
	}
	return nil
}

// KeepMeta writes the queues' meta hashes at once, retrying every second
// until Redis answers, then every metaRefresh (jittered), until ctx ends.
func (m *Manager) KeepMeta(ctx context.Context) {
	f := File{}
	for _, name := range m.order {
		f.Queues = append(f.Queues, m.queues[name].Config)
	}
	for {
		wait := metaRefresh/2 + time.Duration(rand.Int64N(int64(metaRefresh/2)))
		if err := WriteMeta(ctx, m.rdb, f); err != nil {
			if ctx.Err() != nil {
				return
			}
			m.log.Warn("task queues' meta not written; producers may not see durable queues and caps until it is", zap.Error(err))
			wait = time.Second
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// NewDurable returns the durable tier of queue q (q.Durable is true): its
// Redis writes go through a client that may write a durable queue (see
// internal/durabletier), unlike the public client's.
func NewDurable(db *sqlx.DB, q Queue, rdb redis.UniversalClient, log *zap.Logger) (*Durable, error) {
	cl, err := client.New(rdb, q.Key)
	if err != nil {
		return nil, fmt.Errorf("queue %q: %w", q.Name, err)
	}
	tier, ok := durabletier.Writer(cl).(*client.Client)
	if !ok {
		return nil, fmt.Errorf("queue %q: the durable tier's client is of type %T", q.Name, durabletier.Writer(cl))
	}
	return &Durable{DB: db, Queue: q.Name, Window: time.Duration(q.Window), Client: tier, Log: log}, nil
}
