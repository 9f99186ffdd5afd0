package tasks

import (
	"context"
	"fmt"
	"time"
)

// PurgeDead applies each queue's dead-letter retention (Queue.Retention of
// the global age and cap) to its dead letters, which go with their
// payloads unless a live task of the same id owns one. It returns how many
// it purged per queue (queues with nothing purged are left out) and the
// first error; a failed queue does not stop the others.
func (m *Manager) PurgeDead(ctx context.Context, globalAge time.Duration, globalMax int) (map[string]int, error) {
	out := map[string]int{}
	var first error
	for _, name := range m.order {
		r := m.queues[name]
		age, keep := r.Config.Retention(globalAge, globalMax)
		if age == 0 && keep == 0 {
			continue
		}
		n, err := r.Store.PurgeDead(ctx, age, keep)
		if n > 0 {
			out[name] = n
		}
		if err != nil && first == nil {
			first = fmt.Errorf("queue %q: %w", name, err)
		}
	}
	return out, first
}

// PurgesDead reports whether any queue has a dead-letter retention under
// the global age and cap, i.e. whether PurgeDead can ever purge anything.
func (m *Manager) PurgesDead(globalAge time.Duration, globalMax int) bool {
	for _, name := range m.order {
		if age, keep := m.queues[name].Config.Retention(globalAge, globalMax); age > 0 || keep > 0 {
			return true
		}
	}
	return false
}
