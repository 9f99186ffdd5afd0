package tasks

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// announceEvery is how often a daemon re-marks its queues, so a Redis
// that lost its data serves client.ForQueue again within it.
const announceEvery = time.Minute

// announce marks each queue at its default key with its name, so
// client.ForQueue finds it there, and removes the mark at the default key
// of a queue declared with a key of its own, so ForQueue refuses it
// rather than write where no daemon serves. A durable queue is not marked
// either (and loses a mark an earlier configuration left): the Go client
// writes Redis only, and the executor drops a task without a row unrun.
func (m *Manager) announce(ctx context.Context) error {
	for _, name := range m.order {
		q := m.queues[name]
		def := queue.NewKeys(client.TaskQueueKey(name)).Name
		if q.Config.Key == client.TaskQueueKey(name) && !q.Config.Durable {
			if err := m.rdb.Set(ctx, def, name, 0).Err(); err != nil {
				return err
			}
			continue
		}
		if got, err := m.rdb.Get(ctx, def).Result(); err == nil && got == name {
			if err := m.rdb.Del(ctx, def).Err(); err != nil {
				return err
			}
		}
	}
	return nil
}

// announceLoop announces at once and every announceEvery until ctx ends.
func (m *Manager) announceLoop(ctx context.Context) {
	t := time.NewTicker(announceEvery)
	defer t.Stop()
	for {
		if err := m.announce(ctx); err != nil && ctx.Err() == nil {
			m.log.Warn("cannot mark task queues for client.ForQueue; retrying", zap.Error(err))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
