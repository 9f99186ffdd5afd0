package tasks

import (
	"context"
	"fmt"
	"math/rand/v2"
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
// scripts obey (queue.MetaDurable, queue.MetaMaxPending) and the queue's
// name (queue.MetaName), by which client.ForQueue finds a queue at its
// default key. Every field is written each time, so a queue switched from
// durable to not (or given a new cap) is seen as such from the daemon's
// next start. A queue the file gives a key of its own loses the name an
// earlier configuration left at its default key, so ForQueue refuses it
// rather than write where no daemon serves. Replicas with different files
// (a rolling update) overwrite each other until the update completes.
func WriteMeta(ctx context.Context, rdb redis.UniversalClient, f File) error {
	for _, q := range f.Queues {
		k := queue.NewKeys(q.Key)
		if err := queue.NewStore(rdb, k).WriteMeta(ctx, queue.Meta{Durable: q.Durable, MaxPending: int64(q.MaxPending), Name: q.Name}); err != nil {
			return fmt.Errorf("queue %q: write meta: %w", q.Name, err)
		}
		if def := queue.NewKeys(queue.TaskQueueKey(q.Name)); def.Meta != k.Meta {
			if err := queue.NewStore(rdb, def).Unname(ctx, q.Name); err != nil {
				return fmt.Errorf("queue %q: %w", q.Name, err)
			}
		}
	}
	return nil
}

// dropLegacyNames deletes the "{delaytask:<name>}:name" marks daemons
// before the meta hash's name field wrote for client.ForQueue (the name
// now lives in the meta hash), where they hold the name of a queue of f.
func dropLegacyNames(ctx context.Context, rdb redis.UniversalClient, f File) error {
	for _, q := range f.Queues {
		if err := queue.NewStore(rdb, queue.NewKeys(queue.TaskQueueKey(q.Name))).DropLegacyName(ctx, q.Name); err != nil {
			return fmt.Errorf("queue %q: %w", q.Name, err)
		}
	}
	return nil
}

// KeepMeta writes the queues' meta hashes at once, retrying every second
// until Redis answers, then every metaRefresh (jittered), until ctx ends.
// Its first pass also deletes the ":name" marks of older daemons.
func (m *Manager) KeepMeta(ctx context.Context) {
	f := File{}
	for _, name := range m.order {
		f.Queues = append(f.Queues, m.queues[name].Config)
	}
	legacy := true // old ":name" marks may remain
	for {
		wait := metaRefresh/2 + time.Duration(rand.Int64N(int64(metaRefresh/2)))
		err := WriteMeta(ctx, m.rdb, f)
		if err == nil && legacy {
			if err = dropLegacyNames(ctx, m.rdb, f); err == nil {
				legacy = false
			}
		}
		if err != nil {
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
