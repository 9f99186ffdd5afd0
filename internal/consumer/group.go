package consumer

import (
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"golang.org/x/time/rate"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Group serves one logical queue kept in several sorted sets: the queue key
// and its shards (ORDERDELAY_QUEUE_SHARDS, see queue.ShardKey). It runs one
// Consumer per key, each with its own scan loop, wake-up channel and head
// check, so a backlog in one shard never delays another's deadlines, and
// every Redis script still touches the keys of one slot only.
//
// Fairness: the consumers share one budget of Workers slots (and one
// MaxCloseRate limiter). A scan loop takes a slot before it claims and the
// claimed batch returns it when done; loops waiting for a slot are served
// in arrival order (a Go channel's waiting senders are queued FIFO), so
// when every shard has a backlog they take turns batch by batch, and the
// database sees at most Workers batches at once, as unsharded.
//
// Idle cost: each key's head check runs every HeadCheck × keys, so all of
// them together poll as often as an unsharded queue's (about 3 times a
// second by default); on top come one claim per key per ScanInterval and the wake
// subscriptions' health-check pings (go-redis: one per key every 3 s).
type Group struct {
	cons []*Consumer
}

// NewGroup returns consumers for keys (the queue key first, then the
// shards), configured as cfg (whose Keys is ignored). With one key it is
// exactly New(cfg) on that key; it refuses what New refuses.
func NewGroup(cfg Config, keys []queue.Keys, rdb redis.UniversalClient, store Store, m *metrics.Metrics, log *zap.Logger) (*Group, error) {
	if len(keys) == 1 {
		cfg.Keys = keys[0]
		c, err := New(cfg, rdb, store, m, log)
		if err != nil {
			return nil, err
		}
		return &Group{cons: []*Consumer{c}}, nil
	}
	if err := cfg.check(store); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	cfg.Slots = make(chan struct{}, cfg.Workers)
	if cfg.MaxCloseRate > 0 {
		cfg.Limiter = rate.NewLimiter(rate.Limit(cfg.MaxCloseRate), cfg.BatchSize)
	}
	if cfg.HeadCheck > 0 {
		cfg.HeadCheck *= time.Duration(len(keys))
	}
	owner := cfg.Owner
	g := &Group{}
	for i, k := range keys {
		c := cfg
		c.Keys = k
		c.Family = keys
		c.SharedWake = true
		if i > 0 {
			c.Owner = owner + "#" + strconv.Itoa(i-1) // shard i-1; lease tokens say which
		}
		cons, err := New(c, rdb, store, m, log.With(zap.String("queue", k.Queue)))
		if err != nil {
			return nil, err
		}
		g.cons = append(g.cons, cons)
	}
	return g, nil
}

// Consumers returns the group's consumers, the queue key's first.
func (g *Group) Consumers() []*Consumer { return g.cons }

// Run runs every consumer until ctx ends and returns when all have shut
// down (each as Consumer.Run: stop claiming, drain within DrainTimeout,
// hand back; they do so concurrently, so the group drains within one
// DrainTimeout too).
func (g *Group) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	if len(g.cons) > 1 {
		// One subscription for every key's wake channel: one connection and
		// one health-check ping instead of one per key.
		wakes := make(map[string]chan int64, len(g.cons))
		for _, c := range g.cons {
			wakes[c.cfg.Keys.Wake] = c.wake
		}
		subDone := subscribe(ctx, g.cons[0].rdb, wakes)
		defer func() { <-subDone }()
	}
	for _, c := range g.cons {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.Run(ctx) //nolint:errcheck // returns nil when ctx ends
		}()
	}
	wg.Wait()
	return nil
}

// LastBeat is the oldest of the consumers' heartbeats: the group is alive
// only if every scan loop is.
func (g *Group) LastBeat() time.Time {
	oldest := g.cons[0].LastBeat()
	for _, c := range g.cons[1:] {
		if b := c.LastBeat(); b.Before(oldest) {
			oldest = b
		}
	}
	return oldest
}

// statsParallel bounds the concurrent stats reads of ReadStatsAll.
const statsParallel = 8

// ReadStatsAll reads the gauges of every key of a logical queue and sums
// them: depth, overdue and dead letters add up, the oldest overdue age is
// the largest and the next deadline the earliest. It also returns each
// key's own Stats, in the order of keys.
func ReadStatsAll(ctx context.Context, rdb redis.Scripter, keys []queue.Keys) (queue.Stats, []queue.Stats, error) {
	each := make([]queue.Stats, len(keys))
	errs := make([]error, len(keys))
	sem := make(chan struct{}, statsParallel)
	var wg sync.WaitGroup
	for i, k := range keys {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			each[i], errs[i] = queue.ReadStats(ctx, rdb, k)
		}()
	}
	wg.Wait()
	var sum queue.Stats
	for i, s := range each {
		if errs[i] != nil {
			return queue.Stats{}, nil, errs[i]
		}
		sum.Now = maxTime(sum.Now, s.Now)
		sum.Depth += s.Depth
		sum.Overdue += s.Overdue
		sum.DeadLetters += s.DeadLetters
		sum.Held += s.Held
		sum.OldestDue = max(sum.OldestDue, s.OldestDue)
		if !s.NextDeadline.IsZero() && (sum.NextDeadline.IsZero() || s.NextDeadline.Before(sum.NextDeadline)) {
			sum.NextDeadline = s.NextDeadline
		}
	}
	return sum, each, nil
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// groupStatsCollector is StatsCollector over every key of a logical queue.
type groupStatsCollector struct {
	*StatsCollector
	all []queue.Keys
}

// NewGroupStatsCollector returns a collector of the queue gauges summed
// over keys (see ReadStatsAll); with one key it is NewStatsCollector.
func NewGroupStatsCollector(rdb redis.Scripter, keys []queue.Keys, onError func(error)) prometheus.Collector {
	sc := NewStatsCollector(rdb, keys[0], onError)
	if len(keys) == 1 {
		return sc
	}
	return &groupStatsCollector{StatsCollector: sc, all: keys}
}

// Collect implements prometheus.Collector.
func (c *groupStatsCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	s, _, err := ReadStatsAll(ctx, c.rdb, c.all)
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
