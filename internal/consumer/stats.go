package consumer

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// StatsCollector exports Stats at scrape time, so the gauges cost Redis one
// script call per scrape and nothing in between.
type StatsCollector struct {
	rdb     redis.Scripter
	keys    queue.Keys
	timeout time.Duration
	onError func(error)

	depth, overdue, oldest, dead *prometheus.Desc
}

// NewStatsCollector returns a collector for the queue with keys k. onError,
// if set, is told about failed reads (the gauges are then left out of that
// scrape rather than reported wrong).
func NewStatsCollector(rdb redis.Scripter, k queue.Keys, onError func(error)) *StatsCollector {
	return &StatsCollector{
		rdb: rdb, keys: k, timeout: 2 * time.Second, onError: onError,
		depth:   prometheus.NewDesc("orderdelay_queue_depth", "Entries in the queue: waiting, leased or backing off.", nil, nil),
		overdue: prometheus.NewDesc("orderdelay_overdue_orders", "Entries past their deadline, leased ones included.", nil, nil),
		oldest:  prometheus.NewDesc("orderdelay_oldest_overdue_seconds", "Age of the oldest entry past its deadline (0 if none).", nil, nil),
		dead:    prometheus.NewDesc("orderdelay_dead_letter_depth", "Entries in the dead-letter set.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *StatsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.depth
	ch <- c.overdue
	ch <- c.oldest
	ch <- c.dead
}

// Collect implements prometheus.Collector.
func (c *StatsCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	s, err := queue.ReadStats(ctx, c.rdb, c.keys)
	if err != nil {
		if c.onError != nil {
			c.onError(err)
		}
		return
	}
	ch <- prometheus.MustNewConstMetric(c.depth, prometheus.GaugeValue, float64(s.Depth))
	ch <- prometheus.MustNewConstMetric(c.overdue, prometheus.GaugeValue, float64(s.Overdue))
	ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, s.OldestDue.Seconds())
	ch <- prometheus.MustNewConstMetric(c.dead, prometheus.GaugeValue, float64(s.DeadLetters))
}
