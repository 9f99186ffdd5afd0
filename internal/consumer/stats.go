package consumer

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// Stats are the queue's gauges, read from Redis in one step. They are the
// same on every replica.
type Stats struct {
	Now          time.Time     // Redis's clock
	Depth        int64         // entries queued, leased or backing off
	Overdue      int64         // entries past their deadline, leased ones included
	OldestDue    time.Duration // age of the oldest overdue entry (0 if none)
	DeadLetters  int64         // entries in the dead-letter set
	NextDeadline time.Time     // earliest deadline still ahead (zero if none)
	Held         int64         // entries leased or backing off, by any replica or poll
}

// ReadStats reads the gauges of the queue with keys k.
func ReadStats(ctx context.Context, rdb redis.Scripter, k queue.Keys) (Stats, error) {
	v, err := statsScript.Run(ctx, rdb, []string{k.Queue, k.Inflight, k.Deadlines, k.Dead, k.Leases, k.LeaseBatch, k.Lease}).Int64Slice()
	if err != nil {
		return Stats{}, fmt.Errorf("read stats: %w", err)
	}
	if len(v) != 7 {
		return Stats{}, fmt.Errorf("read stats: %w: %d fields, want 7", errReply, len(v))
	}
	s := Stats{Now: time.UnixMilli(v[0]), Depth: v[1], Overdue: v[2], DeadLetters: v[4], Held: v[6]}
	if v[3] >= 0 && v[3] <= v[0] {
		s.OldestDue = time.Duration(v[0]-v[3]) * time.Millisecond
	}
	if v[5] >= 0 {
		s.NextDeadline = time.UnixMilli(v[5])
	}
	return s, nil
}

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
	s, err := ReadStats(ctx, c.rdb, c.keys)
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
