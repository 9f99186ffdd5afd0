package consumer

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// NamedKeys is one task queue for TaskStatsCollector: its name (the
// `queue` label) and its keys.
type NamedKeys struct {
	Name string
	Keys queue.Keys
}

// TaskStatsCollector exports the gauges of the task queues declared in the
// queues file, labelled by queue, at scrape time: one statsScript call per
// queue per scrape (the order queue's script, so the same bounded cost and
// the same meaning), nothing in between. Like the order queue's gauges they
// are read from Redis and the same on every replica: aggregate them with
// max(), never sum().
//
// Only the queues given to NewTaskStatsCollector are reported, so the label
// is bounded by the file and a queue removed from it disappears with the
// next restart (Prometheus marks its series stale); a queue whose read
// fails is left out of that scrape rather than reported wrong.
type TaskStatsCollector struct {
	rdb     redis.Scripter
	queues  []NamedKeys
	timeout time.Duration
	onError func(queue string, err error)

	depth, overdue, oldest, dead, leased *prometheus.Desc
}

// Task queue gauge names (docs/tasks.md, testdata/task_metrics.txt).
const (
	TaskQueueDepthName         = "orderdelay_task_queue_depth"
	TaskQueueOverdueName       = "orderdelay_task_queue_overdue"
	TaskQueueOldestOverdueName = "orderdelay_task_queue_oldest_overdue_seconds"
	TaskQueueDeadLettersName   = "orderdelay_task_queue_dead_letters"
	TaskQueueLeasedName        = "orderdelay_task_queue_leased"
)

// NewTaskStatsCollector returns a collector for queues. onError, if set, is
// told about each failed read.
func NewTaskStatsCollector(rdb redis.Scripter, queues []NamedKeys, onError func(queue string, err error)) *TaskStatsCollector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, []string{"queue"}, nil)
	}
	return &TaskStatsCollector{
		rdb: rdb, queues: queues, timeout: 2 * time.Second, onError: onError,
		depth:   d(TaskQueueDepthName, "Tasks in the queue's sorted set: waiting, leased or backing off, by queue."),
		overdue: d(TaskQueueOverdueName, "Tasks past their due time and not done: waiting, leased or backing off, by queue."),
		oldest:  d(TaskQueueOldestOverdueName, "Age of the oldest task past its due time (0 if none), by queue."),
		dead:    d(TaskQueueDeadLettersName, "Tasks in the dead-letter set, by queue."),
		leased:  d(TaskQueueLeasedName, "Tasks leased (by any replica or poll) or backing off before a retry, by queue."),
	}
}

// Describe implements prometheus.Collector.
func (c *TaskStatsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.depth, c.overdue, c.oldest, c.dead, c.leased} {
		ch <- d
	}
}

// Collect implements prometheus.Collector. It reads at most statsParallel
// queues at once, all within one timeout.
func (c *TaskStatsCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	each := make([]queue.Stats, len(c.queues))
	errs := make([]error, len(c.queues))
	sem := make(chan struct{}, statsParallel)
	var wg sync.WaitGroup
	for i, q := range c.queues {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			each[i], errs[i] = queue.ReadStats(ctx, c.rdb, q.Keys)
		}()
	}
	wg.Wait()
	for i, q := range c.queues {
		if errs[i] != nil {
			if c.onError != nil {
				c.onError(q.Name, fmt.Errorf("queue %s: %w", q.Name, errs[i]))
			}
			continue
		}
		s := each[i]
		ch <- prometheus.MustNewConstMetric(c.depth, prometheus.GaugeValue, float64(s.Depth), q.Name)
		ch <- prometheus.MustNewConstMetric(c.overdue, prometheus.GaugeValue, float64(s.Overdue), q.Name)
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, s.OldestDue.Seconds(), q.Name)
		ch <- prometheus.MustNewConstMetric(c.dead, prometheus.GaugeValue, float64(s.DeadLetters), q.Name)
		ch <- prometheus.MustNewConstMetric(c.leased, prometheus.GaugeValue, float64(s.Held), q.Name)
	}
}
