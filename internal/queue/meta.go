package queue

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// TaskKeyPrefix starts the key of every task queue whose entry in the
// queues file names no key of its own: queue "callrecord" lives at
// "delaytask:callrecord".
const TaskKeyPrefix = "delaytask:"

// TaskQueueKey is the default key of the task queue named name.
func TaskQueueKey(name string) string { return TaskKeyPrefix + name }

// Meta is what the daemon writes into a task queue's meta hash ({Q}:meta)
// from its queues file: see MetaDurable, MetaMaxPending and MetaName.
type Meta struct {
	Durable    bool
	MaxPending int64
	Name       string
}

// WriteMeta writes every field of the meta hash.
func (s *Store) WriteMeta(ctx context.Context, m Meta) error {
	durable := "0"
	if m.Durable {
		durable = "1"
	}
	return s.rdb.HSet(ctx, s.keys.Meta, MetaDurable, durable, MetaMaxPending, strconv.FormatInt(m.MaxPending, 10),
		MetaName, m.Name).Err()
}

// MetaNameDurable reads the meta hash's name and durable fields as they
// are ("" for an absent field), for client.ForQueue to judge.
func (s *Store) MetaNameDurable(ctx context.Context) (name, durable string, err error) {
	meta, err := s.rdb.HMGet(ctx, s.keys.Meta, MetaName, MetaDurable).Result()
	if err != nil {
		return "", "", err
	}
	if len(meta) != 2 {
		return "", "", fmt.Errorf("meta: %d values for 2 fields", len(meta))
	}
	name, _ = meta[0].(string)
	durable, _ = meta[1].(string)
	return name, durable, nil
}

// Unname removes the meta hash's name field if it holds name: the queue
// of that name no longer lives at these keys.
func (s *Store) Unname(ctx context.Context, name string) error {
	got, err := s.rdb.HGet(ctx, s.keys.Meta, MetaName).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("read meta at its default key: %w", err)
	}
	if got == name {
		if err := s.rdb.HDel(ctx, s.keys.Meta, MetaName).Err(); err != nil {
			return fmt.Errorf("unname its default key: %w", err)
		}
	}
	return nil
}

// DropLegacyName deletes the obsolete {Q}:name mark (see Keys.Name) if it
// holds name.
func (s *Store) DropLegacyName(ctx context.Context, name string) error {
	old := s.keys.Name
	got, err := s.rdb.Get(ctx, old).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("read %s: %w", old, err)
	}
	if got == name {
		if err := s.rdb.Del(ctx, old).Err(); err != nil {
			return fmt.Errorf("delete %s: %w", old, err)
		}
	}
	return nil
}
