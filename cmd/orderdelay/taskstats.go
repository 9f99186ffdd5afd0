package main

import (
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// taskQueueKeys lists the queues of the file, in file order, for the task
// queue gauges: every replica reports them, read from Redis at scrape time,
// exactly like the order queue's.
func taskQueueKeys(m *tasks.Manager) []consumer.NamedKeys {
	out := make([]consumer.NamedKeys, 0, len(m.Names()))
	for _, name := range m.Names() {
		r, _ := m.Queue(name)
		out = append(out, consumer.NamedKeys{Name: name, Keys: r.Keys})
	}
	return out
}
